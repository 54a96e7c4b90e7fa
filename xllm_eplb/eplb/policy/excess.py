"""Excess search: bring every layer under a target peak with as few moved slots as possible
(used by `incremental`). Vectorised over layers.

Objective per layer: the *excess* ``X = sum_d max(0, R_d - T)`` (rank loads ``R`` [D] with an
even split of each expert over its replicas, target ``T``). A layer is done when ``X = 0``
(peak <= T): the search fixes a layer down to the balance it needs, not the best one. Each
iteration takes, per layer, the move with the largest excess reduction per newly moved slot
among two kinds, both anchored on the most loaded rank ``m``:

- *swap*, a ``SWAP`` move (2 slots): one slot of ``m`` with one slot of a light partner rank (as
  ``localsearch.swap_search``);
- *rewrite*, a ``SET`` move (1 slot): a slot on rank ``q`` holding a replica of an expert ``x`` with ``c_x >= 2``
  is re-pointed to an expert ``y`` held by ``m``. Every holder of ``y`` drops by
  ``w_y / (c_y (c_y + 1))`` at once, every other holder of ``x`` rises by
  ``w_x / (c_x (c_x - 1))``, ``q`` swaps ``w_x / c_x`` for ``w_y / (c_y + 1)``.

A move must reduce the excess by more than ``min_gain`` per newly moved slot (slots moved back to
their deployed expert are cheap). The rewrite gain is evaluated per rank group (holders of ``y``,
holders of ``x``, the rewritten rank); a rank holding both ``x`` and ``y`` is counted twice,
which only affects the ranking, never validity.

NOTE: neither move puts a second replica of an expert on a rank (``has[d][e]`` is checked), so a
strict table stays strict; a rewrite never removes an expert's last replica (``c_x >= 2``).
"""

from __future__ import annotations

import numpy as np

from xllm_eplb.eplb.placement import SET, SWAP
from xllm_eplb.eplb.policy.localsearch import apply_swaps, presence, slot_values

#: denominator added to the moved-slot count of a move, so moves that undo earlier moves
#: (0 or fewer new slots) rank high but stay finite
FREE_MOVE = 0.25


#: 1 / (max(dmov, 0) + FREE_MOVE) for a swap's dmov in [-2, 2] (index dmov + 2)
_INV_DEN = (1.0 / (np.maximum(np.arange(-2, 3), 0) + FREE_MOVE)).astype(np.float32)


def _exc(x, t):
    return np.maximum(x - t, 0.0)


def _swap_candidates(st, act, m, part, t):
    """Best swap per active layer: (score [k], dmov [k], flat index into [K, S, S] [k]).

    NOTE: the [k, K, S, S] candidate arrays dominate a fresh plan's CPU time: the masks are
    combined on [k, K, S] first and the moved-slot count is built in int8, so each big array is
    touched as few times as possible."""
    table, v, r, has, base = st["table"], st["v"], st["r"], st["has"], st["base"]
    k = act.size
    kr = np.arange(k)
    a2, a3 = act[:, None], act[:, None, None]
    # float32 for the [k, K, S, S] candidate arrays: only the ranking depends on them
    f32 = np.float32
    vp, tp, rp = v[a2, part].astype(f32), table[a2, part], r[a2, part].astype(f32)
    vm, em, bm = v[act, m].astype(f32), table[act, m], base[act, m]   # [k, S]
    bp = base[a2, part]
    rm = r[act, m].astype(f32)
    t = t.astype(f32)
    # m is the most loaded rank and above target: its excess is rm - t
    delta = vm[:, None, :, None] - vp[:, :, None, :]                  # [k, K, Si, Sj]
    nm = (rm - t)[:, None, None, None] - delta
    np.maximum(nm, 0.0, out=nm)
    npp = (rp - t[:, None])[:, :, None, None] + delta
    np.maximum(npp, 0.0, out=npp)
    gain = ((rm - t)[:, None] + _exc(rp, t[:, None]))[:, :, None, None] - nm
    gain -= npp
    # a swap is out when em[i] is on the partner, tp[j] is on m, or the partner is m
    out_i = has[a3, part[:, :, None], em[:, None, :]] | (part == m[:, None])[:, :, None]
    out_j = has[a3, m[:, None, None], tp]                             # [k, K, Sj]
    bad = out_i[..., :, None] | out_j[..., None, :]
    bad |= delta <= 0
    bad |= gain <= 0
    # newly moved slots + 2, in [0, 4]: the lookup index of 1 / (max(dmov, 0) + FREE_MOVE)
    i8 = np.int8
    idx = (tp[:, :, None, :] != bm[:, None, :, None]).view(i8)
    idx += (em[:, None, :, None] != bp[:, :, None, :]).view(i8)
    idx += ((1 - (em != bm)).astype(i8)[:, None, :, None]
            + (1 - (tp != bp)).astype(i8)[:, :, None, :])
    score = gain
    score *= _INV_DEN[idx]
    np.copyto(score, -np.inf, where=bad)
    score = score.reshape(k, -1)
    best = np.argmax(score, axis=1)
    return score[kr, best], idx.reshape(k, -1)[kr, best].astype(np.int64) - 2, best


