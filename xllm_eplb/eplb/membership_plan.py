"""EPLB across a membership change (``--elastic_ep``): the deployed placement after a shrink
(:func:`plan_shrink`) or a join (:func:`plan_join`), and the EPLB manager of the new world
(:func:`resized_manager`). Pure planning, no I/O (the manager's thread starts on construction).

**Shrink** (``--elastic_restart=false``, issue #23 item 6): the deployed placement after rank
``dead`` of ``D`` left for good, on ``D-1`` compact ranks. For each MoE layer:

- the survivors keep their rows in compact order (old rank ``r`` -> ``r - (r > dead)``): every
  survivor keeps its local slot ids and their weights, so a surviving replica is used first and
  costs nothing;
- an expert whose only replica was on the dead rank (*orphan*) takes one slot from an expert
  that still has two or more replicas (a *donor*), on a rank that does not already hold the
  orphan. Preferred donor slots, in order: a same-rank duplicate (a rank holding one expert twice,
  e.g. xLLM's initial layout: the duplicate serves nothing); the coldest extra replica (lowest
  ``load[e] / replicas(e)``); among equals the rank with the fewest reloads so far (the checkpoint
  reads spread over the survivors), then the lowest slot. That survivor reads the orphan's
  weights from the checkpoint.

Only the orphans' slots change: the number of changed slots is the number of orphans, the least
any shrink can do. Every logical expert keeps >= 1 replica; the orphan lands on a rank without it,
so no rank gains a second replica. The rule ``(D-1) x S >= E`` (``config.survivors_hold_all``)
guarantees the slots; :class:`ShrinkError` names it when it does not hold.

**Join** (issue #23 item 8): the placement after a replacement worker joins ``D`` serving ranks
as compact rank ``D``; the inverse of a shrink. The serving ranks keep their rows (their slot
ids and weights stay: no weight moves on them); the joiner's row is appended. For each MoE layer
the joiner's row is:

- the distinct experts of ``prefer`` (what the joiner already loaded while the others served:
  the initial layout of its worker, read from the checkpoint in the background), kept in their
  slots: they cost nothing at the switch;
- every other slot (a duplicate of ``prefer``, or no ``prefer``) gets the hottest expert not yet
  on the row: highest ``load[e] / replicas(e)`` (the most load per replica), then the fewest
  replicas, then the lowest id; each pick counts as a replica for the next one.

Every expert already has >= 1 replica on the serving ranks, so every layer still covers every
expert; the joiner's row never holds one expert twice (``slots_per_rank <= num_experts``).
``reloads`` lists the slots the joiner reads from the checkpoint at the switch (those not
already holding their expert from ``prefer``).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

import numpy as np

from xllm_eplb.config import Config, layout_error, survivors_hold_all
from xllm_eplb.eplb.placement import replica_counts
from xllm_eplb.errors import ConfigError
from xllm_eplb.obs.logs import event

log = logging.getLogger(__name__)


# --- shrink -----------------------------------------------------------------------------------

class ShrinkError(ValueError):
    """The survivors cannot hold every expert (names the rule and the numbers)."""


@dataclass
class ShrinkPlan:
    """``table``: int64 ``[L, (D-1)*S]``; ``reloads``: ``(layer, new_rank, slot, expert)`` read
    from the checkpoint; ``kept``: slots whose weights stayed (surviving replicas)."""

    table: np.ndarray
    survivors: list[int]          # old rank of each new (compact) rank
    reloads: list[tuple[int, int, int, int]] = field(default_factory=list)
    kept: int = 0

    def reloads_per_rank(self) -> list[int]:
        n = [0] * len(self.survivors)
        for _, r, _, _ in self.reloads:
            n[r] += 1
        return n


def check_rule(ep_size: int, slots: int, num_experts: int) -> None:
    """:class:`ShrinkError` unless ``(ep_size-1) x slots >= num_experts`` (the N-1 rule,
    ``config.survivors_hold_all``)."""
    if not survivors_hold_all(ep_size, slots, num_experts):
        raise ShrinkError(
            f"cannot shrink ep_size {ep_size} -> {ep_size - 1}: the survivors' "
            f"{max(0, ep_size - 1)} x {slots} slots cannot hold num_experts={num_experts} "
            "(rule (ep_size-1) x slots_per_rank >= num_experts; raise --redundant_experts_num)")


def plan_shrink(table: np.ndarray, dead: int, ep_size: int, num_experts: int,
                load: np.ndarray | None = None) -> ShrinkPlan:
    """The placement after rank ``dead`` left (see the module docstring). ``table``: int64
    ``[L, D*S]``; ``load``: optional ``[L, E]`` recent logical loads (coldest donor first;
    None: every expert alike)."""
    t = np.asarray(table, dtype=np.int64)
    L, n = t.shape
    if n % ep_size or not 0 <= dead < ep_size:
        raise ShrinkError(f"table of {n} slots, ep_size={ep_size}, dead rank {dead}")
    S = n // ep_size
    check_rule(ep_size, S, num_experts)
    survivors = [r for r in range(ep_size) if r != dead]
    rows = t.reshape(L, ep_size, S)[:, survivors, :].copy()        # [L, D-1, S]
    reloads: list[tuple[int, int, int, int]] = []
    spread, kept = [0] * (ep_size - 1), 0
    for ml in range(L):
        w = (np.ones(num_experts) if load is None
             else np.asarray(load[ml], dtype=np.float64).reshape(num_experts))
        kept += _shrink_layer(ml, rows[ml], num_experts, w, spread, reloads)
    return ShrinkPlan(rows.reshape(L, -1), survivors, reloads, kept)


def _shrink_layer(ml: int, rows: np.ndarray, num_experts: int, w: np.ndarray, spread: list[int],
           reloads: list) -> int:
    """Fill the orphans of one layer in place (``rows`` [D-1, S]); returns the kept slots."""
    count = replica_counts(rows.reshape(-1), num_experts)
    orphans = [int(e) for e in np.nonzero(count == 0)[0]]
    # the hottest orphan picks first (it gets the coldest donor)
    orphans.sort(key=lambda e: (-w[e], e))
    for e in orphans:
        best, key = None, None
        for r in range(rows.shape[0]):
            if (rows[r] == e).any():
                continue
            for s in range(rows.shape[1]):
                d = int(rows[r, s])
                if count[d] < 2:
                    continue
                # a same-rank duplicate serves nothing: only the spread orders those
                k = ((0, 0.0, spread[r], r, s) if int((rows[r] == d).sum()) > 1
                     else (1, w[d] / count[d], spread[r], r, s))
                if key is None or k < key:
                    best, key = (r, s), k
        if best is None:     # unreachable under the rule: every rank holds e or only singles
            raise ShrinkError(f"layer {ml}: no slot for expert {e} "
                              "(rule (ep_size-1) x slots_per_rank >= num_experts)")
        r, s = best
        count[rows[r, s]] -= 1
        rows[r, s] = e
        count[e] = 1
        spread[r] += 1
        reloads.append((ml, r, s, e))
    return rows.size - len(orphans)


# --- join -------------------------------------------------------------------------------------

class JoinError(ValueError):
    """The joiner's row cannot be planned (names the numbers)."""


