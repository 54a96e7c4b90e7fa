"""incremental policy: behaviour on small cases and on the real DeepSeek loads (skipped when
../shared/data is absent)."""

from pathlib import Path

import numpy as np
import pytest

from xllm_eplb.eplb.balance import rank_loads_from_phy2log
from xllm_eplb.eplb.loads import read_loads
from xllm_eplb.eplb.placement import diff, initial_phy2log, validate_phy2log
from xllm_eplb.eplb.policy import make_policy
from xllm_eplb.eplb.policy.incremental import best_cut, dedup_ranks, spend_budget

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "sglang_ep_statistics"
needs_data = pytest.mark.skipif(not (DATA / "decode_in1000out1000.json").is_file(),
                                reason="real load data absent")


def fill(cands, prev):
    return np.stack([prev[i] if c is None else c for i, c in enumerate(cands)])


def global_peak(table, loads, d):
    return rank_loads_from_phy2log(table, loads, d).max(axis=1).sum() / (loads.sum() / d)


def test_dedup_frees_same_rank_repeats():
    t = initial_phy2log(8, 2, 1).reshape(1, 2, 5)
    assert dedup_ranks(t)[0].tolist() == [[0, 1, 2, 3, -1], [4, 5, 6, 7, -1]]


def test_best_cut_reaches_must_then_weighs_cost():
    traj = [(0, 10.0), (2, 8.0), (4, 7.0), (6, 6.9)]
    assert best_cut(traj, 10.0, 0.0, 7.5) == 3          # free moves: go to the best peak
    assert best_cut(traj, 10.0, 1.0, 7.5) == 2          # first point <= must, then cost wins
    assert best_cut(traj, 10.0, 0.5, 1.0) == 1          # must unreachable: best net benefit
    assert best_cut([], 10.0, 1.0, 1.0) == -1


def test_spend_budget_prefers_best_gain_per_slot():
    trajs = [[(0, 10.0), (2, 9.0)], [(0, 10.0), (2, 5.0), (4, 3.0)]]
    assert spend_budget(trajs, 2) == [0, 1]
    assert spend_budget(trajs, 4) == [0, 2]
    assert spend_budget(trajs, 0) == [0, 0]


def test_small_skew_balances_and_keeps_slots():
    load = np.array([[400, 300, 50, 50, 40, 40, 30, 30, 20, 20, 10, 10]])
    pol = make_policy("incremental", 4, 12, 1, 0.0)
    init = initial_phy2log(12, 4, 1)[None]
    first = fill(pol.plan_layers(load, init), init)
    validate_phy2log(first[0], 12, 4)
    assert global_peak(first, load, 4) < global_peak(init, load, 4)
    again = fill(pol.plan_layers(load, first), first)
    assert diff(first, again, 4).moved_slots == 0


@pytest.fixture(scope="module")
def real():
    a = read_loads(DATA / "decode_in1000out1000.json")
    b = read_loads(DATA / "decode_in500out1500.json")
    assert a.dense_skipped == 3 and a.loads.shape == (58, 256)
    return a.loads, b.loads


@needs_data
def test_real_ep32_fresh_plan_and_drift(real):
    a, b = real
    d = 32
    init = np.tile(initial_phy2log(256, d, 1), (58, 1))
    pol = make_policy("incremental", d, 256, 1, 0.0)
    fresh = fill(pol.plan_layers(a, init), init)
    for row in fresh:
        validate_phy2log(row, 256, d)
    assert global_peak(fresh, a, d) <= 1.004
    budget = int(0.05 * fresh.size)
    capped = make_policy("incremental", d, 256, 1, 0.0, budget_slots=budget)
    drift = fill(capped.plan_layers(b, fresh), fresh)
    assert diff(fresh, drift, d).moved_slots <= budget
    assert global_peak(drift, b, d) < global_peak(fresh, b, d)
    free = fill(pol.plan_layers(b, fresh), fresh)
    assert global_peak(free, b, d) <= 1.01
