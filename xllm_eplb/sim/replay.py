"""Offline replay of a load trace through the real control plane.

Per trace step, exactly what the engine does: ``mgr.eplb_info(allow=True)`` -> simulated workers
(:class:`~xllm_eplb.sim.workers.SimWorkers`: prepare acknowledged after
``transfer_steps_per_layer`` forwards, activation after the forward) -> per-rank prefix-sum
counters of the step's load under the placement the workers ran -> ``mgr.on_outputs`` ->
simulated clock ``+= step_seconds`` -> ``mgr.tick()`` (sync runner: timer, policy, timeouts).
The same step is also measured under the static initial placement (EPLB off).

Replica routing (``ReplayOptions.routing``): None = the aggregate model (each expert's step total
split evenly over its replicas); a mode of ``eplb/replica_routing.py`` = the step's counts split
over source ranks (the trace's ``sources``, else a multinomial split seeded by
``routing_seed``) and routed by that mode, under both placements (``sim/routing.py``). The
counters the manager sees are what each slot served.

Metrics per step (over MoE layers): balancedness = mean over layers of mean/max rank load;
peak/ideal = mean over layers of max/mean (its mean over the steps from the first activation on
is ``step_peak_over_ideal``); modelled MoE step cost = sum over layers of the max
rank load (tokens; the slowest rank gates every layer). Window metric: from the first activation
on, per ``window_steps`` window the rank loads are summed, balancedness computed per layer and
averaged over layers; the summary value is the mean over full windows.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import numpy as np

from xllm_eplb.config import EplbConfig
from xllm_eplb.eplb import counters as counter_format
from xllm_eplb.eplb.balance import balancedness
from xllm_eplb.eplb.info import NO_LAYER
from xllm_eplb.eplb.manager import EplbManager
from xllm_eplb.eplb.placement import diff
from xllm_eplb.errors import InputFileError
from xllm_eplb.sim.routing import Router, split_sources
from xllm_eplb.sim.trace import Trace
from xllm_eplb.sim.workers import SimWorkers, slot_counts


@dataclass
class ReplayOptions:
    step_seconds: float = 0.05
    transfer_steps_per_layer: int = 1
    window_steps: int = 100
    use_estimator: bool | None = None   # None: follow eplb_use_estimator
    routing: str | None = None          # replica routing mode; None: even split (see module doc)
    routing_seed: int = 0               # seed of the source split when the trace has none
    #: (fixed seconds per active slot, seconds per row): feed the manager modelled expert
    #: seconds (its cost model then plans on cost) and record the modelled critical path
    cost: tuple[float, float] | None = None


class SimClock:
    """The simulated clock handed to the manager (seconds)."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        """One simulated step went by."""
        self.t += seconds


@dataclass
class ReplayResult:
    """Per-step series (``[steps]``), per-step rank loads (``[steps, layers, ranks]``) with and
    without EPLB, rebalance round start steps, and the manager's final stats."""

    rank_eplb: np.ndarray
    rank_static: np.ndarray
    activated_layer: np.ndarray
    slots_moved: np.ndarray
    round_steps: list[int]
    stats: dict
    placement_static: np.ndarray
    placement_final: np.ndarray
    wall_seconds: float = 0.0
    window_steps: int = 100
    extra: dict = field(default_factory=dict)
    routing: str | None = None

    @property
    def activated(self) -> np.ndarray:
        """Layers activated per step (0 or 1), int64 ``[steps]``."""
        return (self.activated_layer != NO_LAYER).astype(np.int64)

    @property
    def first_activation(self) -> int | None:
        idx = np.nonzero(self.activated)[0]
        return int(idx[0]) if idx.size else None

    def layer_first_activation(self) -> np.ndarray:
        """Per layer: step of its first activation (the global first activation, or 0, for a
        layer never activated), int64 ``[layers]``."""
        default = self.first_activation or 0
        out = np.full(self.rank_eplb.shape[1], -1, dtype=np.int64)
        for t in np.nonzero(self.activated)[0][::-1]:
            out[self.activated_layer[t]] = t
        return np.where(out < 0, default, out)


def rank_totals(per_slot: np.ndarray, ep_size: int) -> np.ndarray:
    """``[layers, ranks*slots]`` -> per-rank totals ``[layers, ranks]``."""
    return per_slot.reshape(per_slot.shape[0], ep_size, -1).sum(axis=2)