@dataclass
class JoinPlan:
    """``table``: int64 ``[L, (D+1)*S]`` (the serving ranks' rows unchanged, the joiner's
    last); ``row``: the joiner's ``[L, S]``; ``reloads``: ``(layer, slot, expert)`` whose
    expert differs from ``prefer`` (read at the switch)."""

    table: np.ndarray
    row: np.ndarray
    reloads: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def kept(self) -> int:
        return self.row.size - len(self.reloads)


def plan_join(table: np.ndarray, ep_size: int, num_experts: int,
              load: np.ndarray | None = None, prefer: np.ndarray | None = None) -> JoinPlan:
    """The placement after a joiner is appended to ``ep_size`` serving ranks (see the module
    docstring). ``table``: int64 ``[L, D*S]``; ``load``: optional ``[L, E]`` recent logical
    loads (None: every expert alike); ``prefer``: optional ``[L, S]`` the joiner holds now."""
    t = np.asarray(table, dtype=np.int64)
    if t.ndim != 2 or ep_size < 1 or t.shape[1] % ep_size:
        raise JoinError(f"table of shape {t.shape} does not split into ep_size={ep_size} ranks")
    L, S = t.shape[0], t.shape[1] // ep_size
    if S > num_experts:
        raise JoinError(f"slots_per_rank={S} > num_experts={num_experts}: the joiner's row "
                        "would hold an expert twice")
    if prefer is not None:
        prefer = np.asarray(prefer, dtype=np.int64)
        if prefer.shape != (L, S):
            raise JoinError(f"prefer of shape {prefer.shape}, expected [layers, slots]={(L, S)}")
    row = np.empty((L, S), dtype=np.int64)
    plan = JoinPlan(np.empty((L, (ep_size + 1) * S), dtype=np.int64), row)
    for ml in range(L):
        count = replica_counts(t[ml], num_experts).astype(np.float64)
        if (count == 0).any():
            raise JoinError(f"layer {ml}: expert {int(np.argmin(count))} has no replica on the "
                            "serving ranks")
        w = (np.ones(num_experts) if load is None
             else np.asarray(load[ml], dtype=np.float64).reshape(num_experts))
        row[ml] = _join_row(ml, prefer[ml] if prefer is not None else None, S, w, count,
                       plan.reloads)
        plan.table[ml, :ep_size * S] = t[ml]
        plan.table[ml, ep_size * S:] = row[ml]
    return plan


