"""Which planned layers a rebalance round publishes: the strict-invariant check and the
publication gate (pure functions; the caller owns every table).

A round (:func:`propose`) takes the policy's candidate rows (``policy.plan(logical, deployed)``,
one ``[D*S]`` row or None per layer) and keeps a layer only when

1. its row obeys the strict invariants (:func:`~xllm_eplb.eplb.placement.valid_rows`): ids in ``[0, E)``, every expert
   present, at most one replica of an expert per rank. A row that breaks them is logged and
   skipped;
2. the row differs from the deployed one;
3. for a deployed layer, the peak improves enough (:func:`gate`, xLLM's ``compare_peak``): the
   current peak is the measured peak rank load (the physical window) or, without one, the
   even-split estimate under the deployed row; the proposed peak is the even-split estimate under
   the candidate, rescaled into physical units by ``physical total / logical total``; the layer
   is published when ``ratio = (current - proposed) / current`` is ``> 0`` and
   ``>= min_improvement``. Every gated layer logs one ``EPLB placement benefit`` line.

A layer with nothing deployed (a ``-1`` row, or ``deployed=None``) takes any valid candidate,
ungated.

Cost-aware rounds (``cost``: a :class:`~xllm_eplb.eplb.cost_model.CostSnapshot`, the planner's
``plan_on="cost"`` once the model is fitted): the policy balances per-expert cost in token
equivalents (:func:`~xllm_eplb.eplb.cost_model.expert_weights`: rows plus the fixed cost of an
active slot), and step 3 compares the *modelled step critical path* (max over ranks of the
fitted per-rank cost, each replica paying its own fixed cost) under the deployed and the
candidate row (:func:`cost_gate`): a layer is published only when it falls by
``min_improvement``. Its records carry ``basis="cost"`` and seconds per step.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import numpy as np

from xllm_eplb.eplb import cost_model
from xllm_eplb.eplb.balance import rank_loads_from_phy2log
from xllm_eplb.eplb.cost_search import align_row, pack_row, refine_row
from xllm_eplb.eplb.placement import valid_rows
from xllm_eplb.errors import ConfigError
from xllm_eplb.obs.logs import event

if TYPE_CHECKING:
    from xllm_eplb.eplb.policy.base import EplbPolicy

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GateRecord:
    """One gated layer: peaks in physical units (tokens) when a physical window was given."""

    layer: int
    current_peak: float
    proposed_peak: float
    improvement_ratio: float
    min_improvement_ratio: float
    placement_changed: bool
    basis: str = "tokens"            # tokens: peak rank load; cost: modelled seconds per step


@dataclass(frozen=True)
class Round:
    """A round's decision: ``table`` int64 ``[L, D*S]`` (the candidate where ``update``, the
    deployed row elsewhere), ``update`` bool ``[L]``, the gate's records (gated layers only)."""

    table: np.ndarray
    update: np.ndarray
    gate: tuple[GateRecord, ...] = ()


def check_min_improvement(value: float) -> float:
    """``eplb_min_peak_load_improvement`` must be in [0, 1]; returns it as float."""
    if not 0.0 <= float(value) <= 1.0:
        raise ConfigError(f"eplb_min_peak_load_improvement={value} must be in [0, 1]")
    return float(value)


def gate(logical: np.ndarray, deployed: np.ndarray, proposed: np.ndarray,
         physical: np.ndarray | None, layers: np.ndarray, ep_size: int,
         min_improvement: float) -> list[GateRecord]:
    """xLLM's compare_peak for the layers ``layers`` (int [k]); see the module docstring.

    logical [L, E], deployed / proposed [L, D*S], physical [L, D, S] float or None.
    """
    idx = np.asarray(layers, dtype=np.int64)
    w = np.asarray(logical[idx], dtype=np.float64)
    cur = rank_loads_from_phy2log(deployed[idx], w, ep_size).max(axis=1)
    prop = rank_loads_from_phy2log(proposed[idx], w, ep_size).max(axis=1)
    if physical is not None:
        dev = np.asarray(physical[idx], dtype=np.float64).sum(axis=2)
        cur = dev.max(axis=1)
        tot = w.sum(axis=1)
        prop = np.where(tot > 0, prop * dev.sum(axis=1) / np.where(tot > 0, tot, 1.0), prop)
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = np.where(cur > 0, (cur - prop) / np.where(cur > 0, cur, 1.0), 0.0)
    ok = (ratio > 0) & (ratio >= min_improvement)
    return [GateRecord(int(i), float(cur[j]), float(prop[j]), float(ratio[j]),
                       float(min_improvement), bool(ok[j])) for j, i in enumerate(idx)]


