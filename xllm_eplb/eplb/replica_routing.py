"""Per-step replica routing: which replica serves each source rank's tokens of each expert.

Replicas of a logical expert hold identical weights, so choosing the replica per token changes no
output; it only changes how the step's load lands on the ranks. Inputs of one MoE layer and step:
``counts [D, E]`` int64, the tokens (top-k occurrences) source rank ``r`` routes to logical expert
``e``, and the layer's placement (``phy2log [D*S]``, see ``eplb/placement.py``). Outputs:
``route(...) -> int64 [D, D*S]``, tokens source ``r`` sends to global slot ``p`` (or
``source_row`` for one source, what a rank computes for itself), ``slot_loads -> [D*S]``.

Modes:

- ``static``: source ``r`` sends all of expert ``e``'s tokens to replica ``r % logcnt[e]`` (global
  rank-major order), exactly ``placement.build_log2phy`` (xLLM's rule);
- ``spread``: source ``r`` splits its ``c`` tokens of ``e`` evenly over e's ``k`` replicas:
  replica ``j`` gets ``c // k`` plus one if ``(j - r) mod k < c mod k`` (remainders rotate with
  the source rank);
- ``balanced``: every rank computes the same split of each expert's step total over its replicas
  that minimises the maximum rank load, exactly, in whole tokens (:func:`balanced_flex`), then
  source ``r`` takes its share by the north-west-corner rule: e's tokens are lined up source by
  source (rank order) and cut into e's replicas in replica order.

NOTE (cross-rank rule): ``balanced`` needs the counts of every source (an all-gather of
``counts [D, E]`` on the EP group each step and layer); every rank then runs the same integer
arithmetic on the same array with stable tie-breaks (stable sorts, lowest index first), so each
reaches the identical assignment with no broadcast. No float enters the solve: keep it so.

Cost: the solve is a few vectorised numpy calls (totals, fixed loads, even start) plus a short
integer loop over the flexible experts' cells (augmenting paths, :func:`_augment`); at 256
experts, EP32 + 32 redundant slots it takes ~50-100 us per layer (``scripts/bench_routing.py``).
A vectorised Jacobi scheme was slower there: each numpy call costs microseconds on arrays of
~30 x 3, and it needed ~8 rounds of ~30 calls.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from xllm_eplb.eplb.placement import PlacementError

MODES = ("static", "spread", "balanced")
ROUNDS = 8                      # ``balanced``: at most ROUNDS x (D + n) augmentations
_BIG = np.int64(1) << 40        # load of the padding rank: never below a real rank


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


def prepare(phy2log: np.ndarray, num_logical: int, ep_size: int) -> RoutingPlan:
    """Precompute the routing structures of one layer's placement (``phy2log [D*S]``)."""
    p = np.array(phy2log, dtype=np.int64)     # a copy: the plan outlives the caller's array
    if p.ndim != 1 or p.size % ep_size or ((p < 0) | (p >= num_logical)).any():
        raise PlacementError(f"replica routing: slot table of shape {p.shape} is not "
                             f"[ep_size*slots] of ids in [0, {num_logical}) (ep_size={ep_size})")
    ns, d = p.size, ep_size
    s = ns // d
    cnt = np.bincount(p, minlength=num_logical)
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
    return RoutingPlan(p, num_logical, d, cnt, rep_index, slot_of, static_slot, single_e,
                       slot_of[single_e, 0] // s, flex_e, flex_rank, mask, fk, static_idx,
                       spread_shift, (jj + 1)[None, :], _rank_adj(flex_rank, fk, d), cnt[p],
                       cnt[p] == 1, fs)


def _rank_adj(flex_rank: np.ndarray, fk: np.ndarray, d: int) -> tuple:
    """Per rank (plain ints, for :func:`_augment`): the moves ``(i, j, j2, rank2)`` from the cell
    of flexible expert ``i``'s replica ``j`` on it to its replica ``j2`` on ``rank2``; experts
    ascending, then replica order (the fixed search order every rank shares)."""
    adj: list[list] = [[] for _ in range(d)]
    for i, (row, k) in enumerate(zip(flex_rank.tolist(), fk.tolist(), strict=True)):
        for j in range(k):
            adj[row[j]].extend((i, j, j2, row[j2]) for j2 in range(k) if j2 != j)
    return tuple(tuple(a) for a in adj)


def _check_counts(counts, plan: RoutingPlan) -> np.ndarray:
    c = np.asarray(counts)
    if c.shape != (plan.ep_size, plan.num_logical) or c.dtype.kind not in "iu":
        raise ValueError(f"replica routing: counts of shape {c.shape} dtype {c.dtype} are not "
                         f"integer [ep_size={plan.ep_size}, experts={plan.num_logical}]")
    if (c < 0).any():
        raise ValueError("replica routing: counts must be >= 0")
    return c.astype(np.int64, copy=False)