def replay(trace: Trace, cfg: EplbConfig, opts: ReplayOptions | None = None) -> ReplayResult:
    """Run ``trace`` through aggregator + estimator + manager + policy (``cfg.ep_size`` must be
    set; ``opts.use_estimator``, when not None, replaces ``cfg.eplb_use_estimator``)."""
    opts = opts or ReplayOptions()
    if opts.use_estimator is not None:
        cfg = dataclasses.replace(cfg, eplb_use_estimator=bool(opts.use_estimator))
    ep = int(cfg.ep_size)
    clock = SimClock()
    mgr = EplbManager(cfg, trace.layers, trace.experts, clock=clock, runner="sync",
                      expect_timings=opts.cost is not None)
    static = mgr.active_placement.copy()
    workers = SimWorkers(static, ep, delays=int(opts.transfer_steps_per_layer))
    steps = trace.steps
    step_slots = _step_slots(trace, ep, opts)
    rank_eplb = np.zeros((steps, trace.layers, ep), dtype=np.int64)
    rank_static = np.zeros_like(rank_eplb)
    activated = np.full(steps, NO_LAYER, dtype=np.int64)
    moved = np.zeros(steps, dtype=np.int64)
    rounds, round_steps = 0, []
    critical = np.zeros((steps, 3)) if opts.cost is not None else None
    t0 = time.perf_counter()
    try:
        for t in range(steps):
            load = trace.loads[t]
            info = mgr.eplb_info(True)
            workers.before_forward(info)
            before = workers.placement[info.update_layer_id].copy() \
                if info.update_layer_id != NO_LAYER else None
            served, served_static = step_slots(t, workers.placement, static)
            cnt = workers.counters(load, served)
            rank_eplb[t] = np.stack([counter_format.totals(c) for c in cnt], axis=1)
            rank_static[t] = rank_totals(served_static, ep)
            tokens, act = workers.after_forward(info)
            if before is not None:
                activated[t] = info.update_layer_id
                moved[t] = diff(before, workers.placement[info.update_layer_id], ep).moved_slots
            mgr.on_outputs(cnt, tokens, act, expert_cpu=cost_step(
                opts.cost, cnt, served_static, ep, critical, t))
            clock.advance(opts.step_seconds)
            mgr.tick()
            r = mgr.stats()["rounds"]
            if r != rounds:
                rounds = r
                round_steps.append(t)
        stats = mgr.stats()
        final = mgr.active_placement.copy()
    finally:
        mgr.close()
    extra = {} if critical is None else {"critical": critical}
    return ReplayResult(rank_eplb, rank_static, activated, moved, round_steps, stats, static,
                        final, time.perf_counter() - t0, opts.window_steps, extra,
                        routing=opts.routing)


def modelled_cost(per_slot: np.ndarray, fixed: float, row: float) -> np.ndarray:
    """Per-rank expert seconds of one step: per_slot [L, D, S] rows -> float64 [L, D]."""
    return fixed * (per_slot > 0).sum(axis=2) + row * per_slot.sum(axis=2)


def cost_step(cost, cnt, served_static, ep: int, critical, t: int):
    """``ReplayOptions.cost``: the step's modelled expert seconds per rank under the EPLB
    placement (``[D, L]``, what the workers would report) and, into ``critical[t]``, the
    modelled critical path (sum over layers of the slowest rank) under EPLB and static, and
    the static mean rank's. None without a cost."""
    if cost is None:
        return None
    eplb = modelled_cost(counter_format.decode(np.stack(cnt, axis=1)), *cost)
    layers = served_static.shape[0]
    stat = modelled_cost(np.asarray(served_static).reshape(layers, ep, -1), *cost)
    critical[t] = (eplb.max(axis=1).sum(), stat.max(axis=1).sum(), stat.mean(axis=1).sum())
    return eplb.T


