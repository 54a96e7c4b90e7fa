"""`ExpertRecorder`: real prefix-sum counters (``eplb.counters.encode``) under real placements in,
SGLang's ``logical_count`` and the per-step trace out; the dump reads back through the readers
`plan` and `simulate` use, unchanged."""

from __future__ import annotations

import json

import numpy as np
import pytest

from xllm_eplb.eplb import counters as ctr
from xllm_eplb.eplb.loads import read_loads
from xllm_eplb.eplb.placement import initial_phy2log
from xllm_eplb.eplb.recorder import ExpertRecorder, RecordStateError
from xllm_eplb.sim.generators import read_static_loads
from xllm_eplb.sim.trace import Trace, load_trace, save_trace

L, D, E, R = 3, 4, 8, 1
S = E // D + R


def _step(rng, placement):
    """One forward: per-slot counts [L, D, S] -> (per-rank prefix sums, logical [L, E])."""
    per_slot = rng.integers(0, 50, size=(L, D, S))
    logical = np.zeros((L, E), np.int64)
    for li in range(L):
        np.add.at(logical[li], placement[li], per_slot[li].reshape(-1))
    return [ctr.encode(per_slot[:, r]) for r in range(D)], logical


def _placements(rng):
    base = np.tile(initial_phy2log(E, D, R), (L, 1))
    moved = base.copy()
    for li in range(L):          # another valid table: a rank-order permutation of the slots
        moved[li] = base[li][rng.permutation(D * S)]
    return base, moved


def test_counts_match_the_routed_tokens_under_each_placement():
    rng = np.random.default_rng(0)
    rec = ExpertRecorder(L, D, S, E, trace_max_steps=100)
    rec.start(trace=True)
    want, steps = np.zeros((L, E), np.int64), []
    for k, placement in enumerate(_placements(rng) * 3):
        counters, logical = _step(rng, placement)
        rec.add(counters, placement)
        want += logical
        steps.append(logical)
        assert rec.status()["steps"] == k + 1
    dump = rec.dump()
    assert dump["logical_count"] == want.tolist() and dump["recording"] is True
    assert np.array_equal(rec.trace_loads(), np.stack(steps))
    assert rec.stop()["recording"] is False


def test_off_costs_nothing_and_keeps_nothing():
    rng = np.random.default_rng(1)
    rec = ExpertRecorder(L, D, S, E, trace_max_steps=10)
    base, _ = _placements(rng)
    rec.add(_step(rng, base)[0], base)               # never started: ignored
    assert rec.active is False and rec.status()["recorded"] is False
    with pytest.raises(RecordStateError, match="nothing recorded"):
        rec.dump()
    rec.start()
    rec.add(_step(rng, base)[0], base)
    first = rec.stop()
    rec.add(_step(rng, base)[0], base)               # stopped: ignored, data kept
    assert rec.status()["steps"] == first["steps"] == 1
    assert rec.dump()["steps"] == 1


def test_state_rules():
    rec = ExpertRecorder(L, D, S, E, trace_max_steps=10)
    with pytest.raises(RecordStateError, match="no recording is running"):
        rec.stop()
    rec.start()
    with pytest.raises(RecordStateError, match="already running"):
        rec.start()
    with pytest.raises(RecordStateError, match="keeps no per-step trace"):
        rec.trace_loads()
    rec.stop()
    rec.start(trace=True)
    with pytest.raises(RecordStateError, match="no forward step recorded"):
        rec.trace_loads()


def test_trace_cap_keeps_totals_and_bad_outputs_are_skipped():
    rng = np.random.default_rng(2)
    base, _ = _placements(rng)
    rec = ExpertRecorder(L, D, S, E, trace_max_steps=2)
    rec.start(trace=True)
    total = np.zeros((L, E), np.int64)
    for _ in range(5):
        counters, logical = _step(rng, base)
        rec.add(counters, base)
        total += logical
    rec.add([np.zeros((L, S + 1), np.int64)] * D, base)      # wrong shape: rejected
    st = rec.status()
    assert st["steps"] == 5 and st["trace_steps"] == 2 and st["trace_truncated"] is True
    assert st["rejected_outputs"] == 1
    assert rec.dump()["logical_count"] == total.tolist()


def test_dump_and_trace_read_back_through_plan_and_simulate_readers(tmp_path):
    rng = np.random.default_rng(3)
    base, moved = _placements(rng)
    rec = ExpertRecorder(L, D, S, E, trace_max_steps=100)
    rec.start(trace=True)
    for placement in (base, moved, moved):
        rec.add(_step(rng, placement)[0], placement)
    rec.stop()
    dump = rec.dump()
    p = tmp_path / "dump.json"
    p.write_text(json.dumps(dump))
    lf = read_loads(p)                        # `plan --load`
    assert lf.dense_skipped == 0 and lf.loads.dtype == np.int64
    assert lf.loads.tolist() == dump["logical_count"]
    assert np.array_equal(read_static_loads(p), lf.loads)     # `simulate --generate sglang:`
    t = save_trace(Trace(rec.trace_loads(), {"generator": "record"}), tmp_path / "t.npz")
    back = load_trace(t)                      # `simulate --trace`
    assert back.loads.shape == (3, L, E) and back.loads.sum(axis=0).tolist() == \
        dump["logical_count"]
