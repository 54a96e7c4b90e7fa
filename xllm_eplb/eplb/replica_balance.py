"""The ``balanced`` replica routing solve: each expert's step total split over its replicas so
that the maximum rank load is the integer optimum, and one source rank's share of it.

Input of one layer and step: ``counts [D, E]`` int64 (tokens source ``r`` routes to expert ``e``)
and the layer's :class:`~xllm_eplb.eplb.replica_plan.RoutingPlan`. Experts with one replica
("single") put their whole total on their rank; the solve only splits the flexible ones.

1. **Even start** (a few vectorised numpy calls): each expert's step total split evenly over its
   replicas, the remainder to the first replicas.
2. **Augmenting paths** (:func:`_augment`, plain integers) move tokens between replicas until no
   path from the most loaded rank reaches a rank 2 tokens lighter, which proves the optimum.
3. **This source's share** (:func:`balanced_rank`): each expert's tokens line up source by source
   (rank order) and are cut into its replicas in replica order (the north-west-corner rule of
   ``replica_routing.route``), so a rank needs only the prefix of the counts above it.

NOTE (cross-rank rule): every step is integer arithmetic on the same all-gathered counts and the
same plan, with fixed orders and tie-breaks, so every rank reaches the identical split with no
broadcast. No float enters the solve: keep it so (``np.bincount``'s float64 sums of int64 counts
are exact below 2**53).

Cost at 256 experts, EP32 + 32 redundant slots: well under 100 us per layer on a quiet CPU
(docs/benchmarks.md, "Per-step replica routing"): ~10 numpy calls, then a few augmenting passes
in plain integer Python over the ~30 flexible experts' cells. (A vectorised Jacobi scheme was slower: each numpy
call costs microseconds on arrays of ~30 x 3, and it needed ~8 rounds of ~30 calls.)
"""

from __future__ import annotations

import numpy as np

from xllm_eplb.eplb.replica_plan import RoutingPlan, check_counts, flex_spread, flex_static, sum_at

ROUNDS = 8                      # at most ROUNDS x (D + n) augmentations
ROWS_PY, CELLS_PY = 512, 4096   # up to these rows and counts: plain lists (``balanced_rows``)
_BIG = np.int64(1) << 40        # load of the padding rank / end of a single expert's line