def _step_slots(trace: Trace, ep: int, opts: ReplayOptions):
    """``f(t, placement, static) -> (slots served [layers, D*S] under placement or None for the
    even split, the same under static)`` for step ``t`` (see module doc)."""
    if opts.routing is None:
        return lambda t, placement, static: (None, slot_counts(trace.loads[t], static))
    if trace.sources is not None and trace.sources.shape[2] != ep:
        raise InputFileError(f"trace sources have {trace.sources.shape[2]} source ranks but "
                             f"ep_size={ep}: they must match")
    router = Router(opts.routing, trace.experts, ep)
    rng = np.random.default_rng(opts.routing_seed)

    def step(t, placement, static):
        src = trace.sources[t] if trace.sources is not None else \
            split_sources(trace.loads[t], ep, rng)
        return router.slot_counts(src, placement), router.slot_counts(src, static)
    return step


# --- metrics ------------------------------------------------------------------------------------

def step_series(rank: np.ndarray) -> dict[str, np.ndarray]:
    """Per-step balancedness, peak/ideal and step cost from rank loads ``[steps, layers, D]``."""
    b = balancedness(rank)                                   # [steps, layers]
    return {"balancedness": b.mean(axis=1),
            "peak_over_ideal": (1.0 / np.maximum(b, 1e-12)).mean(axis=1),
            "step_cost": rank.max(axis=2).sum(axis=1)}


def window_balancedness(rank: np.ndarray, start, window: int) -> float:
    """Mean balancedness over full ``window``-step windows of rank loads ``[steps, layers, D]``.

    ``start``: one step for every layer, or ``[layers]`` (each layer's windows start at its own
    first activation). Per layer: rank loads summed per window, mean/max; averaged over the
    layer's windows, then over layers. A layer with no full window uses what is left.
    """
    steps, layers, _ = rank.shape
    starts = np.broadcast_to(np.asarray(start, dtype=np.int64), (layers,))
    per_layer = []
    for lay in range(layers):
        s0 = int(starts[lay])
        edges = list(range(s0, steps - window + 1, window)) or [s0]
        sums = np.stack([rank[s:s + window, lay].sum(axis=0) for s in edges if s < steps]
                        or [rank[:, lay].sum(axis=0)])
        per_layer.append(float(balancedness(sums).mean()))
    return float(np.mean(per_layer))


def summarize(res: ReplayResult) -> dict:
    """``summary.json`` content: headline numbers first, then one record per step."""
    first = res.first_activation
    per_layer = res.layer_first_activation()
    w = res.window_steps
    glob = 0 if first is None else first
    se, ss = step_series(res.rank_eplb), step_series(res.rank_static)
    act = res.activated
    st = res.stats
    per_step = [
        {"step": t, "balancedness": round(float(se["balancedness"][t]), 6),
         "balancedness_static": round(float(ss["balancedness"][t]), 6),
         "peak_over_ideal": round(float(se["peak_over_ideal"][t]), 6),
         "step_cost": int(se["step_cost"][t]), "step_cost_static": int(ss["step_cost"][t]),
         "layers_activated": int(act[t]), "slots_moved": int(res.slots_moved[t])}
        for t in range(res.rank_eplb.shape[0])]
    return {
        "balancedness_static": window_balancedness(res.rank_static, per_layer, w),
        "balancedness_eplb": window_balancedness(res.rank_eplb, per_layer, w),
        "slots_moved": int(st["slots_moved"]),
        "weight_copies": int(st["weight_copies"]),
        "rounds": int(st["rounds"]),
        "layers_committed": int(st["layers_committed"]),
        "timeouts": int(st["layers_timed_out"]),
        "layers_published": int(st["layers_published"]),
        "first_activation_step": first,
        "window_steps": w,
        "window_start": "per layer, at its first activation",
        "balancedness_static_global_start": window_balancedness(res.rank_static, glob, w),
        "balancedness_eplb_global_start": window_balancedness(res.rank_eplb, glob, w),
        "step_cost_static_mean": float(ss["step_cost"].mean()),
        "step_cost_eplb_mean": float(se["step_cost"].mean()),
        "replica_routing": res.routing or "even split (aggregate)",
        "step_peak_over_ideal": float(se["peak_over_ideal"][glob:].mean()),
        "step_peak_over_ideal_static": float(ss["peak_over_ideal"][glob:].mean()),
        "policy": st["policy"],
        "round_steps": res.round_steps,
        "wall_seconds": round(res.wall_seconds, 3),
        **res.extra,
        "steps": per_step,
    }
