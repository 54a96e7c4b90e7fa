"""The cost model (eplb/cost_model.py), the cost-aware gate and the post-commit checks."""

from __future__ import annotations

import numpy as np
import pytest

from xllm_eplb.eplb import cost_model as cm
from xllm_eplb.eplb.cost_check import CostChecks
from xllm_eplb.eplb.gate import Planner, propose
from xllm_eplb.eplb.manager_cost import CostGuard
from xllm_eplb.eplb.manager_stats import Counters
from xllm_eplb.eplb.policy import make_policy

#: the issue's measurement: one call on 12 rows 378 us, the same rows in two calls 582 us
FIXED, ROW = 204e-6, 14.5e-6


def fit_of(layers: int, fixed=FIXED, row=ROW) -> cm.CostFit:
    return cm.CostFit(np.full(layers, fixed), np.full(layers, row),
                      np.full(layers, 100), np.ones(layers, dtype=bool))


def test_fit_recovers_the_coefficients_through_noise_and_outliers():
    rng = np.random.default_rng(0)
    active = rng.integers(1, 10, 400).astype(float)
    rows = active * rng.uniform(1, 6, 400)
    y = FIXED * active + ROW * rows
    y *= rng.normal(1.0, 0.03, 400)
    y[::25] *= 8                                     # preempted steps: 4 % wild outliers
    fixed, row = cm.fit_layer(active, rows, y)
    assert fixed == pytest.approx(FIXED, rel=0.08) and row == pytest.approx(ROW, rel=0.15)


def test_fit_never_returns_a_negative_coefficient():
    active = np.array([1, 2, 3, 4, 5.0])
    rows = np.array([10, 8, 6, 4, 2.0])
    fixed, row = cm.fit_layer(active, rows, 1e-3 * active)   # rows only hurt: row pinned at 0
    assert row == 0.0 and fixed == pytest.approx(1e-3)


def test_splitting_a_hot_expert_pays_a_second_fixed_cost():
    """EP2, 4 experts, 3 slots per rank; expert 0 hot. Replicating it halves its rows on each
    rank, but both replicas pay the fixed cost: the model sees what token counts do not."""
    fit = fit_of(1)
    rate = np.array([[12.0, 1.0, 1.0, 1.0]])
    single = np.array([[0, 1, 2, 3, 1, 2]])          # 0 alone on rank 0 (+1 replica of 1, 2)
    split = np.array([[0, 1, 2, 0, 3, 2]])           # 0 on both ranks
    tok_single = cm.slot_rates(rate, single).reshape(2, 3).sum(1)
    tok_split = cm.slot_rates(rate, split).reshape(2, 3).sum(1)
    assert tok_split.max() < tok_single.max()        # token counts: the split is better
    c_single = cm.rank_costs(fit, rate, single, 2)[0]
    c_split = cm.rank_costs(fit, rate, split, 2)[0]
    lam = cm.slot_rates(rate, split)[0]
    want = (FIXED * -np.expm1(-lam) + ROW * lam).reshape(2, 3).sum(1)
    np.testing.assert_allclose(c_split, want)
    assert c_split.sum() > c_single.sum()            # total work grows with the split


def test_cost_gate_refuses_a_split_the_token_gate_publishes():
    """The issue's split-cost case in miniature: a candidate that lowers the token peak but
    raises the modelled critical path is published on tokens, refused on cost."""
    fit = fit_of(1)
    rate = np.array([[8.0, 3.0, 3.0, 3.0]])
    deployed = np.array([[0, 1, 2, 3, 1, 2]])         # token peak 11 on rank 0
    candidate = np.array([[0, 1, 2, 0, 3, 2]])        # 8.5 on both: 23 % lower

    class Fixed:
        """A policy that proposes ``candidate`` (the gate is what is tested)."""
        name, ep_size, num_logical, num_slots, slots = "fixed", 2, 4, 6, 3

        def plan(self, logical, deployed):
            return [candidate[0]]

    logical = rate * 100
    snap = cm.CostSnapshot(fit, rate)
    on_tokens = propose(Fixed(), logical, deployed, min_improvement=0.05)
    on_cost = propose(Fixed(), logical, deployed, min_improvement=0.05, cost=snap)
    assert on_tokens.update.tolist() == [True]
    assert on_cost.update.tolist() == [False] and on_cost.gate[0].basis == "cost"
    rec = on_cost.gate[0]
    assert on_tokens.gate[0].improvement_ratio > 0.2  # what token counts promise
    assert 0 <= rec.improvement_ratio < 0.05          # modelled: under 1 %, not worth a move
    want = cm.critical_path(fit, rate, deployed, 2)[0]
    assert rec.current_peak == pytest.approx(want)