def _sum_at(idx, weights, size: int) -> np.ndarray:
    """``out[i] = sum of weights where idx == i`` as int64. bincount sums in float64 in input
    order; every partial sum here is an integer below 2**53, so the result is exact (no rounding,
    the same on every rank)."""
    return np.bincount(idx, weights, minlength=size).astype(np.int64)


# ---- the per-mode split of the flexible experts ([n, K] tokens per replica) --------------------
def _flex_static(cf: np.ndarray, plan: RoutingPlan) -> np.ndarray:
    n, k = plan.flex_mask.shape
    return _sum_at(plan.static_idx.ravel(), cf.ravel(), n * k).reshape(n, k)


def _flex_spread(cf: np.ndarray, plan: RoutingPlan) -> np.ndarray:
    k = plan.flex_k
    q, rem = cf // k, cf % k
    extra = (plan.spread_shift < rem[:, :, None]).sum(axis=0)
    return np.where(plan.flex_mask, q.sum(axis=0)[:, None] + extra, 0)


def _augment(load: list, xs: list, adj: tuple, cap: int) -> bool:
    """Lower the max rank load of the split ``xs [n][K]`` (plain ints, updated in place with
    ``load [D]``) by augmenting paths; True once it is the integer optimum.

    Each pass takes the most loaded rank ``r0`` (lowest index on ties) with load ``T`` and
    searches breadth-first (moves in ``adj`` order) through moves "expert i's tokens on rank a ->
    its replica on rank b" (``xs`` > 0 on a); on the first level that reaches ranks with load
    <= T - 2 it takes the least loaded of them (first found on ties), and along the path
    ``min(bottleneck, (T - end load) // 2)`` tokens move, so only r0 and the end change. When no
    such rank is reachable, the ranks reachable from r0 hold at least T - 1 each and every token
    of the experts with tokens on them: any split puts that total on them, so its max is >= T
    (the optimum). At most ``cap`` passes."""
    d = len(load)
    for _ in range(cap):
        top = max(load)
        r0 = load.index(top)
        frm = [-1] * d
        via: list = [None] * d
        frm[r0] = r0
        frontier, best, end = [r0], top - 1, -1
        while frontier and end < 0:
            nxt = []
            for r in frontier:
                for i, j, j2, r2 in adj[r]:
                    if frm[r2] < 0 and xs[i][j] > 0:
                        frm[r2], via[r2] = r, (i, j, j2)
                        nxt.append(r2)
                        if load[r2] < best:
                            best, end = load[r2], r2
            frontier = nxt
        if end < 0:
            return True
        delta, r = (top - best) // 2, end
        while r != r0:
            i, j, _ = via[r]
            delta = min(delta, xs[i][j])
            r = frm[r]
        r = end
        while r != r0:
            i, j, j2 = via[r]
            xs[i][j] -= delta
            xs[i][j2] += delta
            r = frm[r]
        load[r0] -= delta
        load[end] += delta
    return False


def balanced_flex(counts: np.ndarray, plan: RoutingPlan, rounds: int = ROUNDS):
    """The ``balanced`` split of the flexible experts: ``(x [n, K] int64, fixed [D+1])``.

    Start: each expert's step total split evenly over its replicas (remainder to the first
    replicas); then :func:`_augment` (at most ``rounds x (D + n)`` paths) moves tokens until the
    max rank load is the integer optimum. Should the cap stop it first, the split is compared
    with the ``spread`` and ``static`` splits and the lowest max load wins (ties: the earlier), so
    ``balanced`` is never worse than either."""
    d = plan.ep_size
    tot = counts.sum(axis=0)
    tp = tot[plan.phy2log]
    q = tp // plan.slot_cnt
    y = q + (plan.rep_index < tp - q * plan.slot_cnt)        # [NS] the even start per slot
    fixed = np.append(np.where(plan.single_slot, y, 0).reshape(d, -1).sum(axis=1), _BIG)
    n, k = plan.flex_mask.shape
    if n == 0:
        return np.zeros((0, k), dtype=np.int64), fixed
    rf = plan.flex_rank.ravel()
    load = y.reshape(d, -1).sum(axis=1).tolist()
    xs = np.append(y, 0)[plan.flex_slots].tolist()
    if _augment(load, xs, plan.rank_adj, max(1, int(rounds)) * (d + n)):
        return np.array(xs, dtype=np.int64), fixed
    best_x, best_pk = np.array(xs, dtype=np.int64), max(load)
    cf = counts[:, plan.flex_e]
    for alt in (_flex_spread(cf, plan), _flex_static(cf, plan)):
        pk = int((fixed + _sum_at(rf, alt.ravel(), d + 1))[:d].max())
        if pk < best_pk:
            best_x, best_pk = alt, pk
    return best_x, fixed


