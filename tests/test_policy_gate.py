"""The cases of xLLM's eplb_policy_test: factory, gate, rollback, slot stability."""

import logging

import numpy as np
import pytest

from xllm_eplb.eplb.placement import initial_phy2log, validate_phy2log
from xllm_eplb.eplb.policy import POLICY_KINDS, make_policy
from xllm_eplb.eplb.policy.balanced import plan_balanced, plan_layer_exact

E, D, R = 16, 4, 1          # S = 5, as in xLLM's tests


def skewed(layers=1):
    row = np.array([4000, 2000, 1500, 1000] + [50] * 12, dtype=np.int64)
    return np.tile(row, (layers, 1))


def seeded(kind="balanced", minimum=0.05, layers=1, **opts):
    pol = make_policy(kind, D, E, R, minimum, **opts)
    pol.initialize(np.tile(initial_phy2log(E, D, R), (layers, 1)))
    return pol


def physical_under(table, logical, ep_size):
    """Physical [L, D, S] measured under ``table`` when replicas split evenly."""
    t = np.atleast_2d(table)
    lg = np.atleast_2d(logical).astype(float)
    out = []
    for row, load in zip(t, lg, strict=True):
        cnt = np.bincount(row, minlength=load.size)
        out.append((load[row] / cnt[row]).reshape(ep_size, -1))
    return np.stack(out)


@pytest.mark.parametrize("kind", POLICY_KINDS)
def test_build_gives_valid_placement(kind):
    pol = make_policy(kind, D, E, R, 0.0)
    cand, upd = pol.rebalance(skewed(2))
    assert upd.all()                                   # never seeded: published without gate
    for row in cand:
        validate_phy2log(row, E, D)


def test_factory_names_and_legacy_aliases(caplog):
    assert make_policy("BALANCED", D, E, R).name == "balanced"
    assert make_policy("Greedy", D, E, R).name == "greedy"
    assert make_policy("incremental", D, E, R).name == "incremental"
    assert make_policy("node_aware", D, E, R, num_nodes=2).name == "node_aware"
    for legacy in ("flat", "deepseek_flat", "deepseek-flat", "deepseek_hier", "deepseek-hier",
                   "hier", "hierarchical"):
        assert make_policy(legacy, D, E, R).name == "balanced"
    with caplog.at_level(logging.WARNING):
        assert make_policy("no-such-policy-xyz", D, E, R).name == "greedy"
        assert make_policy("no-such-policy-xyz", D, E, R).name == "greedy"
    warned = [r for r in caplog.records if "no-such-policy-xyz" in r.getMessage()]
    assert len(warned) == 1


def test_balanced_spreads_hot_expert_replicas_across_ranks():
    load = np.full((1, E), 10, dtype=np.int64)
    load[0, 5] = 10000
    cand, _ = make_policy("balanced", D, E, R, 0.0).rebalance(load)
    validate_phy2log(cand[0], E, D)
    assert np.bincount(cand[0], minlength=E)[5] == D    # one replica on every rank


def test_balanced_uniform_dead_end_uses_safe_fallback():
    out = plan_balanced(np.full((1, 3), 7, dtype=np.int64), np.full((1, 6), -1), 3, 2)[0]
    validate_phy2log(out, 3, 3)
    assert np.bincount(out, minlength=3).tolist() == [2, 2, 2]