def test_planner_on_tokens_ignores_a_snapshot_and_bad_choice_is_an_error():
    pol = make_policy("greedy", 2, 4, 1)
    logical = np.array([[600, 30, 30, 30]])
    deployed = np.array([[0, 1, 2, 3, 1, 2]])
    snap = cm.CostSnapshot(fit_of(1), logical / 100.0)
    a = Planner(pol, 0.05, "tokens")(logical, None, deployed, cost=snap)
    b = Planner(pol, 0.05, "tokens")(logical, None, deployed)
    assert np.array_equal(a.table, b.table) and all(r.basis == "tokens" for r in a.gate)
    with pytest.raises(Exception, match="eplb_plan_on='rows'"):
        Planner(pol, 0.05, "rows")


def observe_steps(model: cm.CostModel, placement, steps: int, rng, fixed=FIXED, row=ROW,
                  hot=0):
    """Feed ``steps`` decode steps drawn from a skewed rate; expert time from the true model."""
    L, D = model.L, model.D
    slots = placement.shape[1] // D
    for _ in range(steps):
        deltas = rng.poisson(1.5, size=(L, D, slots))
        deltas[:, hot, 0] += 6
        active = (deltas > 0).sum(axis=2)
        cpu = (fixed * active + row * deltas.sum(axis=2)) * rng.normal(1, 0.02, (L, D))
        model.observe(deltas, placement, cpu.T)


def test_model_fits_on_the_fly_and_tracks_the_rate():
    rng = np.random.default_rng(1)
    m = cm.CostModel(2, 2, 4)
    placement = np.tile([0, 1, 2, 3, 1, 2], (2, 1))
    assert m.snapshot() is None
    observe_steps(m, placement, cm.MIN_SAMPLES, rng)
    snap = m.snapshot()
    assert snap is not None and snap.fit.ready
    np.testing.assert_allclose(snap.fit.fixed, FIXED, rtol=0.15)
    np.testing.assert_allclose(snap.fit.row, ROW, rtol=0.25)
    # expert 0 (slot 0 of rank 0): Poisson(1.5) + 6 rows per step
    assert snap.rate[0, 0] == pytest.approx(7.5, rel=0.2)
    sec, n = m.measured(0, 10)
    assert n == 10 and sec > 0
    with pytest.raises(ValueError, match="expert_cpu of shape"):
        m.observe(np.zeros((2, 2, 3), dtype=np.int64), placement, np.zeros((2, 3)))


def test_a_layer_measured_slower_after_its_commit_is_rolled_back():
    rng = np.random.default_rng(2)
    counters = Counters()
    guard = CostGuard(1, 2, 4)
    placement = np.array([[0, 1, 2, 3, 1, 2]])
    observe_steps(guard.model, placement, 60, rng)
    prev = placement[0].copy()
    guard.on_commit(0, prev, epoch=1)
    new = np.array([[0, 1, 2, 0, 3, 2]])
    # after the commit every step costs 30 % more on the slow rank
    for _ in range(guard.checks.steps):
        deltas = rng.poisson(1.5, size=(1, 2, 3))
        cpu = 1.3 * (FIXED * (deltas > 0).sum(2) + ROW * deltas.sum(2)) + 1e-3
        counters.count_checks(guard.observe(deltas, new, cpu.T, epoch=1))
    assert counters.cost_checks == 1 and counters.layers_regressed == 1
    table, update = guard.rollback_round(new)
    counters.count_rollback(update)
    assert update.tolist() == [True] and np.array_equal(table[0], prev)
    assert counters.layers_rolled_back == 1 and guard.rollback_round(new) is None
    # /eplb/status says why (issue 35); the restore's activation is no commit
    why = guard.status(new, placement)["rollbacks"]
    assert [r["layer"] for r in why] == [0] and why[0]["measured_gain"] < -0.05
    assert why[0]["measured_after_ms"] > why[0]["measured_before_ms"]
    assert "more than the 5% tolerance" in why[0]["why"] and "previous row was restored" in why[
        0]["why"]
    assert guard.on_commit(0, new[0], epoch=2) is False
    assert guard.on_commit(0, prev, epoch=3) is True
    # the rolled-back layer sits out the next rounds
    from xllm_eplb.eplb.gate import Round
    rnd = Round(new, np.array([True]))
    _, upd = guard.filter_round(rnd, placement)
    assert upd.tolist() == [False]


