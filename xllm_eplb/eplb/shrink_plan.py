"""Elastic shrink re-plan (``--elastic_ep`` with ``--elastic_restart=false``, issue #23 item 6):
the deployed placement after rank ``dead`` of ``D`` left for good, on ``D-1`` compact ranks.

Pure planning, no I/O. For each MoE layer:

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
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from xllm_eplb.config import survivors_hold_all
from xllm_eplb.eplb.placement import replica_counts


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
    plan = ShrinkPlan(np.empty((L, (ep_size - 1) * S), dtype=np.int64), survivors)
    spread = [0] * (ep_size - 1)
    for ml in range(L):
        w = (np.ones(num_experts) if load is None
             else np.asarray(load[ml], dtype=np.float64).reshape(num_experts))
        plan.kept += _layer(ml, rows[ml], num_experts, w, spread, plan.reloads)
        plan.table[ml] = rows[ml].reshape(-1)
    return plan


def _layer(ml: int, rows: np.ndarray, num_experts: int, w: np.ndarray, spread: list[int],
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