def test_balanced_large_loads_do_not_overflow():
    m = np.iinfo(np.int64).max // 2
    load = np.array([[m, m // 2, 1]], dtype=np.int64)
    out = plan_balanced(load, np.full((1, 6), -1), 3, 2)[0]
    validate_phy2log(out, 3, 3)
    assert np.bincount(out, minlength=3).tolist() == [3, 2, 1]


def test_fast_path_matches_exact_port():
    rng = np.random.default_rng(3)
    for _ in range(20):
        load = rng.integers(0, 50, size=(1, 12))
        prev = np.tile(initial_phy2log(12, 4, 1), (1, 1))
        fast = plan_balanced(load, prev, 4, 4)[0]
        exact = plan_layer_exact(load[0], prev[0], 4, 4)
        assert fast.tolist() == exact.tolist()


def test_zero_load_publishes_once_for_initial_placement():
    pol = make_policy("balanced", D, E, R, 0.05)
    z = np.zeros((2, E), dtype=np.int64)
    _, upd = pol.rebalance(z)
    assert upd.all()
    _, upd = pol.rebalance(z)
    assert not upd.any()


@pytest.mark.parametrize("kind", ["balanced", "greedy"])
def test_abort_retries_uncommitted_placement(kind):
    pol = seeded(kind, 0.0)
    c1, u1 = pol.rebalance(skewed())
    assert u1[0]
    pol.abort_layer(0)
    c2, u2 = pol.rebalance(skewed())
    assert u2[0] and c2[0].tolist() == c1[0].tolist()
    pol.commit_layer(0)
    pol.abort_layer(0)                                  # no record left: nothing to undo
    _, u3 = pol.rebalance(skewed())
    assert not u3[0]


def test_abort_restores_previous_row():
    pol = seeded("balanced", 0.0)
    init = initial_phy2log(E, D, R)
    pol.rebalance(skewed())
    pol.abort_layer(0)
    assert pol.prev_table()[0].tolist() == init.tolist()


def test_skips_uniform_workload_repack_with_no_gain():
    pol = seeded("balanced", 0.0)
    cand, upd = pol.rebalance(np.full((1, E), 100, dtype=np.int64))
    assert not upd[0] and cand[0].tolist() == initial_phy2log(E, D, R).tolist()


def test_seeded_initial_distribution_skips_no_gain_first_round():
    pol = seeded("balanced", 0.05)
    load = np.full((1, E), 100, dtype=np.int64)
    phys = physical_under(initial_phy2log(E, D, R), load, D)
    _, upd = pol.rebalance(load, phys)
    assert not upd[0]


def test_balanced_preserves_slots_when_rank_membership_unchanged():
    pol = seeded("balanced", 0.0)
    cand, upd = pol.rebalance(skewed())
    assert upd[0]
    pol.commit_layer(0)
    again, upd2 = pol.rebalance(skewed())
    assert not upd2[0] and again[0].tolist() == cand[0].tolist()
    # a permutation inside each rank is kept as is
    perm = cand[0].reshape(D, -1)[:, ::-1].reshape(-1)
    out = plan_balanced(skewed(), perm[None], D, E // D + R)[0]
    assert out.tolist() == perm.tolist()


def test_balanced_fills_only_slots_vacated_by_rank_migrations():
    pol = make_policy("balanced", 2, 4, 1, 0.05)
    pol.initialize(np.array([[0, 1, 3, 1, 2, 0]]))
    phys = np.array([[[100, 100, 100], [1, 1, 1]]])     # measured peak 300, total 303
    cand, upd = pol.rebalance(np.array([[100, 90, 80, 1]]), phys)
    assert upd[0] and cand[0].tolist() == [0, 1, 2, 1, 3, 0]
    g = pol.last_gate[0]
    assert g["current_peak"] == 300
    assert g["proposed_peak"] == pytest.approx(175 * 303 / 271)
    assert g["improvement_ratio"] == pytest.approx((300 - 175 * 303 / 271) / 300)
    assert g["placement_changed"] is True


def test_publishes_with_sufficient_gain_and_logs_benefit(caplog):
    pol = seeded("balanced", 0.05)
    with caplog.at_level(logging.INFO):
        _, upd = pol.rebalance(skewed())
    assert upd[0]
    lines = [r.getMessage() for r in caplog.records if "EPLB placement benefit" in
             r.getMessage()]
    assert lines and all(k in lines[0] for k in (
        "policy=balanced", "layer=0", "current_peak=", "proposed_peak=", "improvement_ratio=",
        "min_improvement_ratio=0.05", "placement_changed=true"))


def test_gate_uses_measured_physical_peak():
    pol = seeded("balanced", 0.05)
    phys = np.full((1, D, E // D + R), 10.0)              # measured: perfectly balanced
    _, upd = pol.rebalance(skewed(), phys)
    assert not upd[0]


def test_recomputes_when_only_measured_physical_peak_changes():
    pol = seeded("balanced", 0.05)
    flat = np.full((1, D, E // D + R), 10.0)
    _, upd = pol.rebalance(skewed(), flat)
    assert not upd[0]
    hot = flat.copy()
    hot[0, 0] = 100.0
    _, upd = pol.rebalance(skewed(), hot)
    assert upd[0]


def test_gate_is_invariant_to_logical_load_scale():
    phys = physical_under(initial_phy2log(E, D, R), skewed(), D)
    ratios = []
    for scale in (1, 1000):
        pol = seeded("balanced", 0.05)
        _, upd = pol.rebalance(skewed() * scale, phys)
        assert upd[0]
        ratios.append(pol.last_gate[0]["improvement_ratio"])
    assert ratios[0] == pytest.approx(ratios[1])


@pytest.mark.parametrize("minimum,moves", [(0.0, True), (1.0, False)])
def test_greedy_requires_minimum_improvement(minimum, moves):
    pol = seeded("greedy", minimum)
    _, upd = pol.rebalance(skewed())
    assert bool(upd[0]) is moves


def test_every_layer_replanned_and_shapes_checked():
    pol = seeded("incremental", 0.0, layers=3)
    cand, upd = pol.rebalance(skewed(3))
    assert cand.shape == (3, D * (E // D + R)) and upd.all()
    with pytest.raises(ValueError, match="layers"):
        pol.rebalance(skewed(2))
    with pytest.raises(ValueError, match="physical"):
        pol.rebalance(skewed(3), np.zeros((3, D, 2)))
