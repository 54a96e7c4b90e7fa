"""Slot-table repair for `incremental`: free same-rank repeats, choose replica counts near the
deployed ones, drop surplus replicas and place missing ones. Vectorised over layers where it
matters; shapes ``[n, D, S]`` with -1 = free slot.

NOTE: every table produced here holds at most one replica of an expert per rank.
"""

from __future__ import annotations

import numpy as np

from xllm_eplb.eplb.placement import replica_counts


def dedup_ranks(table: np.ndarray) -> np.ndarray:
    """[n, D, S]: later same-rank repeats of an expert become -1 (free)."""
    s = table.shape[2]
    eq = table[..., :, None] == table[..., None, :]                  # [n, D, s, t]
    earlier = np.tril(np.ones((s, s), dtype=bool), k=-1)             # t < s
    out = table.copy()
    out[(eq & earlier).any(axis=3)] = -1
    return out


def adjust_counts(w: np.ndarray, c0: np.ndarray, free: np.ndarray, cap: int,
                  c_opt: np.ndarray, count_slack: float) -> np.ndarray:
    """Counts close to c0 whose max per-replica load is within ``count_slack`` of the min-max
    optimum. w [n, E], c0 [n, E] (may hold zeros only if free covers them), free [n]."""
    c = c0.copy()
    n = w.shape[0]
    rows = np.arange(n)
    c = np.maximum(c, 1)
    left = free - (c - c0).sum(axis=1)
    for _ in range(int(left.max(initial=0))):
        key = np.where(c >= cap, -np.inf, w / c)
        b = np.argmax(key, axis=1)
        go = left > 0
        c[rows[go], b[go]] += 1
        left -= go
    best = (w / c_opt).max(axis=1) * (1 + count_slack)
    for _ in range(w.shape[1]):
        per = w / c
        a = np.argmax(np.where(c >= cap, -np.inf, per), axis=1)
        hi = per[rows, a]
        loss = np.where(c >= 2, w / np.maximum(c - 1, 1), np.inf)
        loss[rows, a] = np.inf
        b = np.argmin(loss, axis=1)
        go = (hi > best) & (loss[rows, b] < hi)
        if not go.any():
            break
        c[rows[go], a[go]] += 1
        c[rows[go], b[go]] -= 1
    return c


def drop_surplus(w_row, t, c_row) -> None:
    """In place on t [D, S]: free the replicas beyond c_row, taken from the most loaded ranks."""
    present = t >= 0
    v = np.where(present, w_row[np.maximum(t, 0)] / c_row[np.maximum(t, 0)], 0.0)
    r = v.sum(axis=1)
    cur = replica_counts(t.reshape(-1), w_row.size)          # free slots (-1) not counted
    for e in np.nonzero(cur > c_row)[0]:
        dr, ds = np.nonzero(t == e)
        for k in np.argsort(-r[dr], kind="stable")[: cur[e] - c_row[e]]:
            t[dr[k], ds[k]] = -1
            r[dr[k]] -= w_row[e] / c_row[e]


def repair(w, t0, c):
    """Make every table hold exactly ``c`` replicas: drop surplus from the most loaded ranks,
    then put the missing replicas (largest per-replica load first) LPT-style into free slots:
    least-loaded rank with a free slot that does not hold the expert (ties: lowest rank).

    w float [n, E]; t0 int64 [n, D, S] (free = -1); c int64 [n, E]. Vectorised over layers.
    Returns (tables [n, D, S], ok [n])."""
    t = t0.copy()
    n, num_d, s = t.shape
    num_e = w.shape[1]
    for i in range(n):
        if (replica_counts(t[i].reshape(-1), num_e) > c[i]).any():
            drop_surplus(w[i], t[i], c[i])
    flat = t.reshape(n, -1)
    cnt = np.zeros((n, num_e), dtype=np.int64)
    np.add.at(cnt, (np.repeat(np.arange(n), flat.shape[1]), np.maximum(flat, 0).ravel()),
              (flat >= 0).ravel())
    need = np.maximum(c - cnt, 0)
    width = int(need.sum(axis=1).max(initial=0))
    ok = np.ones(n, dtype=bool)
    if width == 0:
        return t, ok
    per = w / np.maximum(c, 1)
    items = np.full((n, width), -1, dtype=np.int64)
    for i in range(n):
        it = np.repeat(np.arange(num_e), need[i])
        items[i, : it.size] = it[np.argsort(-per[i, it], kind="stable")]
    safe = np.maximum(t, 0)
    r = np.where(t >= 0, np.take_along_axis(per, safe.reshape(n, -1), 1).reshape(t.shape),
                 0.0).sum(axis=2)
    has = np.zeros((n, num_d, num_e), dtype=bool)
    ni, di, _ = np.nonzero(t >= 0)
    has[ni, di, t[t >= 0]] = True
    rows = np.arange(n)
    for k in range(width):
        e = items[:, k]
        live = e >= 0
        es = np.maximum(e, 0)
        free = (t == -1)
        cand = free.any(axis=2) & ~has[rows, :, es]
        ok &= ~live | cand.any(axis=1)
        go = live & ok
        d = np.argmin(np.where(cand, r, np.inf), axis=1)
        pos = np.argmax(free[rows, d], axis=1)
        g = rows[go]
        t[g, d[go], pos[go]] = es[go]
        has[g, d[go], es[go]] = True
        r[g, d[go]] += per[g, es[go]]
    for i in np.nonzero(~ok)[0]:
        ok[i] = fill_exchange(per[i], t[i], c[i])
    return t, ok


def fill_exchange(per, t, c) -> bool:
    """Place the replicas ``repair`` could not (in place on one layer's t [D, S], free = -1):
    each goes to the least-loaded rank with a free slot that does not hold it; when every such
    rank holds it, an expert ``f`` of another rank moves into the free slot and the replica takes
    ``f``'s place (2 slots). per [E] per-replica load, c [E] target counts. False if stuck."""
    num_d = t.shape[0]
    cnt = replica_counts(t.reshape(-1), c.size)            # free slots (-1) not counted
    missing = np.repeat(np.arange(c.size), np.maximum(c - cnt, 0))
    for e in missing[np.argsort(-per[missing], kind="stable")]:
        load = np.where(t >= 0, per[np.maximum(t, 0)], 0.0).sum(axis=1)
        holds = (t == e).any(axis=1)
        free = (t < 0).any(axis=1)
        cand = np.nonzero(free & ~holds)[0]
        if cand.size:
            d = cand[np.argmin(load[cand])]
            t[d, np.argmax(t[d] < 0)] = e
            continue
        done = False
        for d0 in np.nonzero(free)[0]:
            pos0 = int(np.argmax(t[d0] < 0))
            for r in np.argsort(load, kind="stable"):
                if r == d0 or holds[r]:
                    continue
                ok_f = [k for k in range(t.shape[1]) if t[r, k] >= 0 and not (t[d0] == t[r, k]).any()]
                if ok_f:
                    k = ok_f[0]
                    t[d0, pos0], t[r, k] = t[r, k], e
                    done = True
                    break
            if done:
                break
        if not done:
            return False
    return bool((t >= 0).all()) and num_d > 0