def cost_gate(cost: cost_model.CostSnapshot, deployed: np.ndarray, proposed: np.ndarray,
              layers: np.ndarray, ep_size: int, min_improvement: float) -> list[GateRecord]:
    """The gate on the modelled step critical path (seconds per step) of the layers ``layers``
    (int [k]); deployed / proposed [L, D*S]. Published when the relative drop is ``> 0`` and
    ``>= min_improvement``."""
    idx = np.asarray(layers, dtype=np.int64)
    cur = cost_model.critical_path(cost.fit, cost.rate, deployed[idx], ep_size, idx)
    prop = cost_model.critical_path(cost.fit, cost.rate, proposed[idx], ep_size, idx)
    ratio = np.where(cur > 0, (cur - prop) / np.where(cur > 0, cur, 1.0), 0.0)
    ok = (ratio > 0) & (ratio >= min_improvement)
    return [GateRecord(int(i), float(cur[j]), float(prop[j]), float(ratio[j]),
                       float(min_improvement), bool(ok[j]), "cost") for j, i in enumerate(idx)]


def cost_input(cost: cost_model.CostSnapshot, logical: np.ndarray) -> np.ndarray:
    """The policy's input on a cost-aware round: per-expert cost in token equivalents, scaled
    so that a layer's rows keep the window's units (float64 [L, E])."""
    lg = np.asarray(logical, dtype=np.float64)
    per_step = cost.rate.sum(axis=1)
    scale = np.where(per_step > 0, lg.sum(axis=1) / np.where(per_step > 0, per_step, 1.0), 1.0)
    return cost_model.expert_weights(cost.fit, cost.rate, scale)


#: a cost-aware round takes the row that changes fewest slots among those whose modelled
#: critical path is within this fraction of the lowest
NEAR_BEST = 0.03


def cost_candidates(policy: EplbPolicy, cost: cost_model.CostSnapshot, logical: np.ndarray,
                    deployed: np.ndarray) -> list[np.ndarray | None]:
    """A cost-aware round's candidates: the policy plans twice, on token counts and on
    :func:`cost_input`; each plan and the deployed row are then polished on the modelled step
    cost (:func:`~xllm_eplb.eplb.cost_search.refine_row`: swaps before splits, at most
    ``slots`` moves), and a row packed from scratch on the model
    (:func:`~xllm_eplb.eplb.cost_search.pack_row`) is polished too. Every row is aligned to the
    deployed one (:func:`~xllm_eplb.eplb.cost_search.align_row`: same cost, fewer slots
    changed). Per layer the row changing fewest slots among those within ``NEAR_BEST`` of the
    lowest modelled critical path wins (a policy's split assumption is even token halves and it
    cannot see the fixed cost, so any of them can plan better)."""
    by_tokens = policy.plan(logical, deployed)
    by_cost = policy.plan(cost_input(cost, logical), deployed)
    out: list[np.ndarray | None] = []
    for layer, (a, b) in enumerate(zip(by_tokens, by_cost, strict=True)):
        dep = np.asarray(deployed[layer], dtype=np.int64)
        seeded = bool((dep >= 0).all())
        rows = [np.asarray(c, dtype=np.int64) for c in (a, b) if c is not None]
        starts = rows + ([dep] if seeded else [])
        starts = [r for r in starts
                  if valid_rows(r[None, :], policy.num_logical, policy.ep_size)[0]]
        fixed, per_row = float(cost.fit.fixed[layer]), float(cost.fit.row[layer])
        starts.append(pack_row(fixed, per_row, cost.rate[layer], policy.ep_size, policy.slots))
        rows += [refine_row(fixed, per_row, cost.rate[layer], r, policy.ep_size,
                            policy.slots)[0] for r in starts]
        if not rows:
            out.append(None)
            continue
        if seeded:
            rows = [align_row(r, dep, policy.ep_size) for r in rows]
        crit = cost_model.critical_path(cost.fit, cost.rate, np.stack(rows), policy.ep_size,
                                        np.full(len(rows), layer))
        changed = [int((r != dep).sum()) if seeded else 0 for r in rows]
        near = [i for i in range(len(rows)) if crit[i] <= crit.min() * (1 + NEAR_BEST)]
        best = min(near, key=lambda i: (changed[i], float(crit[i])))
        out.append(None if seeded and changed[best] == 0 else rows[best])
    return out


