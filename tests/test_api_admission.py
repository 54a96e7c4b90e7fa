"""Admission of the real API in front of a real :class:`Engine` whose step loop is not running
(so submitted requests stay waiting): beyond ``--max_waiting_requests`` waiting requests a new
one is a JSON 503 ``overloaded``, and the server keeps answering."""

from __future__ import annotations

import http.client
import json
import time

import pytest

from xllm_eplb.engine.api import ApiBackend, ApiLimits, ApiServer, ServedModel
from xllm_eplb.engine.backend import EngineApi
from xllm_eplb.engine.engine import Engine
from xllm_eplb.engine.tokenizer import ByteTokenizer
from xllm_eplb.flags import config_from_dict

pytestmark = pytest.mark.slow


def _post(port: int, body: dict) -> http.client.HTTPConnection:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request("POST", "/v1/completions", body=json.dumps(body).encode(),
              headers={"Content-Type": "application/json"})
    return c


def _api(cfg, eng: Engine) -> ApiServer:
    """The real API in front of ``eng``, started."""
    lim = ApiLimits(cfg.model.vocab_size, 64, 96, request_timeout_seconds=30)
    view = EngineApi(eng)
    backend = ApiBackend(submit=view.submit, cancel=view.cancel, status=view.status,
                         metrics=view.render_metrics, health=view.health,
                         served=ServedModel("tiny", ByteTokenizer(), lim), admit=view.admit)
    api = ApiServer("127.0.0.1", 0, backend)
    api.start()
    return api


@pytest.mark.timeout(60)
def test_more_waiting_requests_than_allowed_is_a_json_503_overloaded():
    cfg = config_from_dict({"ep_size": 2, "max_waiting_requests": 2})
    eng = Engine(cfg, None, [])
    eng.state = "serving"
    api = _api(cfg, eng)
    held = []
    try:
        for _ in range(2):
            held.append(_post(api.port, {"prompt": "x", "max_tokens": 2}))
        deadline = time.monotonic() + 10
        while eng.sched.load()["waiting"] < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert eng.sched.load() == {"waiting": 2, "running": 0}
        r = _post(api.port, {"prompt": "x", "max_tokens": 2}).getresponse()
        err = json.loads(r.read())["error"]
        assert r.status == 503 and err["code"] == "overloaded", err
        assert "--max_waiting_requests=2" in err["message"]
        c = http.client.HTTPConnection("127.0.0.1", api.port, timeout=10)
        c.request("GET", "/health")
        assert c.getresponse().status == 200
    finally:
        for c in held:
            c.close()
        api.close()


@pytest.mark.timeout(60)
def test_a_request_during_an_elastic_recovery_waits_instead_of_a_503():
    """The engine recovering a death (respawn: 2-8 s): /health answers 503 ``recovering``,
    but a new completion is queued, not refused (bench_elastic run 4: a trial sent right after
    an idle kill got 12 x 503)."""
    from xllm_eplb.elastic.notices import NoticeBox
    from xllm_eplb.elastic.recovery import EngineRecovery, Phase
    from xllm_eplb.obs.metrics import EngineMetrics

    cfg = config_from_dict({"ep_size": 2})
    eng = Engine(cfg, None, [])
    eng.state = "serving"
    m = cfg.model
    rec = EngineRecovery(eng, NoticeBox(lambda t: None, lambda: True, 0), None,
                         num_experts=m.num_experts, slots=cfg.slots_per_rank,
                         num_layers=m.num_layers, silence_s=1.0, join_timeout_s=1.0,
                         metrics=EngineMetrics(2, m.num_layers))
    eng.use_membership(rec)
    rec._to(Phase.DETECT)
    api = _api(cfg, eng)
    held = _post(api.port, {"prompt": "x", "max_tokens": 2})
    try:
        c = http.client.HTTPConnection("127.0.0.1", api.port, timeout=10)
        c.request("GET", "/health")
        r = c.getresponse()
        assert r.status == 503 and json.loads(r.read())["status"] == "recovering"
        deadline = time.monotonic() + 10
        while eng.sched.load()["waiting"] < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert eng.sched.load() == {"waiting": 1, "running": 0}
    finally:
        held.close()
        api.close()
