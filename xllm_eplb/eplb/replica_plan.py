"""The per-layer precomputation of per-step replica routing (:class:`RoutingPlan`), shared by
the modes (``eplb/replica_routing.py``) and the ``balanced`` solve (``eplb/replica_balance.py``).

Inputs: the layer's placement ``phy2log [D*S]`` (see ``eplb/placement.py``). A plan is built once
per placement and reused every step until the placement changes; everything in it is a pure
function of the placement, so every rank holds the same plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from xllm_eplb.eplb.placement import PlacementError, replica_counts

MODES = ("static", "spread", "balanced")


@dataclass(frozen=True)
class RoutingPlan:
    """Per-placement precomputation for one layer (build with :func:`prepare`, reuse every step
    until the placement changes). Shapes: ``D`` ranks, ``S`` slots per rank, ``NS = D*S``,
    ``K`` = max replicas of an expert, ``n`` experts with >= 2 replicas ("flexible")."""

    phy2log: np.ndarray       # [NS] int64
    num_logical: int
    ep_size: int
    cnt: np.ndarray           # [E] replicas per expert
    rep_index: np.ndarray     # [NS] index of the slot among its expert's replicas (slot order)
    slot_of: np.ndarray       # [E, K] slots of each expert in replica order, padded with NS
    static_slot: np.ndarray   # [D, E] the static route of each source
    single_e: np.ndarray      # [E - n] experts with one replica
    single_rank: np.ndarray   # [E - n] their rank
    flex_e: np.ndarray        # [n] flexible experts, ascending
    flex_rank: np.ndarray     # [n, K] rank of each replica, padded with D
    flex_mask: np.ndarray     # [n, K] bool, real replica
    flex_k: np.ndarray        # [n] replica count
    static_idx: np.ndarray    # [D, n] flat [n, K] cell the static route of source r uses
    spread_shift: np.ndarray  # [D, n, K] (j - r) mod k: spread's remainder rule
    cell_j: np.ndarray        # [1, K] 1..K
    rank_adj: tuple           # [D] per rank: moves ``(i, j, j2, rank2)`` off its flexible cells
    slot_cnt: np.ndarray      # [NS] replicas of each slot's expert
    single_slot: np.ndarray   # [NS] bool, the slot's expert has one replica
    flex_slots: np.ndarray    # [n, K] slots of each flexible expert in replica order, pad NS
    rank_flex: tuple          # [D] per rank ``((i, j, e), ...)``: its flexible replicas (expert
    #                           ``e`` = flex_e[i], replica j), plain ints
    flex_index: tuple         # [E] plain ints: i of a flexible expert, -1 for a single one
    first_slot: tuple         # [E] plain ints: the slot of each expert's first replica
    flex_slots_l: tuple       # [n][K] ``flex_slots`` as plain ints
    flex_info: tuple          # [n] ``(e, k, ranks)`` plain ints: each flexible expert, its
    #                           replica count and the rank of each replica (replica order)
    slot_lists: tuple         # [E] plain ints: each expert's slots in replica order
    cnt_l: tuple              # [E] plain ints: ``cnt``
    proj_key: tuple           # [E] plain ints: the column of expert e in the projected counts
    #                           (``replica_balance.project``): its rank if single, D + i if
    #                           flexible expert i


def prepare(phy2log: np.ndarray, num_logical: int, ep_size: int) -> RoutingPlan:
    """Precompute the routing structures of one layer's placement (``phy2log [D*S]``)."""
    p = np.array(phy2log, dtype=np.int64)     # a copy: the plan outlives the caller's array
    cnt = replica_counts(p, num_logical) if p.ndim == 1 else None
    if cnt is None or p.size % ep_size or cnt.sum() != p.size:      # an id outside [0, E)
        raise PlacementError(f"replica routing: slot table of shape {p.shape} is not "
                             f"[ep_size*slots] of ids in [0, {num_logical}) (ep_size={ep_size})")
    ns, d = p.size, ep_size
    s = ns // d
    if (cnt == 0).any():
        raise PlacementError(f"replica routing: logical expert {int(np.argmin(cnt))} has no "
                             f"replica")
    k = int(cnt.max())
    order = np.argsort(p, kind="stable")                      # slots grouped by expert
    first = np.concatenate(([0], np.cumsum(cnt)[:-1]))
    rep_index = np.empty(ns, dtype=np.int64)
    rep_index[order] = np.arange(ns) - np.repeat(first, cnt)
    slot_of = np.full((num_logical, k), ns, dtype=np.int64)
    slot_of[p, rep_index] = np.arange(ns)
    ranks = np.arange(d)
    static_slot = slot_of[np.arange(num_logical)[None, :], ranks[:, None] % cnt[None, :]]
    flex = cnt >= 2
    flex_e = np.nonzero(flex)[0]
    single_e = np.nonzero(~flex)[0]
    fs = slot_of[flex_e]
    fk = cnt[flex_e]
    jj = np.arange(k)
    mask = jj[None, :] < fk[:, None]
    flex_rank = np.where(mask, fs // s, d)
    static_idx = np.arange(flex_e.size)[None, :] * k + ranks[:, None] % fk[None, :]
    spread_shift = (jj[None, None, :] - ranks[:, None, None]) % fk[None, :, None]
    single_rank = slot_of[single_e, 0] // s
    fidx = np.full(num_logical, -1, dtype=np.int64)
    fidx[flex_e] = np.arange(flex_e.size)
    rank_flex: list[list] = [[] for _ in range(d)]
    for i, (row, kk, e) in enumerate(zip(flex_rank.tolist(), fk.tolist(), flex_e.tolist(),
                                          strict=True)):
        for j in range(kk):
            rank_flex[row[j]].append((i, j, e))
    return RoutingPlan(p, num_logical, d, cnt, rep_index, slot_of, static_slot, single_e,
                       single_rank, flex_e, flex_rank, mask, fk, static_idx,
                       spread_shift, (jj + 1)[None, :], _rank_adj(flex_rank, fk, d), cnt[p],
                       cnt[p] == 1, fs,
                       tuple(tuple(x) for x in rank_flex), tuple(fidx.tolist()),
                       tuple(slot_of[:, 0].tolist()), tuple(tuple(x) for x in fs.tolist()),
                       tuple((e, kk, tuple(row[:kk])) for e, kk, row in
                             zip(flex_e.tolist(), fk.tolist(), flex_rank.tolist(), strict=True)),
                       tuple(tuple(row[:c]) for row, c in zip(slot_of.tolist(), cnt.tolist(),
                                                              strict=True)),
                       tuple(cnt.tolist()),
                       tuple(np.where(fidx >= 0, d + fidx, slot_of[:, 0] // s).tolist()))


def _rank_adj(flex_rank: np.ndarray, fk: np.ndarray, d: int) -> tuple:
    """Per rank (plain ints, for :func:`_augment`): the moves ``(i, j, j2, rank2)`` from the cell
    of flexible expert ``i``'s replica ``j`` on it to its replica ``j2`` on ``rank2``; experts
    ascending, then replica order (the fixed search order every rank shares)."""
    adj: list[list] = [[] for _ in range(d)]
    for i, (row, k) in enumerate(zip(flex_rank.tolist(), fk.tolist(), strict=True)):
        for j in range(k):
            adj[row[j]].extend((i, j, j2, row[j2]) for j2 in range(k) if j2 != j)
    return tuple(tuple(a) for a in adj)


def check_counts(counts, plan: RoutingPlan) -> np.ndarray:
    c = np.asarray(counts)
    if c.shape != (plan.ep_size, plan.num_logical) or c.dtype.kind not in "iu":
        raise ValueError(f"replica routing: counts of shape {c.shape} dtype {c.dtype} are not "
                         f"integer [ep_size={plan.ep_size}, experts={plan.num_logical}]")
    if c.size and c.min() < 0:
        raise ValueError("replica routing: counts must be >= 0")
    return c.astype(np.int64, copy=False)


def sum_at(idx, weights, size: int) -> np.ndarray:
    """``out[i] = sum of weights where idx == i`` as int64. bincount sums in float64 in input
    order; every partial sum here is an integer below 2**53, so the result is exact (no rounding,
    the same on every rank)."""
    return np.bincount(idx, weights, minlength=size).astype(np.int64)


# ---- the static and spread splits of the flexible experts ([n, K] tokens per replica) -------
def flex_static(cf: np.ndarray, plan: RoutingPlan) -> np.ndarray:
    n, k = plan.flex_mask.shape
    return sum_at(plan.static_idx.ravel(), cf.ravel(), n * k).reshape(n, k)


def flex_spread(cf: np.ndarray, plan: RoutingPlan) -> np.ndarray:
    k = plan.flex_k
    q, rem = cf // k, cf % k
    extra = (plan.spread_shift < rem[:, :, None]).sum(axis=0)
    return np.where(plan.flex_mask, q.sum(axis=0)[:, None] + extra, 0)