def _inputs(policy: EplbPolicy, logical, deployed, physical):
    """Shape-checked (logical [L, E], deployed [L, D*S] with -1 rows, physical or None)."""
    lg = np.asarray(logical)
    if lg.ndim != 2 or lg.shape[1] != policy.num_logical:
        raise ValueError(f"logical load of shape {lg.shape} is not [layers, "
                         f"{policy.num_logical}]")
    layers = lg.shape[0]
    if deployed is None:
        dep = np.full((layers, policy.num_slots), -1, dtype=np.int64)
    else:
        dep = np.asarray(deployed, dtype=np.int64)
        if dep.shape != (layers, policy.num_slots):
            raise ValueError(f"load has {layers} layers, the deployed placement is of shape "
                             f"{dep.shape}, expected {(layers, policy.num_slots)}")
    if physical is not None:
        physical = np.asarray(physical, dtype=np.float64)
        if physical.shape != (layers, policy.ep_size, policy.slots):
            raise ValueError(f"physical load of shape {physical.shape} is not "
                             f"{(layers, policy.ep_size, policy.slots)}")
    return lg, dep, physical


def propose(policy: EplbPolicy, logical: np.ndarray, deployed: np.ndarray | None, *,
            physical: np.ndarray | None = None, min_improvement: float = 0.05,
            cost: cost_model.CostSnapshot | None = None) -> Round:
    """One round: ``policy.plan(logical, deployed)``, the strict-invariant check, the gate.

    logical [L, E] (the policy's input: counts or an estimate); deployed int64 [L, D*S] (None or
    -1 rows: nothing deployed); physical [L, D, S] measured under ``deployed`` or None; cost: a
    fitted cost snapshot (cost-aware round, see the module doc) or None. Pure when the policy
    is: nothing is kept between calls.
    """
    min_improvement = check_min_improvement(min_improvement)
    lg, dep, physical = _inputs(policy, logical, deployed, physical)
    cands = policy.plan(lg, dep) if cost is None else cost_candidates(policy, cost, lg, dep)
    table = np.stack([dep[i] if c is None else np.asarray(c, dtype=np.int64)
                      for i, c in enumerate(cands)])
    planned = np.array([c is not None for c in cands])
    valid = valid_rows(table, policy.num_logical, policy.ep_size)
    for i in np.nonzero(planned & ~valid)[0]:
        log.warning(event("EPLB policy produced an invalid placement; layer skipped",
                          policy=policy.name, layer=int(i)))
    planned &= valid
    seeded = (dep >= 0).all(axis=1)
    changed = planned & (~seeded | (table != dep).any(axis=1))
    update = changed & ~seeded
    records: list[GateRecord] = []
    gated = np.nonzero(changed & seeded)[0]
    if gated.size:
        records = (gate(lg, dep, table, physical, gated, policy.ep_size, min_improvement)
                   if cost is None else
                   cost_gate(cost, dep, table, gated, policy.ep_size, min_improvement))
        verbose = log.isEnabledFor(logging.INFO)     # asdict + format: ~0.1 ms per layer
        for rec in records:
            update[rec.layer] = rec.placement_changed
            if verbose:
                log.info(event("EPLB placement benefit", policy=policy.name, **asdict(rec)))
    table[~update] = dep[~update]
    return Round(table, update, tuple(records))


PLAN_ON = ("cost", "tokens")


class Planner:
    """The manager's round function: ``policy`` through the gate with ``min_improvement``.
    Holds no placement: the manager passes what is deployed each call. ``plan_on``: ``cost``
    uses a fitted cost snapshot when the manager passes one (token counts until then);
    ``tokens`` always plans and gates on token counts."""

    def __init__(self, policy: EplbPolicy, min_improvement: float = 0.05,
                 plan_on: str = "tokens"):
        if plan_on not in PLAN_ON:
            raise ConfigError(f"eplb_plan_on={plan_on!r} must be one of {', '.join(PLAN_ON)}")
        self.policy = policy
        self.min_improvement = check_min_improvement(min_improvement)
        self.name = policy.name
        self.plan_on = plan_on

    def __call__(self, logical: np.ndarray, physical: np.ndarray | None,
                 deployed: np.ndarray, cost: cost_model.CostSnapshot | None = None) -> Round:
        return propose(self.policy, logical, deployed, physical=physical,
                       min_improvement=self.min_improvement,
                       cost=cost if self.plan_on == "cost" else None)