# ---- slot loads and per-source rows -----------------------------------------------------------
def _flex_to_slots(x: np.ndarray, tot: np.ndarray, plan: RoutingPlan) -> np.ndarray:
    ns = plan.phy2log.size
    y = np.zeros(ns + 1, dtype=np.int64)
    y[plan.slot_of[plan.single_e, 0]] = tot[plan.single_e]
    y[plan.slot_of[plan.flex_e][plan.flex_mask]] = x[plan.flex_mask]
    return y[:ns]


def slot_loads(counts, plan: RoutingPlan, mode: str, rounds: int = ROUNDS) -> np.ndarray:
    """Tokens each global slot serves this step: int64 [D*S]."""
    c = _check_counts(counts, plan)
    if mode == "balanced":
        x, _ = balanced_flex(c, plan, rounds)
        return _flex_to_slots(x, c.sum(axis=0), plan)
    return route(c, plan, mode).sum(axis=0)


def _northwest(cs, ce, y, plan: RoutingPlan) -> np.ndarray:
    """Share of the sources with token intervals ``[cs, ce)`` (``[..., E]``) in each slot, when
    e's line of tokens is cut into its replicas (replica order) of sizes ``y [D*S]``."""
    cum = np.cumsum(np.append(y, 0)[plan.slot_of], axis=1)   # [E, K] end of each replica
    ye = cum[plan.phy2log, plan.rep_index]
    ys = ye - y
    e = plan.phy2log
    hi = np.minimum(ce[..., e], ye)
    lo = np.maximum(cs[..., e], ys)
    return np.maximum(hi - lo, 0)


def route(counts, plan: RoutingPlan, mode: str, rounds: int = ROUNDS) -> np.ndarray:
    """Tokens source rank ``r`` sends to global slot ``p``: int64 [D, D*S] (see module doc)."""
    c = _check_counts(counts, plan)
    d = plan.ep_size
    e = plan.phy2log
    if mode == "static":
        out = np.zeros((d, e.size), dtype=np.int64)
        r = np.repeat(np.arange(d), plan.num_logical)
        out[r, plan.static_slot.ravel()] = c.ravel()
        return out
    if mode == "spread":
        k = plan.cnt[e]
        cr = c[:, e]
        shift = (plan.rep_index[None, :] - np.arange(d)[:, None]) % k[None, :]
        return cr // k + (shift < cr % k)
    if mode == "balanced":
        y = slot_loads(c, plan, "balanced", rounds)
        ce = np.cumsum(c, axis=0)
        return _northwest(ce - c, ce, y, plan)
    raise ValueError(f"replica routing: mode {mode!r} is not one of {', '.join(MODES)}")


def source_row(counts, plan: RoutingPlan, mode: str, rank: int,
               rounds: int = ROUNDS) -> np.ndarray:
    """Row ``rank`` of :func:`route` (what one rank computes for its own tokens): int64 [D*S]."""
    c = _check_counts(counts, plan)
    if mode != "balanced":
        return route(c, plan, mode)[rank]
    y = slot_loads(c, plan, "balanced", rounds)
    cs = c[:rank].sum(axis=0)
    return _northwest(cs, cs + c[rank], y, plan)


def rank_loads(slot_load: np.ndarray, ep_size: int) -> np.ndarray:
    """Per-slot loads ``[..., D*S]`` -> per-rank loads ``[..., D]``."""
    s = np.asarray(slot_load)
    return s.reshape(*s.shape[:-1], ep_size, -1).sum(axis=-1)


def assign_tokens(topk_ids: np.ndarray, row: np.ndarray, plan: RoutingPlan) -> np.ndarray:
    """Physical slot of each routed token of one source: ``topk_ids [N, K]`` logical ids and the
    source's ``row [D*S]`` (from :func:`source_row`) -> int64 [N, K] global slots. Expert e's
    occurrences, in row-major (token, k) order, fill e's replicas in replica order, ``row[p]``
    each; ``row`` must hold exactly each expert's occurrence count."""
    ids = np.asarray(topk_ids, dtype=np.int64)
    flat = ids.ravel()
    per_e = np.bincount(flat, minlength=plan.num_logical)
    by_e = _sum_at(plan.phy2log, np.asarray(row), plan.num_logical)
    if (per_e != by_e).any():
        e = int(np.argmax(per_e != by_e))
        raise ValueError(f"replica routing: expert {e} has {int(per_e[e])} tokens but the row "
                         f"assigns {int(by_e[e])}")
    order = np.argsort(flat, kind="stable")
    g = np.empty(flat.size, dtype=np.int64)
    g[order] = np.arange(flat.size)                           # global rank among all occurrences
    slots = plan.slot_of[plan.slot_of < plan.phy2log.size]   # by expert, then replica index
    ends = np.cumsum(np.asarray(row, dtype=np.int64)[slots])
    pos = np.searchsorted(ends, g, side="right")
    return slots[pos].reshape(ids.shape)
