"""The live view (#27): the periodic stats line, the vLLM-style per-token and per-step metrics and
the bounded-cardinality expert view, in process on the real ``EngineMetrics`` registry (the live
serve run is in tests/test_serve.py)."""

from __future__ import annotations

import re

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from xllm_eplb.engine.live_stats import LiveStats
from xllm_eplb.engine.scheduler import Request
from xllm_eplb.eplb.placement import logical_loads, replica_counts
from xllm_eplb.model.batch import RankBatch, SeqRow
from xllm_eplb.obs.metrics import EngineMetrics
from xllm_eplb.obs.stats_line import StatsLine


def _samples(m: EngineMetrics) -> dict:
    out = {}
    for fam in text_string_to_metric_families(m.render().decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _value(m, name, **labels):
    return _samples(m)[(name, tuple(sorted((k, str(v)) for k, v in labels.items())))]


def test_logical_loads_sum_replicas_under_the_placement():
    placement = np.array([[0, 1, 2, 0], [3, 3, 1, 2]])          # 2 layers, 4 slots, E=4
    slots = np.array([[5, 1, 2, 7], [4, 6, 0, 9]])
    assert logical_loads(slots, placement, 4).tolist() == [[12, 1, 2, 0], [0, 0, 9, 10]]
    assert replica_counts(placement, 4).tolist() == [[2, 1, 1, 0], [0, 1, 1, 2]]


def test_stats_line_rates_reset_and_format():
    s = StatsLine(10.0, now=100.0)
    s.count(400, 0)
    s.count(0, 50)
    assert not s.due(109.9) and s.due(110.0)
    line = s.line(110.0, running=3, waiting=1, kv_usage=0.0123, balancedness=0.81234,
                  placement_epoch=2, last_rebalance_at=104.0)
    assert line == ("engine stats prompt_tokens_per_s=40 generation_tokens_per_s=5 running=3 "
                    "waiting=1 kv_cache_usage=1.2% balancedness=0.812 placement_epoch=2 "
                    "last_rebalance_s=6")
    line = s.line(115.0, running=0, waiting=0, kv_usage=0.0, balancedness=None, placement_epoch=0,
                  last_rebalance_at=None)              # a new window: nothing counted since
    assert "prompt_tokens_per_s=0 " in line and "balancedness=- " in line
    assert line.endswith("last_rebalance_s=never")
    assert not StatsLine(0.0, now=0.0).due(1e9)       # --log_stats_interval=0: off
    line = s.line(120.0, running=16, waiting=24, kv_usage=0.0, balancedness=None,
                  placement_epoch=0, last_rebalance_at=None, waiting_for_slot=24, max_batch_size=8)
    assert "running=16 waiting=24 waiting_for_slot=24 max_batch_size=8 kv_cache_usage" in line


def _request(rid: int, prompt: int, arrival: float) -> Request:
    r = Request(prompt=list(range(prompt)), max_tokens=8, arrival=arrival)
    r.req_id = rid
    return r


def test_live_stats_feed_the_vllm_style_metrics_and_the_line():
    m = EngineMetrics(2, 1, hot_experts=2)
    live = LiveStats(m, num_layers=1, num_experts=4, kv_capacity=2 * 4 * 100,
                     stats_interval_s=5.0, now=0.0)
    a, b = _request(1, 6, arrival=0.0), _request(2, 3, arrival=0.5)
    running = {1: a, 2: b}
    # step 1: both prefill (queue 1.0 s and 0.5 s); step 2: both decode
    live.on_scheduled([RankBatch([SeqRow(1, a.prompt, 0, True)]),
                       RankBatch([SeqRow(2, b.prompt, 0, True)])], running, now=1.0)
    live.on_tokens([1, 2], now=1.2)
    a.output, b.output = [7], [7]
    live.on_scheduled([RankBatch([SeqRow(1, [7], 6, False)]),
                       RankBatch([SeqRow(2, [7], 3, False)])], running, now=1.3)
    live.on_tokens([1, 2], now=1.5)
    a.output, b.output = [7, 8], [7, 8]
    a.first_token_at, a.finished_at = 1.2, 1.5
    live.on_finished([a])
    assert 1 not in live.last_token and 2 in live.last_token
    assert _value(m, "xllm_eplb_batch_size_count") == 2
    assert _value(m, "xllm_eplb_batch_size_sum") == 4
    assert _value(m, "xllm_eplb_tokens_per_step_sum") == 9 + 2
    assert _value(m, "xllm_eplb_request_queue_time_seconds_sum") == pytest.approx(1.5)
    assert _value(m, "xllm_eplb_inter_token_latency_seconds_count") == 2
    assert _value(m, "xllm_eplb_inter_token_latency_seconds_sum") == pytest.approx(0.6)
    assert _value(m, "xllm_eplb_time_per_output_token_seconds_sum") == pytest.approx(0.3)
    # experts: slot loads under the placement, replicas from the placement
    placement = np.array([[0, 1, 2, 0, 3, 1]])
    live.on_slot_loads(np.array([[10, 1, 3, 10, 0, 1]]), placement)
    due = live.refresh(5.0, running={2: b}, waiting=4, placement=placement, balancedness=0.9,
                       placement_epoch=1, last_rebalance_at=2.0)
    line, busy = due
    assert busy and line.startswith("engine stats prompt_tokens_per_s=1.8 "
                                    "generation_tokens_per_s=0.8 running=1 waiting=4 ")
    assert "kv_cache_usage=0.6% balancedness=0.900 placement_epoch=1 last_rebalance_s=3" in line
    assert _value(m, "xllm_eplb_kv_cache_tokens") == 5
    assert _value(m, "xllm_eplb_kv_cache_usage_ratio") == pytest.approx(5 / 800)
    # expert 0: 20 of 25 picks (mean 6.25) on 2 replicas; expert 1: 2 picks, 2 replicas
    assert _value(m, "xllm_eplb_hot_expert_id", layer=0, hot=0) == 0
    assert _value(m, "xllm_eplb_hot_expert_load_ratio", layer=0, hot=0) == pytest.approx(3.2)
    assert _value(m, "xllm_eplb_hot_expert_replicas", layer=0, hot=0) == 2
    assert _value(m, "xllm_eplb_hot_expert_id", layer=0, hot=1) == 2
    assert _value(m, "xllm_eplb_hot_expert_replicas", layer=0, hot=1) == 1
    assert live.refresh(6.0, running={}, waiting=0, placement=placement, balancedness=None,
                        placement_epoch=1, last_rebalance_at=2.0) is None     # not due yet
    line, busy = live.refresh(11.0, running={}, waiting=0, placement=placement,
                              balancedness=None, placement_epoch=1, last_rebalance_at=2.0)
    assert not busy                                    # idle: the engine logs it at debug


def test_expert_series_stay_bounded_while_the_hot_set_moves():
    """Top-k by label position (layer, hot), never by expert id: a moving hot set does not grow
    the series; every expert only with the opt-in."""
    L, E, k = 3, 16, 4
    m = EngineMetrics(4, L, hot_experts=k)
    live = LiveStats(m, num_layers=L, num_experts=E, kv_capacity=1, stats_interval_s=0,
                     now=0.0)
    placement = np.tile(np.arange(E), (L, 1))
    rng = np.random.default_rng(0)
    for step in range(200):                            # the hot expert moves every step
        slots = rng.integers(0, 3, size=(L, E))
        slots[:, step % E] += 50
        live.on_slot_loads(slots, placement)
        live.refresh(float(step), running={}, waiting=0, placement=placement,
                     balancedness=None, placement_epoch=0, last_rebalance_at=None)
    names = [n for n, _ in _samples(m) if re.match(r"xllm_eplb_(hot_expert_|expert_(load|rep))", n)]
    assert len(names) == 3 * L * k and not any(n.startswith("xllm_eplb_expert_") for n in names)
    every = EngineMetrics(4, L, hot_experts=0, all_experts=True)
    live = LiveStats(every, num_layers=L, num_experts=E, kv_capacity=1, stats_interval_s=0,
                     now=0.0)
    live.on_slot_loads(np.ones((L, E), dtype=np.int64), placement)
    live.refresh(1.0, running={}, waiting=0, placement=placement, balancedness=None,
                 placement_epoch=0, last_rebalance_at=None)
    names = [n for n, _ in _samples(every) if re.match(r"xllm_eplb_expert_(load|rep)", n)]
    assert len(names) == 2 * L * E
    assert _value(every, "xllm_eplb_expert_load_ratio", layer=2, expert=15) == 1.0


def test_balance_note_says_why_balancedness_is_below_the_initial():
    from xllm_eplb.engine.telemetry import balance_note

    st = {"enabled": True, "balancedness_mean": 0.79, "initial_balancedness_mean": 0.83,
          "layers_rolled_back": 2, "layers_committed": 5}
    note = balance_note(st, "cost")
    assert note.startswith("balancedness 0.7900 is below the initial 0.8300: rounds plan on "
                           "the modelled step critical path")
    assert "2 layer activations were rolled back" in note and "cost_model.rollbacks" in note
    off = balance_note({"enabled": False, "balancedness_mean": 0.7,
                        "initial_balancedness_mean": 0.8}, "cost")
    assert "EPLB is off" in off and "critical path" not in off and "committed" not in off
    assert balance_note(dict(st, balancedness_mean=0.9), "cost") is None
    assert balance_note({"balancedness_mean": 0.5}, "cost") is None     # no initial window yet
