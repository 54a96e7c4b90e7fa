"""The cases of xLLM's eplb_policy_test: factory, gate, re-planning after an abort or a commit, slot
stability. The caller owns the deployed table; :func:`propose` is the round (plan + gate)."""

import logging

import numpy as np
import pytest

from xllm_eplb.eplb.gate import propose
from xllm_eplb.eplb.placement import initial_phy2log, validate_phy2log
from xllm_eplb.eplb.policy import POLICY_KINDS, make_policy
from xllm_eplb.eplb.policy.balanced import plan_balanced, plan_layer_exact
from xllm_eplb.errors import ConfigError

E, D, R = 16, 4, 1          # S = 5, as in xLLM's tests


def skewed(layers=1):
    row = np.array([4000, 2000, 1500, 1000] + [50] * 12, dtype=np.int64)
    return np.tile(row, (layers, 1))


def initial(layers=1):
    return np.tile(initial_phy2log(E, D, R), (layers, 1))


def seeded(kind="balanced", minimum=0.05, layers=1, **opts):
    """(round function of ``kind`` with gate ``minimum``, the initial deployed table)."""
    pol = make_policy(kind, D, E, R, **opts)

    def rnd(logical, deployed, physical=None):
        return propose(pol, logical, deployed, physical=physical, min_improvement=minimum)
    return rnd, initial(layers)


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
    pol = make_policy(kind, D, E, R)
    r = propose(pol, skewed(2), None, min_improvement=0.0)
    cand, upd = r.table, r.update
    assert upd.all() and not r.gate                    # nothing deployed: published ungated
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
    cand = propose(make_policy("balanced", D, E, R), load, None, min_improvement=0.0).table
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
    pol = make_policy("balanced", D, E, R)
    z = np.zeros((2, E), dtype=np.int64)
    first = propose(pol, z, None, min_improvement=0.05)
    assert first.update.all()
    assert not propose(pol, z, first.table, min_improvement=0.05).update.any()


@pytest.mark.parametrize("kind", ["balanced", "greedy"])
def test_abort_retries_uncommitted_placement(kind):
    """An aborted layer stays deployed as it was: the next round publishes the same candidate;
    once committed (deployed), nothing more. The manager-level twin: test_manager_rollback."""
    rnd, init = seeded(kind, 0.0)
    r1 = rnd(skewed(), init)
    assert r1.update[0]
    r2 = rnd(skewed(), init)                            # aborted: still the initial table
    assert r2.update[0] and r2.table[0].tolist() == r1.table[0].tolist()
    assert not rnd(skewed(), r1.table).update[0]       # committed


def test_round_leaves_its_inputs_unchanged():
    rnd, init = seeded("balanced", 0.0)
    load, before = skewed(), init.copy()
    rnd(load, init)
    assert init.tolist() == before.tolist() and load.tolist() == skewed().tolist()


def test_skips_uniform_workload_repack_with_no_gain():
    rnd, init = seeded("balanced", 0.0)
    r = rnd(np.full((1, E), 100, dtype=np.int64), init)
    assert not r.update[0] and r.table[0].tolist() == initial_phy2log(E, D, R).tolist()


def test_seeded_initial_distribution_skips_no_gain_first_round():
    rnd, init = seeded("balanced", 0.05)
    load = np.full((1, E), 100, dtype=np.int64)
    phys = physical_under(initial_phy2log(E, D, R), load, D)
    assert not rnd(load, init, phys).update[0]