def _join_row(ml: int, prefer, S: int, w: np.ndarray, count: np.ndarray,
              reloads: list) -> np.ndarray:
    out = np.full(S, -1, dtype=np.int64)
    held: set[int] = set()
    if prefer is not None:
        for s, e in enumerate(prefer.tolist()):
            if 0 <= e < len(w) and e not in held:
                out[s] = e
                held.add(e)
                count[e] += 1
    for s in range(S):
        if out[s] >= 0:
            continue
        free = [e for e in range(len(w)) if e not in held]
        e = min(free, key=lambda x: (-w[x] / count[x], count[x], x))
        out[s] = e
        held.add(e)
        count[e] += 1
        reloads.append((ml, s, e))
    return out


# --- the manager of the new world ----------------------------------------------------------------

def resized_manager(cfg: Config, ep_size: int, table, old):
    """The manager of a world of ``ep_size`` ranks with ``table`` deployed (``old`` closed, its
    counters inherited; None when EPLB is off or cannot rebalance this layout). ``num_experts``
    need not divide by the ranks: the manager then takes the slots per rank as given and the
    policy plans that layout
    (``EplbPolicy(..., slots)``); a policy that cannot leaves the ranks serving the table
    without rebalancing (logged)."""
    if old is not None:
        old.close()
    if not cfg.eplb.enable_eplb:
        return None
    from xllm_eplb.eplb.manager import EplbManager

    E, S, D = cfg.model.num_experts, cfg.slots_per_rank, ep_size
    e = dataclasses.replace(cfg.eplb, ep_size=D, redundant_experts_num=max(0, S - E // D))
    try:
        planner = planner_for(e, E, S) if layout_error(E, D, S - E // D) else None
        mgr = EplbManager(e, cfg.num_moe_layers, E, runner="thread", initial=table,
                          expect_timings=True, slots=S, planner=planner)
    except (ConfigError, ValueError) as err:
        log.warning(event("EPLB elastic rebalancing off", ep_size=D, slots_per_rank=S,
                          num_experts=E, why=str(err)))
        return None
    if old is not None:
        mgr.inherit_counters(old)
    return mgr


def planner_for(e, num_experts: int, slots: int):
    """``--eplb_policy_kind`` with its options for ``e.ep_size`` ranks of ``slots`` slots, a
    layout the flag rules cannot express (E % ep_size != 0)."""
    from xllm_eplb.eplb.gate import Planner
    from xllm_eplb.eplb.policy import policy_from_config

    policy = policy_from_config(e, num_experts, slots=slots)
    return Planner(policy, e.eplb_min_peak_load_improvement, e.eplb_plan_on)
