"""Elastic rejoin re-plan (``--elastic_ep``, issue #23 item 8): the placement after a replacement
worker joins ``D`` serving ranks as compact rank ``D``; the inverse of ``shrink_plan.py``.

Pure planning, no I/O. The serving ranks keep their rows (their slot ids and weights stay: no
weight moves on them); the joiner's row is appended. For each MoE layer the joiner's row is:

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

from dataclasses import dataclass, field

import numpy as np

from xllm_eplb.eplb.placement import replica_counts


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
        row[ml] = _row(ml, prefer[ml] if prefer is not None else None, S, w, count,
                       plan.reloads)
        plan.table[ml, :ep_size * S] = t[ml]
        plan.table[ml, ep_size * S:] = row[ml]
    return plan


def _row(ml: int, prefer, S: int, w: np.ndarray, count: np.ndarray, reloads: list) -> np.ndarray:
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
