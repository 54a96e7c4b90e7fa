"""Local search of one placement row on the modelled step cost (pure numpy; issue #26).

A token-count policy balances rows and replicates hot experts; on a rank whose expert calls each
pay a fixed cost (:mod:`xllm_eplb.eplb.cost_model`) a replica that splits a hot expert's rows
costs a second fixed cost, and a swap of two experts between ranks would often balance as well
for free. :func:`refine_row` starts from a valid row (the deployed one, or a policy's candidate)
and applies, while one improves the objective, the best of two kinds of move:

- **swap** (``SWAP`` in the placement toolkit's move vocabulary) the experts of a slot on the slowest rank and a slot on another rank (replica counts
  unchanged, so only those two ranks' costs change);
- **re-target** (a ``SET`` move) a slot whose expert has two or more replicas to another expert that rank does
  not hold: either a replica of an expert of the slowest rank (replication, paid with a second
  fixed cost) or of one of the coldest experts (a replica nobody's rows split much: the cheap
  place for a slot no hot expert needs).

Objective, lexicographic: the modelled critical path (max over ranks of the expected cost),
then the sum of squared rank costs (so ranks below the maximum keep balancing). Every row it
returns keeps the strict invariants (every expert present, at most one replica per rank); the
number of moves is capped (``max_moves``; a swap changes two slots, a re-target one).
"""

from __future__ import annotations

import numpy as np

from xllm_eplb.eplb.placement import SET, SWAP, apply_moves, replica_counts

#: coldest experts tried as re-target destinations per move
COLD_TARGETS = 4
#: relative improvement below which a move is not taken (float noise)
TOL = 1e-9
#: hottest experts of the slowest rank tried as a replica when :func:`pack_row` fills a slot
HOT_TARGETS = 8


def slot_cost(fixed: float, row: float, lam: np.ndarray) -> np.ndarray:
    """Expected seconds of a slot with ``lam`` expected rows per step (Poisson activity)."""
    lam = np.asarray(lam, dtype=np.float64)
    return fixed * -np.expm1(-lam) + row * lam


class _Row:
    """The mutable state of one row under search."""

    def __init__(self, fixed: float, row_s: float, rate: np.ndarray, start: np.ndarray,
                 ep_size: int):
        self.f, self.r = float(fixed), float(row_s)
        self.rate = np.asarray(rate, dtype=np.float64)
        self.row = np.array(start, dtype=np.int64)
        self.D, self.E = ep_size, self.rate.size
        self.S = self.row.size // ep_size
        self.rank_of = np.arange(self.row.size) // self.S
        self.refresh()

    def refresh(self) -> None:
        self.cnt = replica_counts(self.row, self.E)
        self.c = slot_cost(self.f, self.r, self.rate[self.row] / self.cnt[self.row])
        self.rank = self.c.reshape(self.D, self.S).sum(axis=1)
        self.on = np.zeros((self.D, self.E), dtype=bool)
        self.on[self.rank_of, self.row] = True

    def key(self, rank: np.ndarray) -> tuple[float, float]:
        return float(rank.max()), float((rank * rank).sum())


def _best_swap(st: _Row, p: int):
    """(new max, new sumsq, a, b) of the best swap between the slowest rank ``p`` and any other
    rank, or None when no swap is valid."""
    a = np.arange(p * st.S, (p + 1) * st.S)
    b = np.nonzero(st.rank_of != p)[0]
    if b.size == 0:
        return None
    ea, eb, q = st.row[a][:, None], st.row[b][None, :], st.rank_of[b][None, :]
    ok = (ea != eb) & ~st.on[q, ea] & ~st.on[p, eb]
    if not ok.any():
        return None
    ca, cb = st.c[a][:, None], st.c[b][None, :]
    new_p = st.rank[p] - ca + cb
    new_q = st.rank[q] - cb + ca
    others = np.where(np.arange(st.D)[None, :] == p, -np.inf, st.rank[None, :])
    # the largest rank cost outside {p, q}, per q
    other = np.empty(st.D)
    for qq in range(st.D):
        o = others[0].copy()
        o[qq] = -np.inf
        other[qq] = o.max() if st.D > 2 else -np.inf
    newmax = np.maximum(np.maximum(new_p, new_q), other[q])
    sumsq = float((st.rank ** 2).sum())
    newsq = sumsq - st.rank[p] ** 2 - st.rank[q] ** 2 + new_p ** 2 + new_q ** 2
    newmax = np.where(ok, newmax, np.inf)
    i = np.lexsort((newsq.ravel(), newmax.ravel()))[0]
    ia, ib = np.unravel_index(i, newmax.shape)
    if not np.isfinite(newmax[ia, ib]):
        return None
    return float(newmax[ia, ib]), float(newsq[ia, ib]), int(a[ia]), int(b[ib])


