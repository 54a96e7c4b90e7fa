"""Swap local search on slot tables, vectorised over layers (used by `incremental` and
`node_aware`).

A move swaps one slot of the most loaded rank ``m`` with one slot of a lightly loaded rank ``d``
(2 cross-rank copies). The best swap minimises ``max(R_m - delta, R_d + delta)`` plus the migration cost of
the slots it newly moves; it is taken only when that is below ``R_m`` (EasyBalance: benefit - cost). Replica
counts never change here.

NOTE: a swap never puts a second replica of an expert on a rank (``has[d][e]`` is checked for
both directions), so a strict table stays strict.
"""

from __future__ import annotations

import numpy as np

from xllm_eplb.eplb.placement import SWAP


def slot_values(table: np.ndarray, w: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Per-slot even-split load: table [n, D, S], w [n, E], counts [n, E] -> float64 [n, D, S]."""
    n = table.shape[0]
    flat = table.reshape(n, -1)
    v = np.take_along_axis(w, flat, 1) / np.take_along_axis(counts, flat, 1)
    return v.reshape(table.shape)


def presence(table: np.ndarray, num_logical: int) -> np.ndarray:
    """bool [n, D, E]: rank d holds expert e."""
    n, d, s = table.shape
    has = np.zeros((n, d, num_logical), dtype=bool)
    ni, di, _ = np.indices(table.shape).reshape(3, -1)
    has[ni, di, table.reshape(-1)] = True
    return has


def apply_swaps(table, v, r, has, lay, dm, dp, i, j) -> None:
    """Swap slot ``i`` of rank ``dm`` with slot ``j`` of rank ``dp`` in layers ``lay`` (int arrays
    [k], one entry per layer, layers distinct), in place on ``table`` [n, D, S], the slot values
    ``v`` [n, D, S], the rank loads ``r`` [n, D] and the presence ``has`` [n, D, E]."""
    ea, eb = table[lay, dm, i], table[lay, dp, j]
    va, vb = v[lay, dm, i], v[lay, dp, j]
    table[lay, dm, i], table[lay, dp, j] = eb, ea
    v[lay, dm, i], v[lay, dp, j] = vb, va
    r[lay, dm] += vb - va
    r[lay, dp] += va - vb
    has[lay, dm, ea] = False
    has[lay, dp, eb] = False
    has[lay, dm, eb] = True
    has[lay, dp, ea] = True


def swap_search(table, w, counts, target, slot_cost, max_iters: int, partners: int = 0,
                base: np.ndarray | None = None, groups: np.ndarray | None = None,
                must: np.ndarray | None = None):
    """Lower the peak of every layer by swaps, in place on ``table`` [n, D, S].

    w float64 [n, E]; counts int64 [n, E] (consistent with table); target, slot_cost float [n];
    base [n, D, S] (default: the input table). A layer stops once its peak <= target or no move
    pays. While a layer's peak is above ``must`` [n] the slot cost is only a tie-breaker: reaching
    ``must`` is worth the moves. ``groups`` int [D] restricts swaps to ranks of one group (node).
    Returns (peaks [n], moves): moves[x] lists ``(kind, x, y, peak_after, moved_after)`` with
    kind ``SWAP`` (slots x and y; the only kind produced here) of the toolkit's move vocabulary
    (:mod:`xllm_eplb.eplb.placement`)."""
    n, num_d, s = table.shape
    num_e = w.shape[1]
    base = table.copy() if base is None else np.asarray(base)
    moved = (table != base).sum(axis=(1, 2))
    v = slot_values(table, w, counts)
    r = v.sum(axis=2)
    has = presence(table, num_e)
    moves: list[list] = [[] for _ in range(n)]
    act = np.nonzero(r.max(axis=1) > target)[0]
    k_part = min(partners or max(8, num_d // 4), num_d)   # candidate partners: lightest ranks
    for _ in range(max_iters):
        if act.size == 0:
            break
        k = act.size
        kr = np.arange(k)
        ra = r[act]
        m = np.argmax(ra, axis=1)
        rm = ra[kr, m]
        # above `must` any gain is taken: the slot cost only breaks ties
        cost = slot_cost[act] if must is None else \
            np.where(rm > must[act], 1e-6, 1.0) * slot_cost[act]
        if groups is None:
            part = np.argpartition(ra, k_part - 1, axis=1)[:, :k_part] if k_part < num_d else \
                np.broadcast_to(np.arange(num_d), ra.shape)
        else:
            same = groups[None, :] == groups[m][:, None]
            part = np.argsort(np.where(same, ra, np.inf), axis=1, kind="stable")[:, :k_part]
        a2, a3 = act[:, None], act[:, None, None]
        vp, tp, rp = v[a2, part], table[a2, part], r[a2, part]           # [k, K, S], [k, K]
        vm, em, bm = v[act, m], table[act, m], base[act, m]               # [k, S]
        bp = base[a2, part]
        delta = vm[:, None, :, None] - vp[:, :, None, :]                  # [k, K, Si, Sj]
        newpair = np.maximum(rm[:, None, None, None] - delta, rp[:, :, None, None] + delta)
        ok = newpair < rm[:, None, None, None] * (1 - 1e-12)
        ok &= ~has[a3, part[:, :, None], em[:, None, :]][..., :, None]  # em[i] not on partner
        ok &= ~has[a3, m[:, None, None], tp][..., None, :]              # tp[j] not on m
        ok &= (part != m[:, None])[..., None, None]
        if groups is not None:
            ok &= (groups[part] == groups[m][:, None])[..., None, None]
        dmov = ((tp[:, :, None, :] != bm[:, None, :, None]).astype(np.int64)
                - (em != bm)[:, None, :, None]
                + (em[:, None, :, None] != bp[:, :, None, :])
                - (tp != bp)[:, :, None, :])
        score = np.where(ok, newpair + cost[:, None, None, None] * dmov, np.inf).reshape(k, -1)
        best = np.argmin(score, axis=1)
        bs = score[kr, best]
        acc = np.isfinite(bs) & (bs < rm * (1 - 1e-12))
        if not acc.any():
            break
        x = np.nonzero(acc)[0]
        if x.size:
            kk, i, j = np.unravel_index(best[x], (k_part, s, s))
            lay, dm, dp = act[x], m[x], part[x, kk]
            moved[lay] += dmov[x, kk, i, j]
            apply_swaps(table, v, r, has, lay, dm, dp, i, j)
            pk = r[lay].max(axis=1)
            for t in range(lay.size):
                moves[lay[t]].append((SWAP, int(dm[t] * s + i[t]), int(dp[t] * s + j[t]),
                                      float(pk[t]), int(moved[lay[t]])))
        keep = acc.copy()
        keep[acc] = r[act[acc]].max(axis=1) > target[act[acc]]
        act = act[keep]
    return r.max(axis=1), moves

