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
    pol = make_policy("incremental", 4, 12, 1)
    init = initial_phy2log(12, 4, 1)[None]
    first = fill(pol.plan(load, init), init)
    validate_phy2log(first[0], 12, 4)
    assert global_peak(first, load, 4) < global_peak(init, load, 4)
    again = fill(pol.plan(load, first), first)
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
    pol = make_policy("incremental", d, 256, 1)
    fresh = fill(pol.plan(a, init), init)
    for row in fresh:
        validate_phy2log(row, 256, d)
    assert global_peak(fresh, a, d) <= 1.004
    budget = int(0.05 * fresh.size)
    capped = make_policy("incremental", d, 256, 1, budget_slots=budget)
    drift = fill(capped.plan(b, fresh), fresh)
    assert diff(fresh, drift, d).moved_slots <= budget
    assert global_peak(drift, b, d) < global_peak(fresh, b, d)
    free = fill(pol.plan(b, fresh), fresh)
    assert global_peak(free, b, d) <= 1.01


def test_deployed_layer_within_trigger_is_not_touched():
    rng = np.random.default_rng(1)
    load = np.round(1000 / np.arange(1, 65) ** 1.1)[rng.permutation(64)][None].astype(np.int64)
    pol = make_policy("incremental", 8, 64, 1, noise_z=0)
    init = initial_phy2log(64, 8, 1)[None]
    first = fill(pol.plan(load, init), init)
    pk = global_peak(first, load, 8)
    assert pk <= 1 + pol.target_slack + 1e-9
    # a small drift that keeps the peak under (1 + trigger_slack) x bound: no move at all
    drifted = load.copy()
    drifted[0, int(np.argmin(drifted[0]))] += 1
    assert global_peak(first, drifted, 8) <= 1 + pol.trigger_slack
    assert pol.plan(drifted, first) == [None]


def test_deployed_layer_above_trigger_settles_near_target():
    rng = np.random.default_rng(2)
    base = np.round(1000 / np.arange(1, 65) ** 1.1)
    load = base[rng.permutation(64)][None].astype(np.int64)
    pol = make_policy("incremental", 8, 64, 1, noise_z=0)
    init = initial_phy2log(64, 8, 1)[None]
    first = fill(pol.plan(load, init), init)
    drifted = base[rng.permutation(64)][None].astype(np.int64)
    before = global_peak(first, drifted, 8)
    assert before > 1 + pol.trigger_slack
    out = pol.plan(drifted, first)
    assert out[0] is not None
    validate_phy2log(out[0], 64, 8)
    after = global_peak(out[0][None], drifted, 8)
    assert after < before
    # the deployed layer is fixed down to `settle`, not to the best reachable peak
    assert pol.last_stats["searched_layers"] == 1


def test_slack_options_are_checked():
    from xllm_eplb.errors import ConfigError
    with pytest.raises(ConfigError, match="settle_slack"):
        make_policy("incremental", 4, 12, 1, settle_slack=0.05, trigger_slack=0.01)
    with pytest.raises(ConfigError, match="trigger_slack"):
        make_policy("incremental", 4, 12, 1, trigger_slack=-0.1)


@pytest.mark.parametrize("rewrites", [False, True])
def test_excess_search_keeps_invariants_and_reaches_target(rewrites):
    from xllm_eplb.eplb.policy.excess import excess_search
    from xllm_eplb.eplb.policy.incremental import replay
    rng = np.random.default_rng(3)
    d, s, e = 8, 5, 32
    w = rng.pareto(1.5, (4, e)) * 100 + 1
    start = np.stack([rng.permutation(np.concatenate([np.arange(e), rng.choice(e, d, False)]))
                      for _ in range(4)])
    tables = []
    for row in start:                      # a random strict table: no expert twice on a rank
        for _ in range(1000):
            t = rng.permutation(row).reshape(d, s)
            if all(len(set(r)) == s for r in t):
                break
        tables.append(t)
    table = np.stack(tables)
    base = table.copy()
    counts = np.stack([np.bincount(t.ravel(), minlength=e) for t in table])
    ideal = w.sum(axis=1) / d
    target = ideal * 1.05
    before = rank_loads_from_phy2log(base.reshape(4, -1), w, d).max(axis=1)
    peaks, moves = excess_search(table, w, counts.copy(), target, 500, base=base.copy(),
                                 rewrites=rewrites)
    for i in range(4):
        out = replay(base[i].reshape(-1).copy(), moves[i])
        assert out.tolist() == table[i].reshape(-1).tolist()
        validate_phy2log(out, e, d)
        got = rank_loads_from_phy2log(out, w[i], d).max()
        assert got == pytest.approx(peaks[i])
        assert got <= before[i] + 1e-9
        # moved-slot bookkeeping matches the table
        if moves[i]:
            assert moves[i][-1][4] == int((out != base[i].reshape(-1)).sum())
            assert moves[i][-1][3] == pytest.approx(got)
    assert (peaks <= np.maximum(target, before) + 1e-9).all()