def _best_retarget(st: _Row, p: int):
    """(new max, new sumsq, b, e2) of the best re-target of a spare slot ``b`` (its expert has
    >= 2 replicas) to ``e2`` (an expert of the slowest rank ``p`` or a cold one), or None.
    Vectorised over (slot, target, rank): a re-target changes the cost of every replica of the
    two experts (their rows split over one replica fewer / more)."""
    spare = np.nonzero(st.cnt[st.row] >= 2)[0]
    if spare.size == 0:
        return None
    hot_p = st.row[st.rank_of == p]
    cold = np.argsort(st.rate, kind="stable")[:COLD_TARGETS]
    tg = np.unique(np.concatenate([hot_p, cold]))
    e, q = st.row[spare], st.rank_of[spare]
    ce, c2 = st.cnt[e], st.cnt[tg]
    cur_e = slot_cost(st.f, st.r, st.rate[e] / ce)                       # [B]
    less_e = slot_cost(st.f, st.r, st.rate[e] / (ce - 1)) - cur_e        # per other replica
    new_2 = slot_cost(st.f, st.r, st.rate[tg] / (c2 + 1))                # [T]
    more_2 = new_2 - slot_cost(st.f, st.r, st.rate[tg] / c2)             # per existing replica
    onehot_q = np.eye(st.D)[q]                                           # [B, D]
    on_e = st.on[:, e].T & (onehot_q == 0)                               # [B, D] other replicas
    rank = (st.rank[None, None, :] + (on_e * less_e[:, None])[:, None, :]
            + (st.on[:, tg].T * more_2[:, None])[None, :, :]
            + onehot_q[:, None, :] * (new_2[None, :] - cur_e[:, None])[:, :, None])
    ok = (tg[None, :] != e[:, None]) & ~st.on[q[:, None], tg[None, :]]
    if not ok.any():
        return None
    mx = np.where(ok, rank.max(axis=2), np.inf)
    sq = (rank * rank).sum(axis=2)
    i = np.lexsort((sq.ravel(), mx.ravel()))[0]
    ib, it = np.unravel_index(i, mx.shape)
    return float(mx[ib, it]), float(sq[ib, it]), int(spare[ib]), int(tg[it])


def refine_row(fixed: float, row_s: float, rate: np.ndarray, start: np.ndarray, ep_size: int,
               max_moves: int) -> tuple[np.ndarray, int]:
    """(row, moves): ``start`` (a valid row, int [D*S]) improved on the modelled cost of one
    layer (``fixed`` s per active slot, ``row_s`` s per row, ``rate`` [E] expected rows per
    step) by at most ``max_moves`` best-improvement moves; ``start`` itself when none helps."""
    st = _Row(fixed, row_s, rate, start, ep_size)
    moves = 0
    while moves < max_moves:
        cur = st.key(st.rank)
        p = int(np.argmax(st.rank))
        swap, ret = _best_swap(st, p), _best_retarget(st, p)
        cands = [(SWAP, swap), (SET, ret)]
        cands = [(kind, m) for kind, m in cands if m is not None]
        if not cands:
            break
        kind, (new_max, new_sq, x, y) = min(cands, key=lambda c: c[1][:2])
        tol_max, tol_sq = TOL * max(cur[0], 1e-30), TOL * max(cur[1], 1e-30)
        if not (new_max < cur[0] - tol_max
                or (new_max <= cur[0] + tol_max and new_sq < cur[1] - tol_sq)):
            break
        apply_moves(st.row, [(kind, x, y)])
        st.refresh()
        moves += 1
    return st.row, moves


