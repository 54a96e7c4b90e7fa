"""Per-step replica routing (eplb/replica_routing.py): conservation, static = build_log2phy,
balanced never worse than static/spread and near the LP optimum, determinism across ranks."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xllm_eplb.eplb import replica_routing as rr
from xllm_eplb.eplb.placement import PlacementError, build_log2phy, initial_phy2log
from xllm_eplb.eplb.replica_balance import project_np
from xllm_eplb.testing.lp import lp_peak

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def cases(draw):
    """(phy2log [D*S], E, D, counts [D, E]): every expert placed, at most one replica per rank
    (or xLLM's initial layout with same-rank duplicates), small integer counts."""
    d = draw(st.integers(2, 6))
    k = draw(st.integers(1, 4))
    r = draw(st.integers(0, min(3, (d - 1) * k)))
    e = d * k
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 31 - 1)))
    if draw(st.booleans()) or r == 0:
        base = rng.permutation(e).reshape(d, k)
        rows = []
        for i in range(d):
            free = np.setdiff1d(np.arange(e), base[i])
            rows.append(np.concatenate([base[i], rng.choice(free, size=r, replace=False)]))
        phy = np.concatenate(rows).astype(np.int64)
    else:
        phy = initial_phy2log(e, d, r)
    hi = draw(st.sampled_from([1, 4, 30, 400]))
    counts = rng.integers(0, hi + 1, (d, e)).astype(np.int64)
    if draw(st.booleans()):            # a hot expert, as in real decode loads
        counts[:, rng.integers(e)] += rng.integers(0, 5 * hi + 1, d)
    if draw(st.booleans()):
        counts[rng.integers(d)] = 0     # an empty source rank
    return phy, e, d, counts


def per_expert(route, phy, e):
    """[D, D*S] tokens per source and slot -> [D, E] per source and the slot's expert."""
    out = np.zeros((route.shape[0], e), dtype=np.int64)
    np.add.at(out, (slice(None), phy), route)
    return out


@SETTINGS
@given(cases(), st.sampled_from(rr.MODES))
def test_tokens_conserved_and_only_to_replicas(case, mode):
    phy, e, d, counts = case
    plan = rr.prepare(phy, e, d)
    route = rr.route(counts, plan, mode)
    assert route.shape == (d, phy.size) and route.dtype == np.int64
    assert (route >= 0).all()
    # grouping each slot under its own expert: per (source, expert) exactly its counts, so no
    # token lands on another expert's slot and none is lost or created
    assert (per_expert(route, phy, e) == counts).all()
    assert (rr.slot_loads(counts, plan, mode) == route.sum(axis=0)).all()


@SETTINGS
@given(cases())
def test_static_is_build_log2phy(case):
    phy, e, d, counts = case
    route = rr.route(counts, rr.prepare(phy, e, d), "static")
    for r in range(d):
        want = np.zeros(phy.size, dtype=np.int64)
        np.add.at(want, build_log2phy(phy, e, r), counts[r])
        assert (route[r] == want).all()


@SETTINGS
@given(cases())
def test_spread_splits_each_source_evenly(case):
    phy, e, d, counts = case
    route = rr.route(counts, rr.prepare(phy, e, d), "spread")
    for x in range(e):
        slots = np.nonzero(phy == x)[0]
        part = route[:, slots]
        assert (part.max(axis=1) - part.min(axis=1) <= 1).all()


@SETTINGS
@given(cases())
def test_balanced_never_worse_and_near_lp(case):
    phy, e, d, counts = case
    plan = rr.prepare(phy, e, d)
    peak = {m: int(rr.rank_loads(rr.slot_loads(counts, plan, m), d).max()) for m in rr.MODES}
    assert peak["balanced"] <= peak["spread"]
    assert peak["balanced"] <= peak["static"]
    opt = int(np.ceil(lp_peak(phy, counts.sum(axis=0), d) - 1e-6))   # integer optimum
    assert peak["balanced"] >= opt
    assert peak["balanced"] <= opt + max(1, int(np.ceil(0.02 * opt)))