def _per_expert_sum(vals, flat, num_e):
    """vals [k, N] summed per expert id flat [k, N] -> [k, E]."""
    k = flat.shape[0]
    idx = (flat + (np.arange(k) * num_e)[:, None]).ravel()
    return np.bincount(idx, weights=vals.ravel(), minlength=k * num_e).reshape(k, num_e)


def _rewrite_candidates(st, act, top, t):
    """Best rewrite per active layer (``y`` among the experts of the ranks ``top`` [k, A]):
    (score [k], gain [k], dmov [k], flat slot q [k], expert y [k])."""
    table, w, c, r, has, base = st["table"], st["w"], st["c"], st["r"], st["has"], st["base"]
    k = act.size
    num_d, s = table.shape[1:]
    num_e = w.shape[1]
    kr = np.arange(k)
    a2 = act[:, None]
    none = (np.full(k, -np.inf), np.zeros(k), np.zeros(k, np.int64), np.zeros(k, np.int64),
            np.zeros(k, np.int64))
    flat = table[act].reshape(k, -1)                                  # [k, N]
    cf = c[a2, flat].astype(np.float64)
    multi = cf >= 2
    ra = r[act]
    tt = t[:, None]
    rs = np.repeat(ra, s, axis=1)                                     # rank load per slot
    # q candidates: replicas of multi-replica experts on ranks below the target
    mask = multi & (rs < tt)
    nq = int(mask.sum(axis=1).max(initial=0))
    if nq == 0:
        return none
    wf = w[a2, flat]
    ex = _exc(rs, tt)
    # per slot: the rise of its rank if its expert lost a replica / the drop if it gained one
    dxf = np.where(multi, wf / np.maximum(cf - 1, 1) - wf / cf, 0.0)
    rise = _exc(rs + dxf, tt) - ex
    drop = ex - _exc(rs + (wf / (cf + 1) - wf / cf), tt)
    rise_e = _per_expert_sum(rise, flat, num_e)                       # [k, E]
    drop_e = _per_expert_sum(drop, flat, num_e)
    qi = np.argsort(~mask, axis=1, kind="stable")[:, :nq]             # [k, Q] slots with c>=2
    qok = np.take_along_axis(mask, qi, 1)
    xq = np.take_along_axis(flat, qi, 1)
    dq = qi // s
    bq = np.take_along_axis(base[act].reshape(k, -1), qi, 1)
    gx = rise_e[kr[:, None], xq] - np.take_along_axis(rise, qi, 1)   # cost, q's rank excluded
    rd = ra[kr[:, None], dq]                                          # [k, Q]
    ys = table[a2, top].reshape(k, -1)                                # [k, Y] experts on top
    cy = c[a2, ys].astype(np.float64)
    wy = w[a2, ys]
    gy = drop_e[kr[:, None], ys]                                      # [k, Y]
    wxq = w[a2, xq] / c[a2, xq]
    nd = (wy / (cy + 1))[:, :, None] - wxq[:, None, :]                # [k, Y, Q] change on q
    gd = _exc(rd, tt)[:, None, :] - _exc(rd[:, None, :] + nd, t[:, None, None])
    gain = gy[:, :, None] - gx[:, None, :] + gd
    ok = qok[:, None, :] & (cy < num_d)[:, :, None] & (ys[:, :, None] != xq[:, None, :])
    ok &= ~has[act[:, None, None], dq[:, None, :], ys[:, :, None]]
    ok &= gain > 0
    dmov = (ys[:, :, None] != bq[:, None, :]).astype(np.int64) - (xq != bq)[:, None, :]
    score = np.where(ok, gain / (np.maximum(dmov, 0) + FREE_MOVE), -np.inf).reshape(k, -1)
    best = np.argmax(score, axis=1)
    iy, iq = np.unravel_index(best, (ys.shape[1], nq))
    return (score[kr, best], gain.reshape(k, -1)[kr, best], dmov.reshape(k, -1)[kr, best],
            qi[kr, iq], ys[kr, iy])