@needs_data
def test_real_ep32_drift_settles_with_few_moves(real):
    a, b = real
    d = 32
    init = np.tile(initial_phy2log(256, d, 1), (58, 1))
    pol = make_policy("incremental", d, 256, 1)
    fresh = fill(pol.plan(a, init), init)
    out = fill(pol.plan(b, fresh), fresh)
    moved = diff(fresh, out, d).moved_slots / fresh.size
    assert 1 / global_peak(out, b, d) >= 0.99
    assert moved <= 0.10
    # unchanged load right after: every layer is within its trigger -> nothing moves
    assert all(c is None for c in pol.plan(b, out))


def test_noise_floor_keeps_small_count_layers_still():
    """Integer counts this small carry ~sqrt(n) sampling noise: a drift inside it is not chased,
    the same drift on counts 10^6 times larger is."""
    rng = np.random.default_rng(4)
    base = np.round(1000 / np.arange(1, 65) ** 1.1)
    load = base[rng.permutation(64)][None].astype(np.int64)
    init = initial_phy2log(64, 8, 1)[None]
    pol = make_policy("incremental", 8, 64, 1)
    first = fill(pol.plan(load, init), init)
    drifted = load.copy()
    hot = int(np.argmax(rank_loads_from_phy2log(first, load, 8)[0]))
    drifted[0, first[0].reshape(8, -1)[hot, 0]] += int(0.06 * load.sum() / 8)
    assert global_peak(first, drifted, 8) > 1 + pol.trigger_slack
    assert pol.plan(drifted, first) == [None]             # noise floor ~ 2.5/sqrt(ideal)
    big = make_policy("incremental", 8, 64, 1)
    assert big.plan(drifted * 10 ** 6, first)[0] is not None


def test_repair_places_a_replica_when_only_its_own_rank_is_free():
    from xllm_eplb.eplb.policy.repair import repair
    # rank 1's free slot is the only one left and rank 1 already holds expert 5
    t = np.array([[[0, 1, 2], [3, 5, -1], [4, 6, 7]]])
    c = np.array([[1, 1, 1, 1, 1, 2, 1, 1]])
    w = np.arange(1.0, 9.0)[None]
    out, ok = repair(w, t, c)
    assert ok.tolist() == [True]
    validate_phy2log(out[0].reshape(-1), 8, 3)
    assert np.bincount(out[0].ravel(), minlength=8).tolist() == c[0].tolist()


@pytest.mark.parametrize("mode", [None, True])
def test_rewrites_give_a_new_hot_expert_replicas(mode):
    """After a drift that makes a single-replica expert hotter than a rank's fair share, swaps
    cannot help; single-slot rewrites re-point spare replicas to it (few moved slots)."""
    rng = np.random.default_rng(5)
    e, d = 64, 8
    load = np.round(rng.uniform(50, 150, e) * 10 ** 4)[None].astype(np.int64)
    init = initial_phy2log(e, d, 1)[None]
    pol = make_policy("incremental", d, e, 1, rewrite_moves=mode)
    first = fill(pol.plan(load, init), init)
    counts = np.bincount(first[0], minlength=e)
    hot = int(np.nonzero(counts == 1)[0][0])
    drifted = load.copy()
    drifted[0, hot] = int(2.0 * load.sum() / d)             # alone > 1.5x the new fair share
    before = global_peak(first, drifted, d)
    out = pol.plan(drifted, first)
    assert out[0] is not None
    validate_phy2log(out[0], e, d)
    assert np.bincount(out[0], minlength=e)[hot] >= 2
    assert global_peak(out[0][None], drifted, d) < before
    assert diff(first, out[0][None], d).moved_slots < first.size // 2
