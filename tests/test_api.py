"""HTTP API: completions through a real scheduler and the single-process reference model,
validation errors as JSON 4xx, the server keeps serving after bad input."""

from __future__ import annotations

import http.client
import json
import threading

import pytest

from xllm_eplb.engine.api import ApiBackend, ApiLimits, ApiServer
from xllm_eplb.engine.scheduler import Scheduler
from xllm_eplb.flags import config_from_dict


class _ReferenceLoop:
    """Step loop over one DP rank running the reference model (same weights as the workers)."""

    def __init__(self, cfg):
        from xllm_eplb.model.transformer import MoETransformer

        self.model = MoETransformer.reference(cfg)
        self.sched = Scheduler(1, 4, cfg.runtime.max_prefill_tokens)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self):
        while not self.stop.is_set():
            self.sched.pull(timeout=0.05)
            if self.sched.has_work:
                batch = self.sched.schedule()[0]
                self.sched.update(self.model.forward_step(batch).sampled)


@pytest.fixture(scope="module")
def server():
    cfg = config_from_dict({"ep_size": 4, "max_prefill_tokens": 64,
                            "max_position_embeddings": 96})
    loop = _ReferenceLoop(cfg)
    lim = ApiLimits(cfg.model.vocab_size, 64, 96, request_timeout_seconds=30)
    backend = ApiBackend(submit=loop.sched.submit, status=lambda: {"policy": "balanced"},
                         metrics=lambda: b"xllm_eplb_up 1\n",
                         health=lambda: (True, {"status": "serving"}), limits=lim)
    api = ApiServer("127.0.0.1", 0, backend)
    api.start()
    loop.thread.start()
    yield api, loop
    loop.stop.set()
    api.close()


def _call(port, method, path, body=None, raw=None):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    c.request(method, path, body=data, headers={"Content-Type": "application/json"})
    r = c.getresponse()
    payload = r.read()
    c.close()
    ctype = r.getheader("Content-Type", "")
    return r.status, (json.loads(payload) if "json" in ctype else payload)


def test_completion_text_and_token_ids_match_the_reference_model(server):
    api, loop = server
    st, body = _call(api.port, "POST", "/v1/completions",
                     {"prompt": "hello", "max_tokens": 5, "ignore_eos": True})
    assert st == 200, body
    ch = body["choices"][0]
    assert len(ch["token_ids"]) == 5 and ch["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 6, "completion_tokens": 5, "total_tokens": 11}
    st, again = _call(api.port, "POST", "/v1/completions",
                      {"prompt_token_ids": [256] + list(b"hello"), "max_tokens": 5,
                       "ignore_eos": True})
    assert st == 200 and again["choices"][0]["token_ids"] == ch["token_ids"]   # greedy


def test_sampling_is_reproducible_with_a_seed(server):
    api, _ = server
    req = {"prompt": "abc", "max_tokens": 6, "temperature": 1.0, "seed": 42, "ignore_eos": True}
    a = _call(api.port, "POST", "/v1/completions", req)[1]["choices"][0]["token_ids"]
    b = _call(api.port, "POST", "/v1/completions", req)[1]["choices"][0]["token_ids"]
    assert a == b


@pytest.mark.parametrize("body,param", [
    ({"max_tokens": 3}, "prompt"),
    ({"prompt": "x", "prompt_token_ids": [1]}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt_token_ids": [1, 99999]}, "prompt_token_ids"),
    ({"prompt_token_ids": []}, "prompt_token_ids"),
    ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "x", "max_tokens": "3"}, "max_tokens"),
    ({"prompt": "x", "temperature": -0.5}, "temperature"),
    ({"prompt": "x" * 80}, "prompt"),                       # > max_prefill_tokens=64
    ({"prompt": "x" * 50, "max_tokens": 60}, "max_tokens"),  # > max_position_embeddings
])
def test_bad_requests_get_a_json_400_naming_the_field(server, body, param):
    api, _ = server
    st, err = _call(api.port, "POST", "/v1/completions", body)
    assert st == 400 and err["error"]["param"] == param, err
    assert err["error"]["message"]


def test_malformed_json_unknown_routes_and_methods(server):
    api, _ = server
    assert _call(api.port, "POST", "/v1/completions", raw=b"{not json")[0] == 400
    assert _call(api.port, "POST", "/v1/completions", raw=b"[1, 2]")[0] == 400
    st, err = _call(api.port, "GET", "/nope")
    assert st == 404 and "nope" in err["error"]["message"]
    assert _call(api.port, "POST", "/metrics", {})[0] == 405
    assert _call(api.port, "GET", "/v1/completions")[0] == 405
    # regression: other methods got http.server's HTML 501 page, not a JSON 405/404
    st, err = _call(api.port, "DELETE", "/health")
    assert st == 405 and err["error"]["message"] == "use GET for /health"
    assert _call(api.port, "PUT", "/v1/completions", {})[0] == 405
    assert _call(api.port, "PATCH", "/nope", {})[0] == 404
    # still serving
    assert _call(api.port, "GET", "/health") == (200, {"status": "serving"})
    st, text = _call(api.port, "GET", "/metrics")
    assert st == 200 and text == b"xllm_eplb_up 1\n"
    assert _call(api.port, "GET", "/eplb/status") == (200, {"policy": "balanced"})


def test_port_in_use_is_an_oserror(server):
    api, _ = server
    with pytest.raises(OSError):
        ApiServer("127.0.0.1", api.port, None)