def excess_search(table, w, counts, target, max_iters: int, base=None, start=None,
                  min_gain=None, partners: int = 0, anchors: int = 1,
                  rewrites: bool = True):
    """Reduce every layer's excess over ``target`` in place on ``table`` [n, D, S].

    w float64 [n, E]; counts int64 [n, E] (consistent with table, updated in place by
    rewrites); target float [n]; start float [n] (only layers whose peak exceeds it are
    searched; default: target); base [n, D, S] the deployed table (default: the input);
    min_gain float [n] the least excess reduction per moved slot a move must bring (default 0).
    ``rewrites`` enables the single-slot rewrite moves (replica counts change).
    Returns (peaks [n], moves): moves[i] lists ``(kind, x, y, peak_after, moved_after)``,
    kind ``SWAP`` (flat slots x and y) or ``SET`` (flat slot x to expert y): the toolkit's move
    vocabulary (:func:`~xllm_eplb.eplb.placement.apply_moves`)."""
    n, num_d, s = table.shape
    num_e = w.shape[1]
    base = table.copy() if base is None else np.asarray(base)
    start = target if start is None else start
    min_gain = np.zeros(n) if min_gain is None else np.asarray(min_gain, dtype=np.float64)
    v = slot_values(table, w, counts)
    st = dict(table=table, w=w, c=counts, v=v, r=v.sum(axis=2), has=presence(table, num_e),
              base=base)
    moved = (table != base).sum(axis=(1, 2))
    log: list[tuple] = []                 # per iteration: (kind, layers, x, y, peaks, moved)
    act = np.nonzero(st["r"].max(axis=1) > start)[0]
    k_part = min(partners or max(8, num_d // 4), num_d)
    for _ in range(max_iters):
        if act.size == 0:
            break
        ra = st["r"][act]
        t = target[act]
        m = np.argmax(ra, axis=1)
        part = np.argpartition(ra, k_part - 1, axis=1)[:, :k_part] if k_part < num_d else \
            np.broadcast_to(np.arange(num_d), ra.shape)
        s_sc, s_mv, s_best = _swap_candidates(st, act, m, part, t)
        if rewrites:
            top = m[:, None] if anchors <= 1 else \
                np.argsort(-ra, axis=1, kind="stable")[:, :anchors]
            r_sc, _, r_mv, r_q, r_y = _rewrite_candidates(st, act, top, t)
        else:
            r_sc = np.full(act.size, -np.inf)
            r_mv = r_q = r_y = np.zeros(act.size, np.int64)
        floor = min_gain[act] / (1 + FREE_MOVE)
        use_r = r_sc >= s_sc
        best = np.where(use_r, r_sc, s_sc)
        acc = np.isfinite(best) & (best > floor)
        if not acc.any():
            break
        sw = np.nonzero(acc & ~use_r)[0]
        if sw.size:
            kk, i, j = np.unravel_index(s_best[sw], (part.shape[1], s, s))
            _apply_swaps(st, act[sw], m[sw], part[sw, kk], i, j, s_mv[sw], moved, log)

        rw = np.nonzero(acc & use_r)[0]
        if rw.size:
            _apply_rewrites(st, act[rw], r_q[rw], r_y[rw], r_mv[rw], moved, log)
        keep = acc.copy()
        keep[acc] = st["r"][act[acc]].max(axis=1) > target[act[acc]]
        act = act[keep]
    return st["r"].max(axis=1), _moves_per_layer(log, n)


def _moves_per_layer(log, n: int) -> list[list]:
    """Per-iteration move arrays -> one ``[(kind, x, y, peak, moved), ...]`` list per layer."""
    moves: list[list] = [[] for _ in range(n)]
    if not log:
        return moves
    cols = [np.concatenate([np.broadcast_to(np.int64(e[0]), e[1].shape) for e in log])]
    cols += [np.concatenate([e[k] for e in log]) for k in range(1, 6)]
    kind, lay, x, y, pk, mv = (c.tolist() for c in cols)
    for t in range(len(lay)):                 # iteration order is the move order per layer
        moves[lay[t]].append((kind[t], x[t], y[t], pk[t], mv[t]))
    return moves


def _apply_swaps(st, lay, dm, dp, i, j, dmov, moved, moves):
    table, v, r, has = st["table"], st["v"], st["r"], st["has"]
    s = table.shape[2]
    moved[lay] += dmov
    apply_swaps(table, v, r, has, lay, dm, dp, i, j)
    moves.append((SWAP, lay, dm * s + i, dp * s + j, r[lay].max(axis=1), moved[lay]))


def _apply_rewrites(st, lay, q, y, dmov, moved, moves):
    table, w, c, has = st["table"], st["w"], st["c"], st["has"]
    s = table.shape[2]
    moved[lay] += dmov
    d, sl = q // s, q % s
    x = table[lay, d, sl]
    table[lay, d, sl] = y
    c[lay, x] -= 1
    c[lay, y] += 1
    has[lay, d, x] = False
    has[lay, d, y] = True
    st["v"][lay] = slot_values(table[lay], w[lay], c[lay])
    st["r"][lay] = st["v"][lay].sum(axis=2)
    moves.append((SET, lay, q, y, st["r"][lay].max(axis=1), moved[lay]))
