"""Layer-vectorised building blocks shared by the policies.

Every function works on all layers at once: loads ``[L, E]``, slot tables ``[L, D*S]``
(rank-major, slot ``s`` on rank ``s // S``). A row that cannot be planned is reported through an
``ok [L]`` mask, never by raising.

NOTE: every packer here enforces one replica of a logical expert per rank (``has[d][e]``).
"""

from __future__ import annotations

import numpy as np

# Integer loads below this compare exactly in float64: for ratios a/b, c/d with b, d <= 2^15
# two distinct values differ by >= 1/(a*d) relatively, far above float64 rounding.
EXACT_FLOAT_LIMIT = 2 ** 36


def fast_path_ok(loads: np.ndarray) -> bool:
    """True when float64 arithmetic reproduces the exact integer comparisons of xLLM."""
    a = np.asarray(loads)
    if a.dtype.kind == "f":
        return True
    return a.size == 0 or int(np.abs(a).max()) < EXACT_FLOAT_LIMIT


def as_float(loads: np.ndarray) -> np.ndarray:
    return np.asarray(loads, dtype=np.float64)


def select_replicas_max_drop(loads: np.ndarray, extra: int, cap: int):
    """Add ``extra`` replicas, each to the expert with the largest drop of its per-replica load
    ``L/(c(c+1))`` among experts with fewer than ``cap`` replicas (ties: lowest id).

    loads float64 [L, E]. Returns (counts int64 [L, E], added int64 [L, extra], ok bool [L])."""
    w = as_float(loads)
    layers, num_e = w.shape
    rc = np.ones((layers, num_e), dtype=np.int64)
    added = np.zeros((layers, extra), dtype=np.int64)
    ok = np.ones(layers, dtype=bool)
    rows = np.arange(layers)
    for t in range(extra):
        key = w / (rc * (rc + 1))
        key[rc >= cap] = -np.inf
        best = np.argmax(key, axis=1)
        ok &= np.isfinite(key[rows, best])
        rc[rows, best] += 1
        added[:, t] = best
    return rc, added, ok


def select_replicas_max_load(loads: np.ndarray, extra: int, cap: int) -> np.ndarray:
    """Min-max replica counts: repeatedly give a replica to the expert with the largest
    per-replica load ``L/c`` (ties: lowest id), at most ``cap`` each. This minimises
    ``max_e L_e / c_e``. float [L, E] -> int64 [L, E]."""
    w = as_float(loads)
    layers, num_e = w.shape
    rc = np.ones((layers, num_e), dtype=np.int64)
    rows = np.arange(layers)
    for _ in range(extra):
        key = w / rc
        key[rc >= cap] = -np.inf
        best = np.argmax(key, axis=1)
        rc[rows, best] += 1
    return rc


def pack_sequences(items: np.ndarray, eff: np.ndarray, ep_size: int, slots: int,
                   num_logical: int):
    """Place items in the given order, each on the least-loaded rank (ties: lowest rank) that has
    a free slot and does not hold the item's expert yet, in that rank's first free slot.

    items int64 [L, N] expert ids in placement order; eff [L, N] the load each item adds
    (int64 or float64). Returns (table int64 [L, D*S] with -1 where unfilled, ok bool [L])."""
    layers, n = items.shape
    rows = np.arange(layers)
    dev = np.zeros((layers, ep_size), dtype=eff.dtype)
    big = np.inf if eff.dtype.kind == "f" else np.iinfo(np.int64).max
    free = np.full((layers, ep_size), slots, dtype=np.int64)
    has = np.zeros((layers, ep_size, num_logical), dtype=bool)
    out = np.full((layers, ep_size * slots), -1, dtype=np.int64)
    ok = np.ones(layers, dtype=bool)
    for t in range(n):
        e = items[:, t]
        cand = (free > 0) & ~has[rows, :, e]
        ok &= cand.any(axis=1)
        d = np.argmin(np.where(cand, dev, big), axis=1)
        r, d, e = rows[ok], d[ok], e[ok]
        out[r, d * slots + (slots - free[r, d])] = e
        dev[r, d] += eff[ok, t]
        free[r, d] -= 1
        has[r, d, e] = True
    return out, ok


