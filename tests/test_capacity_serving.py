"""Capacity and fallback on the engine side: the serving numbers from real ForwardOutputs
(dropped / re-routed counters, utilisation spread, step percentiles, comm share), and a real
`xllm-eplb serve` with capacity + fallback on a generated checkpoint: logged once at start,
`/eplb/status` says `outputs_exact: false` and counts what the workers dropped / re-routed."""

from __future__ import annotations

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_serve import _get, _post

from xllm_eplb.engine.telemetry import Telemetry
from xllm_eplb.ipc.messages import ForwardOutput, decode, encode
from xllm_eplb.ipc.records import StepTimings, WorkerHeartbeat
from xllm_eplb.obs.metrics import EngineMetrics


def _out(rank, per_slot, **timings):
    c = np.cumsum(np.asarray(per_slot, dtype=np.int64), axis=1)
    t = StepTimings(expert_cpu_s=[0.001] * len(per_slot), **timings)
    o = ForwardOutput(step=1, rank=rank, counters=c, timings=t, heartbeat=WorkerHeartbeat())
    return decode(encode(o, "run"), "run")                     # through the wire


def test_serving_numbers_from_worker_records():
    m = EngineMetrics(2, 1)
    tele = Telemetry(m, 1, 2)
    # step 1: slot loads [4, 0 | 2, 2] -> std/mean = sqrt(2)/2; step 2: all equal -> 0
    tele.on_step("decode", [_out(0, [[4, 0]], dropped=3, rerouted=1, comm_s=0.25, step_s=1.0),
                            _out(1, [[2, 2]], dropped=1, comm_s=0.25, step_s=1.0)], 0.5)
    tele.on_step("decode", [_out(0, [[1, 1]], rerouted=2, step_s=1.0),
                            _out(1, [[1, 1]], step_s=1.0)], 1.5)
    s = tele.serving_summary()
    assert (s["tokens_dropped"], s["tokens_rerouted"]) == (4, 3)
    assert s["drop_rate"] == 4 / (12 + 4) and s["reroute_rate"] == 3 / 16
    assert s["expert_utilisation_cv_mean"] == pytest.approx((2 ** 0.5 / 2 + 0.0) / 2)
    assert s["expert_utilisation_cv_last"] == 0.0
    assert s["step_p50_s"] == 1.0 and s["step_p99_s"] == pytest.approx(1.49)
    assert s["comm_share"] == 0.5 / 4.0
    fams = {f.name: f for f in text_string_to_metric_families(m.render().decode())}
    assert fams["xllm_eplb_moe_tokens_dropped"].samples[0].value == 4
    assert fams["xllm_eplb_moe_tokens_rerouted"].samples[0].value == 3
    assert fams["xllm_eplb_comm_share"].samples[0].value == 0.125


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_serve_with_capacity_and_fallback_reports_inexact_outputs(hf_ckpts, start_server):
    s = start_server("--model", str(hf_ckpts["deepseek_v3"]), "--workload=none",
                     "--moe_capacity_mode=static", "--moe_capacity_factor=0.5",
                     "--moe_fallback_routing=true", "--eplb_replica_routing=balanced")
    s.wait_ready(180)
    for p in ([5, 17, 300, 42, 8, 9], [7, 3, 11, 12]):
        code, body = _post(s.url, {"prompt": p, "max_tokens": 8, "temperature": 0.0,
                                   "ignore_eos": True})
        assert code == 200, body
    st = _get(s.url + "/eplb/status")
    assert st["outputs_exact"] is False
    c = st["capacity"]
    assert (c["mode"], c["fallback_routing"], c["replica_routing"]) == ("static", True,
                                                                        "balanced")
    assert c["tokens_rerouted"] > 0 and 0 <= c["drop_rate"] < 1
    assert c["step_p99_s"] >= c["step_p50_s"] > 0
    hits = {p.name: p.read_text().count("MoE capacity mode=static")
            for p in [s.out, s.err, *s.log_dir.rglob("*")] if p.is_file()}
    assert sum(hits.values()) >= 1 and all(n <= 1 for n in hits.values()), hits


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_serve_without_capacity_reports_exact_outputs(hf_ckpts, start_server):
    s = start_server("--model", str(hf_ckpts["qwen3_moe"]), "--workload=none")
    s.wait_ready(180)
    code, body = _post(s.url, {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0.0,
                               "ignore_eos": True})
    assert code == 200, body
    st = _get(s.url + "/eplb/status")
    assert st["outputs_exact"] is True
    assert st["capacity"]["tokens_dropped"] == 0 and st["capacity"]["tokens_rerouted"] == 0
