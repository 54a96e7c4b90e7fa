"""Placement invariants, derived views, diff and the balance metrics."""

import numpy as np
import pytest

from xllm_eplb.eplb.balance import balancedness, peak_over_ideal, rank_loads_from_phy2log
from xllm_eplb.eplb.placement import (
    PlacementError,
    build_log2phy,
    complete_rows,
    diff,
    initial_phy2log,
    log2phy,
    logical_loads,
    replica_counts,
    slots_per_rank,
    validate_phy2log,
)


def test_initial_layout_matches_xllm_example():
    assert initial_phy2log(8, 2, 1).tolist() == [0, 1, 2, 3, 3, 4, 5, 6, 7, 7]
    assert slots_per_rank(256, 8, 2) == 34


def test_initial_layout_needs_duplicate_allowance():
    p = initial_phy2log(8, 2, 1)
    validate_phy2log(p, 8, 2, allow_rank_duplicates=True)
    with pytest.raises(PlacementError, match="rank 0 holds expert 3 2 times"):
        validate_phy2log(p, 8, 2)


@pytest.mark.parametrize("table,msg", [
    ([0, 1, 2, 3, 8, 4, 5, 6, 7, 0], "outside"),
    ([0, 1, 2, 3, 0, 0, 1, 2, 3, 1], "expert 4 has no replica"),
    ([0, 1, 2, 3, 4, 5, 6, 7, 1, 1], "rank 1 holds expert 1"),
    ([0, 1, 2], "not \\[ep_size\\*slots\\]"),
])
def test_validate_names_the_rule(table, msg):
    with pytest.raises(PlacementError, match=msg):
        validate_phy2log(np.array(table), 8, 2)


def test_slots_per_rank_rules():
    with pytest.raises(PlacementError,
                       match="--num_experts=10: must be divisible by --ep_size=4"):
        slots_per_rank(10, 4, 1)
    with pytest.raises(PlacementError, match="must be >= 1"):
        slots_per_rank(8, 0, 0)
    with pytest.raises(PlacementError, match="--redundant_experts_num=1: must be <= 0"):
        slots_per_rank(8, 1, 1)
    assert slots_per_rank(8, 1, 0) == 8          # one rank: every expert, once


def test_log2phy_logcnt_and_routing():
    p = np.array([0, 1, 2, 3, 0, 4, 5, 6, 7, 1])
    assert replica_counts(p, 8).tolist() == [2, 2, 1, 1, 1, 1, 1, 1]
    t = log2phy(p, 8)
    assert t[0].tolist() == [0, 4] and t[2].tolist() == [2, -1]
    # source rank r uses replica r % count
    assert build_log2phy(p, 8, 0)[0] == 0 and build_log2phy(p, 8, 1)[0] == 4
    assert build_log2phy(p, 8, 1)[1] == 9


def test_initial_layout_views():
    pl = initial_phy2log(8, 2, 1)
    assert slots_per_rank(8, 2, 1) == 5
    assert replica_counts(pl, 8).tolist() == [1, 1, 1, 2, 1, 1, 1, 2]
    validate_phy2log(pl, 8, 2, allow_rank_duplicates=True)
    other = np.array([0, 1, 2, 3, 4, 5, 6, 7, 3, 0])
    d = diff(pl, other, 2)
    assert (d.moved_slots, d.weight_copies) == (6, 3)   # 3 reorders on rank 1 are free


def test_complete_rows_and_logical_loads():
    t = np.array([[0, 1, 2, 3], [0, 1, 2, 2], [0, 1, 2, 4], [0, 1, -1, 3]])
    assert complete_rows(t, 4).tolist() == [True, False, False, False]
    assert complete_rows(t[0], 4).tolist() == [True]
    slots = np.array([[5, 1, 2, 7], [3, 4, 5, 6], [0, 0, 0, 0], [0, 0, 0, 0]])
    table = np.array([[0, 1, 2, 0], [3, 3, 2, 1], [0, 1, 2, 3], [0, 1, 2, 3]])
    assert logical_loads(slots, table, 4)[:2].tolist() == [[12, 1, 2, 0], [0, 6, 5, 7]]
    assert logical_loads(slots.reshape(4, 2, 2), table, 4).tolist() == \
        logical_loads(slots, table, 4).tolist()            # [L, D, S] deltas alike


def test_diff_counts_reorders_as_free():
    old = np.array([[0, 1, 2, 3, 4, 5]])
    new = np.array([[2, 1, 0, 3, 4, 5]])          # reorder inside rank 0
    d = diff(old, new, 2)
    assert d.moved_slots == 2 and d.weight_copies == 0
    new2 = np.array([[3, 1, 2, 0, 4, 5]])         # 0 and 3 cross ranks
    assert diff(old, new2, 2).weight_copies == 2
    with pytest.raises(PlacementError):
        diff(old, new[:, :4], 2)


def test_rank_loads_even_split_and_metrics():
    p = np.array([0, 1, 2, 0])                    # D=2, S=2; expert 0 on both ranks
    r = rank_loads_from_phy2log(p, np.array([10.0, 4.0, 6.0]), 2)
    assert r.tolist() == [9.0, 11.0]
    assert balancedness(r) == pytest.approx(10 / 11)
    assert peak_over_ideal(r) == pytest.approx(1.1)
    assert balancedness(np.zeros((3, 4))).tolist() == [1.0, 1.0, 1.0]
    two = rank_loads_from_phy2log(np.stack([p, p]), np.array([[10, 4, 6], [0, 0, 2]]), 2)
    assert two.shape == (2, 2) and two[1].tolist() == [0.0, 2.0]