def test_checks_ignore_samples_of_the_old_epoch_and_pass_a_faster_layer():
    rng = np.random.default_rng(3)
    model = cm.CostModel(1, 2, 4)
    placement = np.array([[0, 1, 2, 3, 1, 2]])
    observe_steps(model, placement, 60, rng)
    checks = CostChecks(model, steps=8)
    checks.on_commit(0, placement[0], epoch=5)
    slow = np.full((2, 1), 1.0)
    assert checks.on_sample(slow, epoch=4) == []          # queued before the commit
    before = model.measured(0, 8)[0]
    res = []
    for _ in range(8):
        res += checks.on_sample(np.full((2, 1), 0.5 * before), epoch=5)
    assert len(res) == 1 and not res[0].regressed
    assert res[0].measured_gain == pytest.approx(0.5) and res[0].predicted_gain is None


def test_replay_with_a_modelled_cost_fits_it_and_plans_on_it():
    """The simulator's cost option: the manager sees modelled expert seconds, fits the same
    coefficients, and its cost-gated rounds shorten the modelled critical path."""
    import dataclasses

    from xllm_eplb.config import EplbConfig
    from xllm_eplb.sim.generators import generate
    from xllm_eplb.sim.replay import ReplayOptions, replay

    trace = generate("zipf:layers=2,experts=16,steps=120,tokens=32,topk=2,skew=1.5,seed=3")
    cfg = EplbConfig(ep_size=4, redundant_experts_num=1, eplb_update_interval=20.0,
                     eplb_heartbeat_seconds=1e9)
    opts = ReplayOptions(step_seconds=1.0, cost=(FIXED, ROW))
    res = replay(trace, cfg, opts)
    crit = res.extra["critical"]                     # [steps, (eplb, static, static mean)]
    assert crit.shape == (120, 3) and (crit[:, 1] >= crit[:, 2]).all()
    start = res.first_activation
    assert start is not None and res.stats["layers_committed"] >= 1
    assert crit[start:, 0].mean() < crit[start:, 1].mean()
    tok = replay(trace, dataclasses.replace(cfg, eplb_plan_on="tokens"), opts)
    assert np.array_equal(tok.extra["critical"][:, 1], crit[:, 1])   # same static path


def test_a_layer_whose_data_cannot_separate_the_terms_takes_the_pooled_fit():
    rng = np.random.default_rng(4)
    m = cm.CostModel(2, 2, 4)
    for _ in range(60):
        deltas = rng.poisson(2.0, size=(2, 2, 3)) + 1
        deltas[1] = 3                                # layer 1: 3 active, 9 rows every step
        active, rows = (deltas > 0).sum(2), deltas.sum(2)
        cpu = 2 * (FIXED * active + ROW * rows)      # layer 1 costs like the others, x2
        cpu[0] /= 2
        m.observe(deltas, np.tile([0, 1, 2, 3, 1, 2], (2, 1)), cpu.T)
    fit = m.fit()
    assert fit.ready and fit.fixed[1] > 0 and fit.row[1] > 0
    assert fit.fixed[1] / fit.row[1] == pytest.approx(fit.fixed[0] / fit.row[0], rel=1e-6)
    assert 3 * fit.fixed[1] + 9 * fit.row[1] == pytest.approx(2 * (3 * FIXED + 9 * ROW),
                                                              rel=0.05)


def test_cost_rounds_wait_for_the_model_once_timings_flow():
    guard = CostGuard(1, 2, 4)
    cost, tokens = Planner(make_policy("greedy", 2, 4, 1), 0.05, "cost"), \
        Planner(make_policy("greedy", 2, 4, 1), 0.05, "tokens")
    assert not guard.waiting(10, cost)               # no timings at all: plan on tokens now
    observe_steps(guard.model, np.array([[0, 1, 2, 3, 1, 2]]), 5, np.random.default_rng(5))
    assert guard.waiting(10, cost) and not guard.waiting(10, tokens)
    assert not guard.waiting(10_000, cost)           # an old window: stop waiting
    observe_steps(guard.model, np.array([[0, 1, 2, 3, 1, 2]]), guard.checks.steps,
                  np.random.default_rng(6))
    assert not guard.waiting(10, cost)               # fitted, enough steps for the check
    fresh = CostGuard(1, 2, 4, expect_timings=True)  # the engine: wait from the first sample
    assert fresh.waiting(10, cost) and not fresh.waiting(10, tokens)