def test_balanced_preserves_slots_when_rank_membership_unchanged():
    rnd, init = seeded("balanced", 0.0)
    r = rnd(skewed(), init)
    cand, upd = r.table, r.update
    assert upd[0]
    r2 = rnd(skewed(), cand)                            # committed
    again, upd2 = r2.table, r2.update
    assert not upd2[0] and again[0].tolist() == cand[0].tolist()
    # a permutation inside each rank is kept as is
    perm = cand[0].reshape(D, -1)[:, ::-1].reshape(-1)
    out = plan_balanced(skewed(), perm[None], D, E // D + R)[0]
    assert out.tolist() == perm.tolist()


def test_balanced_fills_only_slots_vacated_by_rank_migrations():
    pol = make_policy("balanced", 2, 4, 1)
    phys = np.array([[[100, 100, 100], [1, 1, 1]]])     # measured peak 300, total 303
    r = propose(pol, np.array([[100, 90, 80, 1]]), np.array([[0, 1, 3, 1, 2, 0]]), physical=phys,
                min_improvement=0.05)
    cand, upd = r.table, r.update
    assert upd[0] and cand[0].tolist() == [0, 1, 2, 1, 3, 0]
    g = r.gate[0]
    assert g.current_peak == 300
    assert g.proposed_peak == pytest.approx(175 * 303 / 271)
    assert g.improvement_ratio == pytest.approx((300 - 175 * 303 / 271) / 300)
    assert g.placement_changed is True


def test_publishes_with_sufficient_gain_and_logs_benefit(caplog):
    rnd, init = seeded("balanced", 0.05)
    with caplog.at_level(logging.INFO):
        upd = rnd(skewed(), init).update
    assert upd[0]
    lines = [r.getMessage() for r in caplog.records if "EPLB placement benefit" in
             r.getMessage()]
    assert lines and all(k in lines[0] for k in (
        "policy=balanced", "layer=0", "current_peak=", "proposed_peak=", "improvement_ratio=",
        "min_improvement_ratio=0.05", "placement_changed=true"))


def test_gate_uses_measured_physical_peak():
    rnd, init = seeded("balanced", 0.05)
    phys = np.full((1, D, E // D + R), 10.0)              # measured: perfectly balanced
    assert not rnd(skewed(), init, phys).update[0]


def test_recomputes_when_only_measured_physical_peak_changes():
    rnd, init = seeded("balanced", 0.05)
    flat = np.full((1, D, E // D + R), 10.0)
    assert not rnd(skewed(), init, flat).update[0]
    hot = flat.copy()
    hot[0, 0] = 100.0
    assert rnd(skewed(), init, hot).update[0]


def test_gate_is_invariant_to_logical_load_scale():
    phys = physical_under(initial_phy2log(E, D, R), skewed(), D)
    ratios = []
    for scale in (1, 1000):
        rnd, init = seeded("balanced", 0.05)
        r = rnd(skewed() * scale, init, phys)
        assert r.update[0]
        ratios.append(r.gate[0].improvement_ratio)
    assert ratios[0] == pytest.approx(ratios[1])


@pytest.mark.parametrize("minimum,moves", [(0.0, True), (1.0, False)])
def test_greedy_requires_minimum_improvement(minimum, moves):
    rnd, init = seeded("greedy", minimum)
    assert bool(rnd(skewed(), init).update[0]) is moves


def test_every_layer_replanned_and_shapes_checked():
    rnd, init = seeded("incremental", 0.0, layers=3)
    r = rnd(skewed(3), init)
    assert r.table.shape == (3, D * (E // D + R)) and r.update.all()
    with pytest.raises(ValueError, match="layers"):
        rnd(skewed(2), init)
    with pytest.raises(ValueError, match="physical"):
        rnd(skewed(3), init, np.zeros((3, D, 2)))


def test_gate_threshold_out_of_range_is_a_config_error():
    with pytest.raises(ConfigError, match=r"eplb_min_peak_load_improvement=1.5 must be in"):
        seeded("balanced", 1.5)[0](skewed(), initial())


@pytest.mark.parametrize("kind,bad,known", [
    ("incremental", "budget_slot", "budget_slots"),
    ("node_aware", "num_node", "num_nodes"),
    ("balanced", "budget_slots", "it takes no options"),
    ("greedy", "num_nodes", "it takes no options"),
])
def test_unknown_policy_option_raises_naming_it(kind, bad, known):
    with pytest.raises(ConfigError) as err:
        make_policy(kind, D, E, R, **{bad: 1})
    msg = str(err.value)
    assert f"{kind} policy: unknown option {bad!r}" in msg and known in msg
    assert err.value.exit_code == 2                    # a UserError: the CLI prints `error:`


def test_unknown_policy_options_are_all_named():
    with pytest.raises(ConfigError, match=r"unknown options 'a_x', 'b_y' \(known: budget_slots"):
        make_policy("incremental", D, E, R, b_y=1, a_x=2)