def pack_row(fixed: float, row_s: float, rate: np.ndarray, ep_size: int,
             slots: int) -> np.ndarray:
    """A row built from scratch on the modelled cost: every expert once, longest expected cost
    first onto the cheapest rank with a free slot (LPT), then each spare slot filled with the
    replica that lowers (max, sum of squares) most: one of the slowest rank's hottest experts
    (a split) or one of the coldest (nearly free), on the cheapest rank that lacks it. A start
    for :func:`refine_row` that a move-by-move search from a replicated row cannot reach."""
    rate = np.asarray(rate, dtype=np.float64)
    E = rate.size
    one = slot_cost(fixed, row_s, rate)
    load, used = np.zeros(ep_size), np.zeros(ep_size, dtype=np.int64)
    on = np.zeros((ep_size, E), dtype=bool)
    for e in np.argsort(-one, kind="stable").tolist():
        q = int(np.argmin(np.where(used < slots, load, np.inf)))
        on[q, e], load[q], used[q] = True, load[q] + one[e], used[q] + 1
    cnt = on.sum(axis=0)
    cold = np.argsort(rate, kind="stable")[:COLD_TARGETS]
    for _ in range(ep_size * slots - E):
        p = int(np.argmax(load))
        mine = np.nonzero(on[p])[0]
        hot = mine[np.argsort(-one[mine], kind="stable")[:HOT_TARGETS]]
        tg = np.unique(np.concatenate([hot, cold]))
        free = (used < slots)[:, None] & ~on[:, tg]                      # [D, T]
        if not free.any():                  # every target sits on the ranks with room
            tg = np.arange(E)
            free = (used < slots)[:, None] & ~on
        if not free.any():
            raise ValueError(f"pack_row: no expert fits a spare slot (E={E}, "
                             f"ep_size={ep_size}, slots={slots})")
        q = np.argmin(np.where(free, load[:, None], np.inf), axis=0)     # [T] cheapest rank
        new = slot_cost(fixed, row_s, rate[tg] / (cnt[tg] + 1))
        per = new - slot_cost(fixed, row_s, rate[tg] / cnt[tg])
        trial = (load[None, :] + on[:, tg].T * per[:, None]
                 + np.eye(ep_size)[q] * new[:, None])                    # [T, D]
        mx = np.where(free.any(axis=0), trial.max(axis=1), np.inf)
        i = int(np.lexsort(((trial * trial).sum(axis=1), mx))[0])
        e, qq = int(tg[i]), int(q[i])
        on[qq, e], used[qq], cnt[e], load = True, used[qq] + 1, cnt[e] + 1, trial[i]
    return np.concatenate([np.nonzero(on[r])[0] for r in range(ep_size)]).astype(np.int64)


def align_row(row: np.ndarray, deployed: np.ndarray, ep_size: int) -> np.ndarray:
    """``row`` with its ranks relabelled and each rank's slots reordered to change as few slots
    of ``deployed`` as possible (the modelled cost is the same: it depends on each rank's set
    of experts only). Ranks are matched greedily by the number of experts they share."""
    row, dep = np.asarray(row, dtype=np.int64), np.asarray(deployed, dtype=np.int64)
    S = row.size // ep_size
    new = [row[q * S:(q + 1) * S] for q in range(ep_size)]
    old = [dep[r * S:(r + 1) * S] for r in range(ep_size)]
    E = int(max(row.max(), dep.max())) + 1
    on_new, on_old = np.zeros((ep_size, E)), np.zeros((ep_size, E))
    on_new[np.arange(row.size) // S, row] = 1
    on_old[np.arange(dep.size) // S, dep] = 1
    overlap = on_new @ on_old.T
    dest = np.full(ep_size, -1)
    taken = np.zeros(ep_size, dtype=bool)
    for i in np.argsort(-overlap, axis=None, kind="stable").tolist():
        q, r = divmod(i, ep_size)
        if dest[q] < 0 and not taken[r]:
            dest[q], taken[r] = r, True
    out = np.empty_like(row)
    for q, r in enumerate(dest.tolist()):
        want, keep = set(new[q].tolist()), []
        for e in old[r].tolist():
            keep.append(e if e in want else None)
            want.discard(e)
        rest = iter(sorted(want))
        out[r * S:(r + 1) * S] = [k if k is not None else next(rest) for k in keep]
    return out
