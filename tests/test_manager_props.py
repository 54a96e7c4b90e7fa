"""Property test: for random interleavings of outputs, prepare tokens (delayed, stuck, stale),
allow flags, clock jumps and ticks, the manager's active placement always equals the placement
the simulated workers actually run, and every round is planned against that placement."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xllm_eplb.config import EplbConfig
from xllm_eplb.eplb.gate import Round
from xllm_eplb.eplb.info import NO_TOKEN
from xllm_eplb.eplb.manager import EplbManager
from xllm_eplb.sim.workers import SimWorkers

L, D, E, R = 3, 2, 4, 1


class ShufflePlanner:
    """Each round: random slot permutations of the deployed table it is handed, for random
    layers (no gate); checks that table against what the workers run at that moment."""

    name = "shuffle"

    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)
        self.workers = None
        self.rounds = 0

    def __call__(self, logical, physical, deployed):
        assert (np.asarray(deployed) == self.workers.placement).all()
        self.rounds += 1
        upd = self.rng.random(L) < 0.7
        table = np.array(deployed, copy=True)
        for layer in np.nonzero(upd)[0]:
            table[layer] = self.rng.permutation(table[layer])
        return Round(table, upd)


class Clock:
    t = 0.0

    def __call__(self):
        return self.t


action = st.one_of(
    st.tuples(st.just("step"), st.booleans(), st.booleans()),    # allow, inject stale token
    st.tuples(st.just("tick"), st.floats(0.0, 1.5)),            # advance clock then tick
    st.tuples(st.just("delays"), st.lists(st.one_of(st.none(), st.integers(1, 3)),
                                          min_size=D, max_size=D)),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(actions=st.lists(action, min_size=5, max_size=80), seed=st.integers(0, 10**6))
def test_active_placement_always_equals_worker_placement(actions, seed):
    rng = np.random.default_rng(seed)
    clock = Clock()
    cfg = EplbConfig(ep_size=D, redundant_experts_num=R, eplb_update_interval=0.3,
                     eplb_prepare_timeout_seconds=1.0)
    pol = ShufflePlanner(seed)
    mgr = EplbManager(cfg, L, E, planner=pol, clock=clock, runner="sync")
    workers = pol.workers = SimWorkers(mgr.active_placement, D, delays=1)
    seen_tokens = []
    for act in actions:
        if act[0] == "step":
            info = mgr.eplb_info(act[1])
            if info.prepare_token != NO_TOKEN:
                seen_tokens.append(info.prepare_token)
            workers.before_forward(info)              # raises on an unprepared activation
            load = rng.integers(0, 20, size=(L, E))
            cnt = workers.counters(load)
            tokens, act_tok = workers.after_forward(info)
            old = [t for t in seen_tokens if t != mgr.pipe.active_token]
            if act[2] and old:
                tokens[0] = old[0]                       # a late/duplicate token
            mgr.on_outputs(cnt, tokens, act_tok)
            clock.t += 0.05
        elif act[0] == "tick":
            clock.t += act[1]
            mgr.tick()
        else:
            workers.delays = act[1]
        assert (mgr.active_placement == workers.placement).all()
    st_ = mgr.stats()
    assert st_["layers_committed"] == workers.activations
    assert seen_tokens == sorted(set(seen_tokens))    # unique, monotonic
    assert st_["rounds"] == pol.rounds


@pytest.mark.parametrize("kind", ["balanced", "greedy"])
def test_real_policy_replay_keeps_placements_in_sync(kind):
    """Same property with the real policies over a skewed load and a few stuck prepares."""
    pytest.importorskip(f"xllm_eplb.eplb.policy.{kind}")
    clock = Clock()
    cfg = EplbConfig(ep_size=4, redundant_experts_num=1, eplb_update_interval=0.5,
                     eplb_prepare_timeout_seconds=0.4, eplb_policy_kind=kind)
    mgr = EplbManager(cfg, 4, 16, clock=clock, runner="sync")
    workers = SimWorkers(mgr.active_placement, 4, delays=2)
    rng = np.random.default_rng(1)
    w = rng.zipf(1.5, 16).astype(float)
    for step in range(400):
        if step % 50 == 0:
            w = rng.permutation(w)                               # the hot set drifts
        if step == 100:
            workers.delays = [2, None, 2, 2]                 # rank 1 gets stuck
        if step == 130:
            workers.delays = [1, 1, 1, 1]
        info = mgr.eplb_info(step % 7 != 3)
        workers.before_forward(info)
        cnt = workers.counters(rng.multinomial(400, w / w.sum(), size=4))
        mgr.on_outputs(cnt, *workers.after_forward(info))
        clock.t += 0.05
        mgr.tick()
        assert (mgr.active_placement == workers.placement).all()
    st_ = mgr.stats()
    assert st_["layers_committed"] >= 1 and st_["layers_timed_out"] >= 1