@SETTINGS
@given(cases(), st.sampled_from(rr.MODES))
def test_every_rank_computes_the_same_assignment(case, mode):
    """The cross-rank rule: each rank's own row equals the global table's, from any copy of the
    counts (dtype, memory order) and of the placement (list or array)."""
    phy, e, d, counts = case
    plan = rr.prepare(phy, e, d)
    full = rr.route(counts, plan, mode)
    assert (rr.route(counts.copy(), rr.prepare(phy.tolist(), e, d), mode) == full).all()
    assert (rr.route(np.asfortranarray(counts.astype(np.int32)), plan, mode) == full).all()
    for r in range(d):
        assert (rr.source_row(counts, plan, mode, r) == full[r]).all()


@SETTINGS
@given(cases(), st.sampled_from(rr.MODES), st.integers(0, 2 ** 31 - 1))
def test_assign_tokens_follows_the_row(case, mode, seed):
    phy, e, d, counts = case
    plan = rr.prepare(phy, e, d)
    rng = np.random.default_rng(seed)
    src = int(rng.integers(d))
    c = counts.copy()
    topk = rng.permutation(np.repeat(np.arange(e), c[src]))
    pad = (-topk.size) % 2
    if pad:                                  # make it [N, 2]: one more token of expert 0
        topk = np.append(topk, 0)
        c[src, 0] += 1
    topk = topk.reshape(-1, 2)
    row = rr.source_row(c, plan, mode, src)
    slots = rr.assign_tokens(topk, row, plan)
    assert (phy[slots] == topk).all()
    assert (np.bincount(slots.ravel(), minlength=phy.size) == row).all()


def test_balanced_moves_load_off_the_hot_rank():
    """Hand case: rank 0 holds a hot single-replica expert; the shared expert's tokens must all go
    to its replica on rank 1 (static and spread keep half of them on rank 0)."""
    phy = np.array([0, 1, 2, 1], dtype=np.int64)          # D=2, S=2: expert 1 on both ranks
    counts = np.array([[20, 6, 1], [0, 6, 1]], dtype=np.int64)
    plan = rr.prepare(phy, 3, 2)
    loads = {m: rr.rank_loads(rr.slot_loads(counts, plan, m), 2).tolist() for m in rr.MODES}
    assert loads["static"] == [26, 8] and loads["spread"] == [26, 8]
    assert loads["balanced"] == [20, 14]


def test_bad_input_names_the_rule():
    plan = rr.prepare(initial_phy2log(4, 2, 1), 4, 2)
    with pytest.raises(ValueError, match="counts of shape"):
        rr.route(np.zeros((3, 4), np.int64), plan, "static")
    with pytest.raises(ValueError, match="must be >= 0"):
        rr.route(-np.ones((2, 4), np.int64), plan, "spread")
    with pytest.raises(ValueError, match="is not one of"):
        rr.route(np.zeros((2, 4), np.int64), plan, "lp")
    with pytest.raises(PlacementError, match="has no replica"):
        rr.prepare(np.array([0, 0, 1, 1]), 3, 2)


@SETTINGS
@given(cases())
def test_balanced_reaches_the_integer_optimum(case):
    """The augmenting-path solve stops only at the optimum: ceil of the LP's fractional optimum
    (integral flows), unless its path cap is hit, which these sizes never reach."""
    phy, e, d, counts = case
    plan = rr.prepare(phy, e, d)
    peak = int(rr.rank_loads(rr.slot_loads(counts, plan, "balanced"), d).max())
    assert peak == int(np.ceil(lp_peak(phy, counts.sum(axis=0), d) - 1e-6))


@SETTINGS
@given(cases(), st.integers(0, 2 ** 31 - 1), st.sampled_from([0, 10 ** 6]))
def test_balanced_rank_equals_the_global_table(case, seed, rows_py):
    """What a rank computes alone (``balanced_rank``: its slots and split sizes, by the row loop
    or by numpy) equals its row of ``route``, assigned by ``assign_tokens``, and the send / recv
    sums of the full [D, D*S] table."""
    phy, e, d, counts = case
    plan = rr.prepare(phy, e, d)
    full = rr.route(counts, plan, "balanced")
    s = phy.size // d
    rng = np.random.default_rng(seed)
    for r in range(d):
        ids = rng.permutation(np.repeat(np.arange(e), counts[r]))
        slots, send, recv = rr.balanced_rank(counts, plan, r, ids, rows_py=rows_py)
        assert (slots == rr.assign_tokens(ids.reshape(-1, 1), full[r], plan).ravel()).all()
        assert send == full[r].reshape(d, s).sum(axis=1).tolist()
        assert recv == full[:, r * s:(r + 1) * s].sum(axis=1).tolist()