def lpt_pack(loads: np.ndarray, counts: np.ndarray, ep_size: int, slots: int):
    """The replicas of ``counts`` [k, E] (rows summing to ``ep_size * slots``), heaviest
    per-replica load first, each on the least-loaded rank with a free slot that does not hold its
    expert (:func:`pack_sequences`); the cyclic fallback where that dead-ends.
    loads float [k, E] -> (tables int64 [k, D*S], ok bool [k])."""
    w = as_float(loads)
    k, num_e = w.shape
    items = np.stack([np.repeat(np.arange(num_e), counts[i]) for i in range(k)])
    per = np.take_along_axis(w, items, 1) / np.take_along_axis(counts, items, 1)
    order = np.argsort(-per, axis=1, kind="stable")
    table, ok = pack_sequences(np.take_along_axis(items, order, 1),
                               np.take_along_axis(per, order, 1), ep_size, slots, num_e)
    for i in np.nonzero(~ok)[0]:
        fb = cyclic_fallback(w[i], counts[i], ep_size, slots)
        if fb is not None:
            table[i], ok[i] = fb, True
    return table, ok


def cyclic_fallback(load: np.ndarray, rc: np.ndarray, ep_size: int, slots: int):
    """xLLM's safe fallback for one layer: experts by L/c descending (ties: id), their replicas
    dealt round-robin over ranks. Since c <= D the replicas of one expert land on distinct
    ranks. Returns int64 [D*S] or None when the counts do not fill the table exactly."""
    if int(rc.sum()) != ep_size * slots or int(rc.max()) > ep_size:
        return None
    key = as_float(load) / np.maximum(rc, 1)
    order = [e for e in np.lexsort((np.arange(rc.size), -key)) if rc[e] > 0]
    out = np.full((ep_size, slots), -1, dtype=np.int64)
    fill = np.zeros(ep_size, dtype=np.int64)
    p = 0
    for e in order:
        for _ in range(int(rc[e])):
            d = p % ep_size
            if fill[d] >= slots:
                return None
            out[d, fill[d]] = e
            fill[d] += 1
            p += 1
    return out.reshape(-1)


def stabilize_slots(cand: np.ndarray, prev: np.ndarray, ep_size: int) -> np.ndarray:
    """Permute slots within each rank so experts that stay on a rank keep their old slot; the
    other experts fill the vacated slots in ascending order (xLLM ``stabilize_local_slots``).

    cand, prev int64 [L, D*S]; cand must hold each expert at most once per rank."""
    layers, nslots = cand.shape
    s = nslots // ep_size
    c = cand.reshape(layers, ep_size, s)
    p = np.asarray(prev, dtype=np.int64).reshape(layers, ep_size, s)
    match = p[..., :, None] == c[..., None, :]                 # [L, D, dst, src]
    # each src -> its first dst (prev may repeat an expert on a rank: xLLM's initial layout)
    first = match & (np.arange(s)[:, None] == np.argmax(match, axis=2)[..., None, :])
    filled = first.any(axis=3)
    used = first.any(axis=2)
    out = np.where(filled, np.take_along_axis(c, np.argmax(first, axis=3), axis=2), -1)
    dst = np.argsort(filled, axis=2, kind="stable")            # vacated dsts first, ascending
    src = np.argsort(used, axis=2, kind="stable")              # leftover srcs first, ascending
    vals = np.take_along_axis(c, src, axis=2)
    k = np.arange(s) < (~filled).sum(axis=2, keepdims=True)
    li, di, _ = np.nonzero(k)
    out[li, di, dst[k]] = vals[k]
    return out.reshape(layers, nslots)

