"""The elastic rejoin re-plan (``eplb/membership_plan.py`` ``plan_join``, issue #23 item 8): the
serving ranks keep
their rows, the joiner's row is appended, every layer covers every expert, the joiner holds no
expert twice, what it loaded is kept and the rest are the hottest experts."""

from __future__ import annotations

import numpy as np
import pytest

from xllm_eplb.eplb.membership_plan import JoinError, plan_join, plan_shrink
from xllm_eplb.eplb.placement import initial_phy2log


def _check(old, plan, D, E):
    L, S = old.shape[0], old.shape[1] // D
    assert plan.table.shape == (L, (D + 1) * S)
    assert (plan.table[:, :D * S] == old).all()                      # serving rows unchanged
    assert (plan.table[:, D * S:] == plan.row).all()
    for ml in range(L):
        assert set(plan.table[ml].tolist()) == set(range(E)), ml       # coverage
        assert len(set(plan.row[ml].tolist())) == S, ml                # one replica per rank
    for ml, s, e in plan.reloads:
        assert plan.row[ml, s] == e
    assert plan.kept + len(plan.reloads) == plan.row.size


def test_shrink_then_join_keeps_the_joiners_own_distinct_experts():
    E, D, R, L = 8, 4, 1, 3
    init = np.tile(initial_phy2log(E, D, R), (L, 1))       # rank r: 2r, 2r+1, 2r+1
    S = init.shape[1] // D
    for dead in range(D):
        shrunk = plan_shrink(init, dead, D, E).table
        prefer = init.reshape(L, D, S)[:, dead]
        plan = plan_join(shrunk, D - 1, E, prefer=prefer)
        _check(shrunk, plan, D - 1, E)
        # the two distinct experts it loaded stay; only the duplicate slot is re-read
        assert len(plan.reloads) == L
        for ml in range(L):
            assert plan.row[ml, 0] == prefer[ml, 0] and plan.row[ml, 1] == prefer[ml, 1]
            assert plan.row[ml, 2] not in prefer[ml]


def test_without_prefer_the_hottest_per_replica_experts_fill_the_row():
    table = np.array([[0, 1, 2, 3, 0, 1]])                 # 2 ranks x 3 slots, E=4
    load = np.array([[10.0, 1.0, 30.0, 4.0]])              # per replica: 5, .5, 30, 4
    plan = plan_join(table, 2, 4, load)
    _check(table, plan, 2, 4)
    assert plan.row[0].tolist() == [2, 0, 3]
    assert len(plan.reloads) == 3 and plan.kept == 0


def test_ties_prefer_fewer_replicas_then_the_lower_id():
    table = np.array([[0, 1, 2, 3, 0, 1]])
    plan = plan_join(table, 2, 4)                          # no load: fewest replicas first
    assert plan.row[0].tolist() == [2, 3, 0]


def test_refusals_name_the_numbers():
    with pytest.raises(JoinError, match="slots_per_rank=5 > num_experts=4"):
        plan_join(np.zeros((1, 10), dtype=np.int64), 2, 4)
    with pytest.raises(JoinError, match="expert 3 has no replica"):
        plan_join(np.array([[0, 1, 2, 0]]), 2, 4)
    with pytest.raises(JoinError, match="prefer of shape"):
        plan_join(np.array([[0, 1, 2, 3]]), 2, 4, prefer=np.zeros((1, 3)))
