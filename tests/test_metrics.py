"""Engine metrics: names, parse-ability, per-layer gating, telemetry from real ForwardOutputs."""

from __future__ import annotations

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from xllm_eplb.engine.scheduler import Request
from xllm_eplb.engine.telemetry import Telemetry, critical_path, rank_loads
from xllm_eplb.eplb.balance import balancedness
from xllm_eplb.ipc.messages import ForwardOutput, decode, encode
from xllm_eplb.ipc.records import ExecutorStats, StepTimings, WorkerHeartbeat
from xllm_eplb.obs.metrics import EngineMetrics, metric_names


def _families(m: EngineMetrics) -> dict:
    return {f.name: f for f in text_string_to_metric_families(m.render().decode())}


def _out(rank, per_slot, xc, hb=None):
    """per_slot [L, S] token counts -> a ForwardOutput with prefix-sum counters."""
    c = np.cumsum(np.asarray(per_slot, dtype=np.int64), axis=1)
    t = StepTimings(expert_cpu_s=list(xc))
    return ForwardOutput(step=1, rank=rank, counters=c, timings=t,
                         heartbeat=hb or WorkerHeartbeat())


def test_every_metric_is_prefixed_and_parses():
    m = EngineMetrics(4, 3, version="0.1", backend="gloo", policy="balanced")
    fams = _families(m)
    assert fams and all(name.startswith("xllm_eplb_") for name in fams)
    assert fams["xllm_eplb_build_info"].samples[0].labels == {
        "version": "0.1", "backend": "gloo", "policy": "balanced"}
    assert [s.value for s in fams["xllm_eplb_worker_up"].samples] == [0, 0, 0, 0]
    names = metric_names(m.registry)
    for want in ("xllm_eplb_rank_tokens_total", "xllm_eplb_policy_duration_seconds_bucket",
                 "xllm_eplb_p2p_bytes_total", "xllm_eplb_heartbeat_age_seconds",
                 "xllm_eplb_ring_full_total", "xllm_eplb_update_expert_weight_seconds_count"):
        assert want in names


def test_counters_that_start_at_zero_are_exported_from_the_start():
    """Regression: a labelled counter had no sample until its first increment, so dashboards
    showed "No data" instead of 0."""
    text = EngineMetrics(2, 3).render().decode()
    for line in ('xllm_eplb_ring_full_total{ring="input"} 0.0',
                 'xllm_eplb_requests_total{result="cancelled"} 0.0',
                 'xllm_eplb_steps_total{kind="decode"} 0.0',
                 'xllm_eplb_rebalance_layers_total{result="timed_out"} 0.0',
                 'xllm_eplb_rank_tokens_total{rank="1"} 0.0',
                 'xllm_eplb_p2p_bytes_total{direction="sent"} 0.0'):
        assert line in text.splitlines(), line


def test_per_layer_series_only_behind_the_flag():
    assert "xllm_eplb_layer_balancedness_ratio" not in metric_names(EngineMetrics(4, 3).registry)
    m = EngineMetrics(4, 3, per_layer=True)
    m.set_balance([0.5, 1.0, 0.75])
    fam = _families(m)["xllm_eplb_layer_balancedness_ratio"]
    assert {s.labels["layer"]: s.value for s in fam.samples} == {"0": 0.5, "1": 1.0, "2": 0.75}


def test_inc_to_advances_counters_to_cumulative_totals():
    m = EngineMetrics(2, 1)
    m.inc_to("r", m.rounds, 3)
    m.inc_to("r", m.rounds, 3)
    m.inc_to("r", m.rounds, 5)
    assert _families(m)["xllm_eplb_rebalance_rounds"].samples[0].value == 5


def test_telemetry_balance_tokens_and_critical_path():
    m = EngineMetrics(2, 2)
    t = Telemetry(m, 2, 2)
    # layer 0: rank loads 6 / 2 -> balancedness 4/6; layer 1: 3 / 3 -> 1
    outs = [_out(0, [[4, 2], [1, 2]], [0.4, 0.1]), _out(1, [[1, 1], [3, 0]], [0.2, 0.3])]
    np.testing.assert_array_equal(rank_loads([o.counters for o in outs]), [[6, 2], [3, 3]])
    assert critical_path(outs) == pytest.approx((0.4 + 0.3, 1.0, 2))
    t.on_step("decode", outs, 0.01)
    fams = _families(m)
    bal = {s.labels["stat"]: s.value for s in fams["xllm_eplb_balancedness_ratio"].samples}
    want = balancedness(np.array([[6, 2], [3, 3]]))
    assert bal == pytest.approx({"min": want.min(), "mean": want.mean()})
    tok = {s.labels["rank"]: s.value for s in fams["xllm_eplb_rank_tokens"].samples
           if s.name.endswith("_total")}
    assert tok == {"0": 9, "1": 5}
    assert t.critical_path_summary()["decode_critical_s"] == pytest.approx(0.7)
    s = t.balance_summary()
    assert s["balancedness_min"] == pytest.approx(want.min()) and len(s["layers"]) == 2