def test_balanced_rank_refuses_rows_that_do_not_match_the_counts():
    plan = rr.prepare(initial_phy2log(4, 2, 1), 4, 2)
    counts = np.array([[1, 0, 2, 0], [0, 1, 0, 1]], dtype=np.int64)
    with pytest.raises(ValueError, match="rows of expert 2 do not match counts"):
        rr.balanced_rank(counts, plan, 0, np.array([0, 2]))
    with pytest.raises(ValueError, match=r"expert id 7 \(>= 4 experts\)"):
        rr.balanced_rank(counts, plan, 0, np.array([0, 2, 7]))
    with pytest.raises(ValueError, match="expert id 7"):
        rr.balanced_rank(counts, plan, 0, np.array([0, 2, 7]), rows_py=0)


@SETTINGS
@given(cases(), st.integers(0, 2 ** 31 - 1))
def test_balanced_rows_keeps_dropped_rows_and_matches_numpy(case, seed):
    """The list path (decode) and the numpy path give the same slots; a -1 (dropped) row stays
    -1 and counts nowhere."""
    phy, e, d, counts = case
    plan = rr.prepare(phy, e, d)
    rng = np.random.default_rng(seed)
    r = int(rng.integers(d))
    ids = rng.permutation(np.repeat(np.arange(e), counts[r]))
    want, send, recv = rr.balanced_rank(counts, plan, r, ids, rows_py=0)
    rows = ids.tolist()
    holes = sorted(rng.choice(len(rows) + 1, size=3).tolist())
    for h in reversed(holes):
        rows.insert(h, -1)
    slots, send2, recv2 = rr.balanced_rows(counts.tolist(), plan, r, rows)
    assert [s for s in slots if s >= 0] == want.tolist()
    assert [i for i, s in enumerate(slots) if s < 0] == [h + n for n, h in enumerate(holes)]
    assert (send2, recv2) == (send, recv)


@SETTINGS
@given(cases())
def test_projected_counts_carry_what_the_solve_needs(case):
    """``project`` (lists) and ``project_np`` agree, keep every token, and ``balanced_share`` on
    them is ``balanced_rows`` on the full counts, for every rank."""
    phy, e, d, counts = case
    plan = rr.prepare(phy, e, d)
    pc = rr.project(counts.tolist(), plan)
    assert project_np(counts, plan) == pc
    assert [sum(r) for r in pc] == counts.sum(axis=1).tolist()
    for r in range(d):
        rows = np.repeat(np.arange(e), counts[r]).tolist()
        assert rr.balanced_share(pc, plan, r, rows) == rr.balanced_rows(counts.tolist(), plan, r,
                                                                         rows)


@SETTINGS
@given(cases(), st.integers(0, 2 ** 31 - 1))
def test_a_capped_solve_is_the_same_on_both_paths_and_never_worse(case, seed):
    """With the path cap at its smallest (``rounds=0``: D + n passes; the hot-expert cases need
    more), the list path and the numpy path still agree, and the split is never worse than
    static's or spread's (the cap's rule)."""
    phy, e, d, counts = case
    plan = rr.prepare(phy, e, d)
    rng = np.random.default_rng(seed)
    r = int(rng.integers(d))
    ids = rng.permutation(np.repeat(np.arange(e), counts[r]))
    got = rr.balanced_rank(counts, plan, r, ids, rounds=0, rows_py=0)
    lists = rr.balanced_rows(counts.tolist(), plan, r, ids.tolist(), rounds=0)
    assert lists[0] == got[0].tolist() and lists[1:] == got[1:]
    peak = int(rr.rank_loads(rr.slot_loads(counts, plan, "balanced", rounds=0), d).max())
    for m in ("static", "spread"):
        assert peak <= int(rr.rank_loads(rr.slot_loads(counts, plan, m), d).max())
