"""Expert capacity and load-aware fallback of one MoE layer and step (pure numpy, integer).

Inputs: ``counts [D, E]`` int64, the routed rows (top-k occurrences) each source rank sends to
each logical expert this step (the count exchange of ``model/replica_dispatch.py``).

- :func:`static_capacity`: ``ceil(factor * tokens * top_k / E)`` for every expert, with
  ``tokens * top_k`` = the step's routed rows over all ranks.
- :func:`dynamic_capacity`: the seed's conserved pool: ``E * base`` rows in total, each expert at
  least ``base // 2``, the rest shared in proportion to this step's load (largest remainder, ties
  to the lowest expert id); the total is exactly ``E * base``.
- :func:`keep_quota`: how many of its rows of ``e`` source ``r`` keeps: sources line up in rank
  order and the first ``cap[e]`` rows of ``e`` are kept (``min(c[r,e], max(0, cap[e] -
  sum(c[:r,e])))``).
- :func:`room_quota`: the room left after the kept rows, cut over the sources' overflow (sources
  in rank order, experts in id order): what each source may re-route to each expert; a source's
  re-routes never exceed an expert's capacity summed over all sources.
- :func:`fallback`: one source's overflow rows in (token, k) order: the token's next choice if it
  has room, else the least-loaded expert with room that the token does not already use, else
  dropped.

NOTE (cross-rank rule): capacities and quotas are functions of the exchanged ``counts`` and
config only, with integer arithmetic (the one float, ``factor * rows / E``, is the same IEEE
expression on every rank), so every rank computes identical values with no further message.
"""

from __future__ import annotations

import math

import numpy as np

MODES = ("none", "static", "dynamic")


def base_capacity(rows: int, num_experts: int, factor: float) -> int:
    """``ceil(factor * rows / E)``: rows = the step's routed rows (tokens x top_k), all ranks."""
    if factor <= 0:
        raise ValueError(f"moe_capacity_factor={factor} must be > 0")
    return int(math.ceil(float(factor) * int(rows) / int(num_experts)))


def static_capacity(loads: np.ndarray, factor: float) -> np.ndarray:
    """Per-expert capacity under ``static``: int64 [E], all equal to :func:`base_capacity` of
    the step's rows ``loads.sum()`` (``loads`` [E] = counts summed over sources)."""
    e = np.asarray(loads, dtype=np.int64)
    return np.full(e.size, base_capacity(int(e.sum()), e.size, factor), dtype=np.int64)


def dynamic_capacity(loads: np.ndarray, factor: float) -> np.ndarray:
    """Per-expert capacity under ``dynamic``: int64 [E] summing to exactly ``E * base``, each
    >= ``base // 2``, the rest in proportion to ``loads`` [E] (largest remainder; ties: lowest
    id; no load: evenly, the remainder to the lowest ids)."""
    e = np.asarray(loads, dtype=np.int64)
    n = e.size
    base = base_capacity(int(e.sum()), n, factor)
    floor = base // 2
    rest = n * base - n * floor
    total = int(e.sum())
    weights = e if total > 0 else np.ones(n, dtype=np.int64)
    wsum = int(weights.sum())
    share = (weights * rest) // wsum                         # exact integers
    left = rest - int(share.sum())
    rem = (weights * rest) % wsum
    order = np.lexsort((np.arange(n), -rem))                 # largest remainder, lowest id
    share[order[:left]] += 1
    return floor + share


def capacity(loads: np.ndarray, mode: str, factor: float) -> np.ndarray | None:
    """Per-expert capacity int64 [E] of ``mode`` (None for ``none``)."""
    if mode == "none":
        return None
    if mode == "static":
        return static_capacity(loads, factor)
    if mode == "dynamic":
        return dynamic_capacity(loads, factor)
    raise ValueError(f"moe_capacity_mode={mode!r} is not one of {', '.join(MODES)}")


def keep_quota(counts: np.ndarray, cap: np.ndarray) -> np.ndarray:
    """Rows of each expert each source keeps: int64 [D, E] (sources in rank order)."""
    c = np.asarray(counts, dtype=np.int64)
    before = np.cumsum(c, axis=0) - c
    return np.minimum(c, np.maximum(np.asarray(cap, dtype=np.int64)[None, :] - before, 0))


def room_quota(counts: np.ndarray, cap: np.ndarray) -> np.ndarray:
    """Rows each source may re-route to each expert: int64 [D, E]. The room ``cap - kept``
    (experts in id order) is cut over the sources' overflow (rank order), north-west corner:
    source ``r`` gets room for ``min(its overflow, room not taken by lower ranks)`` rows."""
    c = np.asarray(counts, dtype=np.int64)
    kept = keep_quota(c, cap)
    room = np.asarray(cap, dtype=np.int64) - kept.sum(axis=0)
    over = (c - kept).sum(axis=1)
    re = np.cumsum(room)
    rs = re - room
    se = np.cumsum(over)
    ss = se - over
    hi = np.minimum(se[:, None], re[None, :])
    lo = np.maximum(ss[:, None], rs[None, :])
    return np.maximum(hi - lo, 0)


def fallback(ids: np.ndarray, nxt: np.ndarray | None, keep: np.ndarray, room: np.ndarray,
             load: np.ndarray) -> tuple[np.ndarray, int, int]:
    """Apply capacity to one source's routed ids.

    ``ids`` [N, K] logical top-k ids (row-major = (token, k) order); ``nxt`` [N] each token's
    next choice (the best expert outside its top-k) or None (no fallback: overflow is dropped);
    ``keep`` [E] this source's kept rows per expert (:func:`keep_quota` row), ``room`` [E] its
    re-route room (:func:`room_quota` row), ``load`` [E] the step's kept rows per expert over all
    sources (the "least loaded" key). Returns (ids [N, K] with re-routed ids and -1 for dropped
    rows, rows re-routed, rows dropped). An expert's first ``keep[e]`` rows stay."""
    out = np.array(ids, dtype=np.int64, copy=True)
    flat = out.ravel()
    order = np.argsort(flat, kind="stable")
    rank_in_e = np.empty(flat.size, dtype=np.int64)
    per = np.bincount(flat, minlength=keep.size)
    first = np.concatenate(([0], np.cumsum(per)[:-1]))
    rank_in_e[order] = np.arange(flat.size) - np.repeat(first, per)
    over = np.nonzero(rank_in_e >= keep[flat])[0]
    if nxt is None or over.size == 0:
        flat[over] = -1
        return out, 0, int(over.size)
    room, load = room.astype(np.int64).copy(), load.astype(np.int64).copy()
    k = out.shape[1]
    rerouted = dropped = 0
    for i in over.tolist():
        tok = i // k
        own = out[tok]
        e2 = int(nxt[tok])
        if room[e2] <= 0 or e2 in own:
            free = np.nonzero(room > 0)[0]
            free = free[~np.isin(free, own)]
            e2 = int(free[np.argmin(load[free])]) if free.size else -1
        if e2 < 0:
            flat[i] = -1
            dropped += 1
            continue
        flat[i] = e2
        room[e2] -= 1
        load[e2] += 1
        rerouted += 1
    return out, rerouted, dropped