def _augment(load: list, xs: list, adj: tuple, cap: int) -> bool:
    """Lower the max rank load of the split ``xs [n][K]`` (plain ints, updated in place with
    ``load [D]``) by augmenting paths; True once it is the integer optimum.

    Each pass takes the most loaded rank ``r0`` (lowest index on ties) with load ``T`` and
    searches breadth-first (moves in ``adj`` order) through moves "expert i's tokens on rank a ->
    its replica on rank b" (``xs`` > 0 on a), level by level until a level has reached a rank at
    or below the mean load (or nothing new is reachable); the end is the least loaded rank
    reached (first found on ties), and if it is at most T - 2, along the path
    ``min(bottleneck, (T - end load) // 2)`` tokens move, so only r0 and the end change. (Ending
    at the first lighter rank instead equalises neighbours of similar load and took up to ~450
    passes on a real layer at 1024 tokens per rank; the mean-load goal, ~40.) When no
    such rank is reachable, the ranks reachable from r0 hold at least T - 1 each and every token
    of the experts with tokens on them: any split puts that total on them, so its max is >= T
    (the optimum). It also stops at once when the max is the mean rounded up, the bound no split
    beats. At most ``cap`` passes."""
    d = len(load)
    goal = sum(load) // d                 # an integer: the same on every rank
    floor = -(-sum(load) // d)            # no split has a max below the mean (rounded up)
    for _ in range(cap):
        top = max(load)
        if top <= floor:
            return True
        r0 = load.index(top)
        frm = [-1] * d
        via: list = [None] * d
        frm[r0] = r0
        frontier, best, end = [r0], top - 1, -1
        while frontier and (end < 0 or best > goal):
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


def balanced_split(c: np.ndarray, plan: RoutingPlan, rounds: int = ROUNDS, tot=None):
    """``(x, tot [E] int64)``: the split of each flexible expert's step total over its replicas,
    ``x`` [n][K] nested lists of ints (or an int64 [n, K] array, see below; padding replicas 0).
    ``c``: checked counts [D, E]; ``tot``: ``c.sum(axis=0)`` when the caller has it.

    Should the path cap (``rounds x (D + n)``) stop the augmentation first, the split is
    compared with the ``spread`` and ``static`` splits and the lowest max load wins (ties: the
    earlier) and returned as an array, so ``balanced`` is never worse than either."""
    d = plan.ep_size
    if tot is None:
        tot = c.sum(axis=0)
    n = plan.flex_e.size
    if n == 0:
        return [], tot
    tp = tot[plan.phy2log]
    q = tp // plan.slot_cnt
    y = q + (plan.rep_index < tp - q * plan.slot_cnt)        # [NS] the even start per slot
    load = y.reshape(d, -1).sum(axis=1).tolist()
    xs = np.append(y, 0)[plan.flex_slots].tolist()
    if _augment(load, xs, plan.rank_adj, max(1, int(rounds)) * (d + n)):
        return xs, tot
    return _capped(xs, load, c[:, plan.flex_e], sum_at(plan.single_rank, tot[plan.single_e], d),
                   plan), tot


def _capped(xs: list, load: list, cf: np.ndarray, fixed: np.ndarray, plan: RoutingPlan):
    """The path cap's rule: the lowest max load of the capped split ``xs`` (rank loads
    ``load``), the ``spread`` split and the ``static`` split (ties: the earlier) -> int64
    [n, K]. ``cf`` [D, n] the sources' counts of the flexible experts, ``fixed`` [D] the
    single-replica experts' load per rank."""
    d = plan.ep_size
    best_x, best_pk = np.array(xs, dtype=np.int64), max(load)
    rf = plan.flex_rank.ravel()
    fixed = np.append(fixed, _BIG)
    for alt in (flex_spread(cf, plan), flex_static(cf, plan)):
        pk = int((fixed + sum_at(rf, alt.ravel(), d + 1))[:d].max())
        if pk < best_pk:
            best_x, best_pk = alt, pk
    return best_x


def balanced_flex(counts, plan: RoutingPlan, rounds: int = ROUNDS) -> np.ndarray:
    """The ``balanced`` split of the flexible experts: int64 [n, K] (see :func:`balanced_split`)."""
    x, _ = balanced_split(check_counts(counts, plan), plan, rounds)
    return np.asarray(x, dtype=np.int64).reshape(plan.flex_mask.shape)


def balanced_rank(counts, plan: RoutingPlan, rank: int, ids, rounds: int = ROUNDS,
                  rows_py: int = ROWS_PY, cells_py: int = CELLS_PY):
    """One source rank's ``balanced`` routing, what a rank computes for its own tokens:
    ``(slots, send, recv)``.

    ``ids``: the logical expert of each of the rank's routed rows (any shape, row-major order);
    their per-expert counts must be ``counts[rank]``. ``slots``: int64, the global physical slot
    of each row (shape of ``ids``): expert e's rows, in order, continue e's line from the tokens
    of the ranks before this one and fill the replicas in replica order. ``send [D]``: rows this
    rank sends to each rank; ``recv [D]``: rows each source sends to this rank. Equal to
    ``replica_routing.route(counts, plan, "balanced")`` row ``rank`` assigned by
    ``assign_tokens``, and to its split sizes, without building the [D, D*S] matrix.

    Up to ``rows_py`` rows and ``cells_py`` counts (a decode step at small EP) it runs on plain
    Python lists (:func:`balanced_rows`), otherwise on numpy; both give the same result."""
    c = check_counts(counts, plan)
    a = np.asarray(ids, dtype=np.int64)
    flat = a.ravel()
    if flat.size <= rows_py and c.size <= cells_py:
        if flat.size and flat.min() < 0:
            raise ValueError("replica routing: expert ids must be >= 0")
        slots, send, recv = balanced_rows(c.tolist(), plan, rank, flat.tolist(), rounds)
        return np.array(slots, dtype=np.int64).reshape(a.shape), send, recv
    e_n = plan.num_logical
    per = np.bincount(flat, minlength=e_n)
    if per.size != e_n or not np.array_equal(per, c[rank]):
        _mismatch(per.tolist(), c[rank].tolist(), rank)
    xs, _ = balanced_split(c, plan, rounds)
    if isinstance(xs, np.ndarray):
        xs = xs.tolist()
    slots, send = _rows_numpy(flat, per, c[:rank].sum(axis=0), xs, plan)
    return slots.reshape(a.shape), send, _recv(project_np(c, plan), xs, plan, rank)


def _mismatch(per: list, mine: list, rank: int):
    if len(per) > len(mine):
        raise ValueError(f"replica routing: rank {rank}'s rows hold expert id {len(per) - 1} "
                         f"(>= {len(mine)} experts)")
    e = next(e for e, (u, v) in enumerate(zip(per, mine, strict=True)) if u != v)
    raise ValueError(f"replica routing: rank {rank}'s rows of expert {e} do not match "
                     f"counts[{rank}] ({per[e]} rows, counts {mine[e]})")


def project(cl: list, plan: RoutingPlan) -> list:
    """Counts [D][E] -> the solve's inputs [D][D + n]: per source, its tokens of the
    single-replica experts of each rank (columns 0..D-1), then of each flexible expert (column
    D + i), from ``plan.proj_key``. (A rank can count this row straight from its routed rows.)"""
    key, width = plan.proj_key, plan.ep_size + plan.flex_e.size
    out = []
    for row in cl:
        p = [0] * width
        for e, v in enumerate(row):
            p[key[e]] += v
        out.append(p)
    return out


def project_np(c: np.ndarray, plan: RoutingPlan) -> list:
    """:func:`project` of an int64 [D, E] array (one ``bincount``), as lists."""
    d, w = plan.ep_size, plan.ep_size + plan.flex_e.size
    idx = (np.arange(d)[:, None] * w + np.asarray(plan.proj_key)[None, :]).ravel()
    return sum_at(idx, c.ravel(), d * w).reshape(d, w).tolist()


def balanced_rows(cl: list, plan: RoutingPlan, rank: int, rows: list, rounds: int = ROUNDS):
    """:func:`balanced_rank` on plain lists: ``cl`` the counts [D][E] (ints >= 0, checked by the
    caller), ``rows`` this rank's routed expert ids, where -1 (a row dropped by capacity) stays
    -1 and counts nowhere. -> ``(slots list, send [D], recv [D])``: the rows are checked against
    ``cl[rank]``, then :func:`balanced_share` runs on ``project(cl)``."""
    e_n, mine = plan.num_logical, cl[rank]
    per = [0] * e_n
    for e in rows:
        if e >= e_n:
            raise ValueError(f"replica routing: rank {rank}'s rows hold expert id {e} "
                             f"(>= {e_n} experts)")
        if e >= 0:
            per[e] += 1
    if per != mine:
        _mismatch(per, mine, rank)
    return balanced_share(project(cl, plan), plan, rank, rows, rounds)


def balanced_share(pc: list, plan: RoutingPlan, rank: int, rows: list, rounds: int = ROUNDS):
    """:func:`balanced_rows` from the projected counts ``pc`` [D][D + n] (:func:`project`; the
    serving path all-gathers these rows directly, D + n ints a rank instead of E), with no
    check that ``rows`` match ``pc[rank]``. For the few rows and small counts of a decode step:
    every numpy or torch call costs tens of microseconds when the expert GEMMs around it have
    evicted the caches; these short integer loops cost less."""
    d = plan.ep_size
    cols = [sum(col) for col in zip(*pc, strict=True)]
    load = cols[:d]                                           # single-replica experts per rank
    k_max = plan.slot_of.shape[1]
    xs = []
    for t, (_, k, ranks) in zip(cols[d:], plan.flex_info, strict=True):   # the even start
        q, rem = divmod(t, k)
        x = [q + 1] * rem + [q] * (k - rem) + [0] * (k_max - k)
        for j in range(k):
            load[ranks[j]] += x[j]
        xs.append(x)
    if xs and not _augment(load, xs, plan.rank_adj, max(1, int(rounds)) * (d + len(xs))):
        a = np.array(pc, dtype=np.int64)
        xs = _capped(xs, load, a[:, d:], a[:, :d].sum(axis=0), plan).tolist()
    base = [sum(col) for col in zip(*pc[:rank], strict=True)][d:] if rank else [0] * len(xs)
    slots, send = _rows_loop(rows, base, xs, plan)
    return slots, send, _recv(pc, xs, plan, rank)


def _rows_loop(rows: list, base: list, xs: list, plan: RoutingPlan):
    """The assignment one row at a time: (slots list, send [D]). ``base[i]``: where this
    source's run of flexible expert i starts; a -1 row stays -1."""
    s = plan.phy2log.size // plan.ep_size
    fidx, first, fsl = plan.flex_index, plan.first_slot, plan.flex_slots_l
    pos: dict = {}
    ends: dict = {}
    out = []
    send = [0] * plan.ep_size
    for e in rows:
        if e < 0:
            out.append(-1)
            continue
        i = fidx[e]
        if i < 0:
            p = first[e]
        else:
            q = pos.get(i)
            if q is None:
                q = base[i]
                acc, en = 0, []
                for v in xs[i]:
                    acc += v
                    en.append(acc)
                ends[i] = en
            en, j = ends[i], 0
            while q >= en[j]:
                j += 1
            pos[i] = q + 1
            p = fsl[i][j]
        out.append(p)
        send[p // s] += 1
    return out, send


def _rows_numpy(flat: np.ndarray, per: np.ndarray, base: np.ndarray, xs: list,
                plan: RoutingPlan):
    """:func:`balanced_rank`'s assignment, vectorised: (slots int64 [N], send [D])."""
    k = plan.slot_of.shape[1]
    ends = np.full((plan.num_logical, k), _BIG, dtype=np.int64)   # end of each replica's run
    if plan.flex_e.size:
        ends[plan.flex_e] = np.cumsum(np.asarray(xs, dtype=np.int64).reshape(-1, k), axis=1)
    order = np.argsort(flat, kind="stable")
    occ = np.empty_like(flat)
    occ[order] = np.arange(flat.size) - (np.cumsum(per) - per)[flat[order]]
    pos = base[flat] + occ                                    # position on the expert's line
    slots = plan.slot_of[flat, (pos[:, None] >= ends[flat]).sum(axis=1)]
    d = plan.ep_size
    return slots, np.bincount(slots // (plan.phy2log.size // d), minlength=d).tolist()


def _recv(pc: list, xs: list, plan: RoutingPlan, rank: int) -> list:
    """Rows each source sends to ``rank``, from the projected counts ``pc`` [D][D + n]
    (:func:`project`): its tokens of ``rank``'s single-replica experts, plus the overlap of its
    run of each flexible expert with the run of that expert's replica on ``rank``."""
    d = plan.ep_size
    recv = [row[rank] for row in pc]
    for i, j, _ in plan.rank_flex[rank]:
        x = xs[i]
        lo = sum(x[:j])
        hi = lo + x[j]
        if hi == lo:
            continue
        start = 0
        for q, row in enumerate(pc):
            end = start + row[d + i]
            if end > lo:
                recv[q] += (end if end < hi else hi) - (start if start > lo else lo)
                if end >= hi:
                    break
            start = end
    return recv
