"""The elastic shrink re-plan (``eplb/membership_plan.py`` ``plan_shrink``, issue #23 item 6):
coverage, at most one
new replica per rank, only the orphans' slots change, survivors keep their rows."""

from __future__ import annotations

import numpy as np
import pytest

from xllm_eplb.eplb.membership_plan import ShrinkError, plan_shrink
from xllm_eplb.eplb.placement import initial_phy2log


def _check(old, plan, dead, D, E):
    L = old.shape[0]
    S = old.shape[1] // D
    new = plan.table.reshape(L, D - 1, S)
    rows = old.reshape(L, D, S)[:, [r for r in range(D) if r != dead]]
    for ml in range(L):
        assert set(new[ml].reshape(-1).tolist()) == set(range(E)), ml          # coverage
        orphans = set(range(E)) - set(rows[ml].reshape(-1).tolist())
        changed = np.argwhere(new[ml] != rows[ml])
        assert len(changed) == len(orphans), ml                               # minimal
        for r, s in changed:
            e = int(new[ml, r, s])
            assert e in orphans and (new[ml, r] == e).sum() == 1              # 1 per rank
    assert len(plan.reloads) == sum(1 for _ in plan.reloads)
    for ml, r, s, e in plan.reloads:
        assert new[ml, r, s] == e
    assert plan.kept + len(plan.reloads) == new.size


def test_initial_layout_ep4_to_3_uses_the_duplicates_and_spreads_the_reads():
    E, D, R, L = 8, 4, 1, 3
    old = np.tile(initial_phy2log(E, D, R), (L, 1))     # rank r: 2r, 2r+1, 2r+1
    for dead in range(D):
        plan = plan_shrink(old, dead, D, E)
        _check(old, plan, dead, D, E)
        assert len(plan.reloads) == 2 * L                 # the dead rank's 2 experts per layer
        # a same-rank duplicate is taken first: no survivor loses a real replica
        rows = old.reshape(L, D, 3)[:, plan.survivors]
        assert all((rows[ml, r] == rows[ml, r, s]).sum() == 2 for ml, r, s, _ in plan.reloads)
        per = plan.reloads_per_rank()
        assert max(per) - min(per) <= 1, per              # spread over the survivors
        assert plan.survivors == [r for r in range(D) if r != dead]


def test_surviving_replicas_cover_everything_nothing_moves():
    # every expert on two ranks: any single loss leaves a replica of each
    E, D, S = 4, 4, 2
    row = np.array([0, 1, 2, 3, 0, 1, 2, 3])
    old = np.stack([row, np.roll(row, 2)])
    plan = plan_shrink(old, 1, D, E)
    _check(old, plan, 1, D, E)
    assert plan.reloads == [] and plan.kept == old.shape[0] * (D - 1) * S


def test_coldest_extra_replica_is_the_donor():
    E, D = 6, 3
    # rank 2 holds 4 and 5 alone; ranks 0, 1 hold 0..3 and two extra replicas each
    old = np.array([[0, 1, 2, 3, 0, 1, 4, 5, 3]])      # D=3, S=3: rank 2 = 4, 5, 3
    load = np.array([[10.0, 1.0, 5.0, 5.0, 5.0, 5.0]])
    plan = plan_shrink(old, 2, D, E, load)
    _check(old, plan, 2, D, E)
    new = plan.table.reshape(D - 1, 3)
    # expert 1 (load 1 over 2 replicas) is the coldest donor, then 0 (10/2) loses a replica
    assert (new == 1).sum() == 1 and (new == 0).sum() == 1, new


@pytest.mark.parametrize("seed", range(20))
def test_random_placements_keep_the_invariants(seed):
    rng = np.random.default_rng(seed)
    D, S = int(rng.integers(2, 6)), int(rng.integers(2, 5))
    E = int(rng.integers(max(1, S), (D - 1) * S + 1))
    L = 2
    old = np.empty((L, D * S), dtype=np.int64)
    for ml in range(L):
        while True:   # every expert once, the rest random, no rank holding one twice
            rows = [rng.choice(E, size=S, replace=False) for _ in range(D)]
            if len(set(np.concatenate(rows).tolist())) == E:
                break
        old[ml] = np.concatenate(rows)
    dead = int(rng.integers(D))
    plan = plan_shrink(old, dead, D, E, rng.random((L, E)))
    _check(old, plan, dead, D, E)


def test_rule_refused_with_its_numbers():
    old = np.tile(initial_phy2log(8, 4, 0), (1, 1))     # S=2: 3 x 2 < 8
    with pytest.raises(ShrinkError, match=r"ep_size 4 -> 3.*num_experts=8.*redundant_experts_num"):
        plan_shrink(old, 0, 4, 8)
    with pytest.raises(ShrinkError, match="ep_size 1 -> 0"):
        plan_shrink(np.arange(4).reshape(1, 4), 0, 1, 4)


@pytest.mark.parametrize("kind", ["incremental", "balanced", "greedy", "node_aware"])
def test_the_policy_plans_the_shrunk_layout_the_flags_cannot_express(kind):
    """8 experts on 3 ranks x 3 slots (8 % 3 != 0): the engine's rebuilt manager plans it."""
    import dataclasses

    from xllm_eplb.eplb.membership_plan import planner_for as _planner
    from xllm_eplb.eplb.placement import validate_phy2log
    from xllm_eplb.flags import load_config

    cfg = load_config(["--ep-size", "4", "--num_experts", "8", "--num_experts_per_tok", "2",
                       f"--eplb_policy_kind={kind}"])[0]
    e = dataclasses.replace(cfg.eplb, ep_size=3, redundant_experts_num=1)
    dep = plan_shrink(np.tile(initial_phy2log(8, 4, 1), (2, 1)), 1, 4, 8).table
    load = np.random.default_rng(0).random((2, 8)) * 100
    load[:, 0] *= 20                                  # one hot expert: worth a new replica
    got = _planner(e, 8, 3)(load, None, dep)
    assert got.table.shape == (2, 9) and got.update.all()
    for row in got.table:
        validate_phy2log(row, 8, 3)
        assert (row == 0).sum() >= 2