def test_telemetry_warmup_is_not_counted_and_activations_are_observed():
    m = EngineMetrics(2, 1)
    t = Telemetry(m, 1, 2)
    hb = WorkerHeartbeat(executor=ExecutorStats(
        activations=1, last_total_ms=12.0, last_transfer_ms=3.0, p2p_bytes_total=4096,
        prepares_ok=1, last_prepare_ms=1.0))
    t.on_step("warmup", [_out(0, [[5, 5]], [1.0], hb), _out(1, [[0, 1]], [0.0], hb)], 0.1)
    assert t.balance_summary()["balancedness_mean"] is None
    fams = _families(m)
    upd = {(s.labels["phase"]): s.value for s in fams["xllm_eplb_update_expert_weight_seconds"].samples
           if s.name.endswith("_count")}
    assert upd["total"] == 2                                  # one activation on each rank
    p2p = [s.value for s in fams["xllm_eplb_p2p_bytes"].samples if s.name.endswith("_total")]
    assert p2p == [8192]


def test_request_metrics():
    m = EngineMetrics(2, 1)
    t = Telemetry(m, 1, 2)
    r = Request(prompt=[1, 2, 3], max_tokens=2)
    r.output = [4, 5]
    r.first_token_at = r.arrival + 0.1
    r.finish("length")
    t.on_requests([r])
    fams = _families(m)
    assert fams["xllm_eplb_generated_tokens"].samples[0].value == 2
    lat = [s for s in fams["xllm_eplb_request_latency_seconds"].samples
           if s.name.endswith("_count")]
    assert lat[0].value == 1


def test_heartbeat_ages_and_eplb_counters():
    import time

    m = EngineMetrics(2, 1)
    t = Telemetry(m, 1, 2)
    t.on_eplb({"rounds": 2, "layers_published": 3, "layers_committed": 2,
               "layers_timed_out": 1, "generation": 2, "layer_in_flight": 0, "samples": 5,
               "last_policy_seconds": 0.01, "heartbeat_at": time.monotonic(),
               "manager_heartbeat_at": time.monotonic() - 4.0})
    hb = WorkerHeartbeat(ts=time.time() - 3.0, executor=ExecutorStats(
        heartbeat_ts=time.time() - 2.0, activations=1, p2p_heartbeat_ts=time.time() - 5.0))
    t.on_step("decode", [_out(0, [[1, 1]], [0.1], hb), _out(1, [[1, 1]], [0.1], hb)], 0.01)
    t.refresh_health(60.0)
    fams = _families(m)
    age = {(s.labels["component"], s.labels["rank"]): s.value
           for s in fams["xllm_eplb_heartbeat_age_seconds"].samples}
    assert age[("executor", "0")] == pytest.approx(2.0, abs=0.5)
    assert age[("worker", "1")] == pytest.approx(3.0, abs=0.5)
    assert age[("rebalance_loop", "engine")] < 1.0 and ("p2p", "0") in age
    # the ages come from the components' own timestamps
    assert age[("manager", "engine")] == pytest.approx(4.0, abs=0.5)
    assert age[("p2p", "1")] == pytest.approx(5.0, abs=0.5)
    layers = {s.labels["result"]: s.value for s in fams["xllm_eplb_rebalance_layers"].samples
              if s.name.endswith("_total")}
    assert layers == {"published": 3, "committed": 2, "timed_out": 1, "regressed": 0,
                      "rolled_back": 0}
    assert fams["xllm_eplb_rebalancing"].samples[0].value == 1


def test_no_heartbeat_gauge_without_a_timestamp():
    """EPLB off: no manager stats and the null executor's zero timestamps -> no age gauges for
    those components (never ``now - 0``)."""
    import time

    m = EngineMetrics(1, 1)
    t = Telemetry(m, 1, 1)
    hb = WorkerHeartbeat(ts=time.time(), executor=ExecutorStats(heartbeat_ts=0.0,
                                                                p2p_heartbeat_ts=0.0))
    t.on_step("decode", [_out(0, [[1, 1]], [0.1], hb)], 0.01)
    t.refresh_health(60.0)
    fams = _families(m)
    comps = {s.labels["component"] for s in fams["xllm_eplb_heartbeat_age_seconds"].samples}
    assert comps == {"worker"}


def test_worker_timings_carry_expert_cpu_to_the_critical_path():
    """Model ``expert_cpu_s`` [L_moe] -> worker ``StepTimings`` -> the wire -> engine critical
    path."""
    from xllm_eplb.worker.worker import step_timings

    t0 = step_timings({"total_s": 0.5, "moe_s": 0.25, "expert_cpu_s": [0.125, 0.25]},
                      step_s=0.5, cpu_s=0.375, eplb_s=0.0625)
    t1 = step_timings({"total_s": 0.5, "moe_s": 0.25, "expert_cpu_s": [0.5, 0.0]},
                      step_s=0.5, cpu_s=0.5, eplb_s=0.0)
    assert t0 == StepTimings(step_s=0.5, cpu_s=0.375, eplb_s=0.0625, expert_cpu_s=[0.125, 0.25],
                             moe_s=0.25)
    outs = [decode(encode(ForwardOutput(step=1, rank=r, counters=np.zeros((2, 1), np.int64),
                                        timings=t), "run"), "run")
            for r, t in enumerate((t0, t1))]
    assert critical_path(outs) == (0.75, 0.875, 2)
    with pytest.raises(KeyError, match="expert_cpu_s"):        # the model must report it
        step_timings({"total_s": 0.5}, step_s=0.5, cpu_s=0.5, eplb_s=0.0)
