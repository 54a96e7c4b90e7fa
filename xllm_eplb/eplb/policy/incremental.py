"""`incremental`: migration-aware placement (this project's policy, beyond xLLM).

Per round, starting from the table the policy believes is deployed:
1. free the slots that repeat an expert on the same rank (only xLLM's initial layout has them);
2. replica counts: keep the current counts, fill free slots by min-max (largest per-replica
   load first), then move single replicas from the expert that loses least to the expert with the
   largest per-replica load while that exceeds the min-max optimum by more than ``count_slack``;
3. remove surplus replicas from the most loaded ranks, place missing ones LPT-style into the
   freed slots (least-loaded rank that does not hold the expert);
4. swap local search on the most loaded rank (``localsearch.swap_search``); a swap is scored by
   the new max of the two ranks plus ``move_cost`` x ideal rank load per newly moved slot
   (EasyBalance: benefit - migration cost; slots that already moved this round are free). Below
   ``must = (1 + must_slack) x LB`` the cost counts fully, above it only breaks ties; the search
   stops at ``(1 + target_slack) x LB``, LB = ``max(ideal, min-max per-replica load)``;
5. the move sequence is cut where ``peak reduction - move_cost x ideal x moved slots`` is best,
   among the points at or below ``must`` when one is reached;
6. a layer still above ``must`` is also planned from scratch (min-max counts, LPT, the same
   search, slot stabilisation); that plan wins only when its benefit minus cost is higher.
With ``budget_slots > 0`` (or ``budget_bytes`` / ``slot_bytes``) the cross-rank copies of one round
are capped over all layers and spent where they buy the most peak reduction per slot.
"""

from __future__ import annotations

import logging

import numpy as np

from xllm_eplb.eplb.balance import rank_loads_from_phy2log
from xllm_eplb.eplb.placement import initial_phy2log
from xllm_eplb.eplb.policy.base import EplbPolicyBase
from xllm_eplb.eplb.policy.localsearch import slot_values, swap_search
from xllm_eplb.eplb.policy.packing import (
    cyclic_fallback,
    pack_sequences,
    select_replicas_max_load,
    stabilize_slots,
)

log = logging.getLogger(__name__)


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
    cur = np.bincount(t[present], minlength=w_row.size)
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
        row = t[i][t[i] >= 0]
        if (np.bincount(row, minlength=num_e) > c[i]).any():
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
    return t, ok


class IncrementalPolicy(EplbPolicyBase):
    """Options: ``budget_slots`` (moved slots per round over all layers, 0 = auto: cost-based),
    ``budget_bytes`` + ``slot_bytes`` (the same in bytes), ``move_cost`` (fraction of the ideal
    rank load one moved slot costs), ``target_slack``, ``must_slack``, ``count_slack``
    (see the module doc), ``max_iters`` (search iterations, 0 = 8 x slots)."""

    name = "incremental"

    def __init__(self, ep_size, num_logical, redundant, min_improvement=0.05, *,
                 budget_slots: int = 0, budget_bytes: int = 0, slot_bytes: int = 0,
                 move_cost: float = 2e-4, target_slack: float = 2e-3, must_slack: float = 4e-3,
                 count_slack: float = 0.02, max_iters: int = 0, **opts):
        opts.pop("num_nodes", None)
        opts.pop("num_groups", None)
        super().__init__(ep_size, num_logical, redundant, min_improvement, **opts)
        if budget_bytes and slot_bytes:
            budget_slots = max(1, int(budget_bytes) // int(slot_bytes))
        self.budget_slots = int(budget_slots)
        self.move_cost, self.target_slack = float(move_cost), float(target_slack)
        self.count_slack, self.must_slack = float(count_slack), float(must_slack)
        self.max_iters = int(max_iters) or 8 * self.num_slots
        self.last_stats: dict = {}

    def plan_layers(self, loads, prev):
        w = np.asarray(loads, dtype=np.float64)
        n, num_e = w.shape
        d, s = self.ep_size, self.slots
        base = np.asarray(prev, dtype=np.int64).copy()
        unseeded = (base < 0).any(axis=1)
        base[unseeded] = initial_phy2log(num_e, d, self.redundant)
        t0 = dedup_ranks(base.reshape(n, d, s))
        c0 = np.stack([np.bincount(row[row >= 0], minlength=num_e) for row in t0.reshape(n, -1)])
        free = (t0 < 0).sum(axis=(1, 2))
        c_opt = select_replicas_max_load(w, self.num_slots - num_e, d)
        c = adjust_counts(w, c0, free, d, c_opt, self.count_slack)
        ideal = w.sum(axis=1) / d
        lb = np.maximum(ideal, (w / c_opt).max(axis=1))
        target = lb * (1 + self.target_slack)
        must = lb * (1 + self.must_slack)
        slot_cost = self.move_cost * ideal
        base2 = base.reshape(n, d, s)
        strict = ~(t0 < 0).any(axis=(1, 2))           # base itself obeys one replica per rank
        # NOTE: keeping a base with same-rank duplicates (xLLM's initial layout) is allowed: it is
        # what is deployed; every table this policy emits is strict.
        cur = rank_loads_from_phy2log(base, w, d).max(axis=1)
        rep = t0.copy()
        ok = np.ones(n, dtype=bool)
        todo = np.nonzero(~(strict & (c == c0).all(axis=1)))[0]   # steady state: nothing to do
        if todo.size:
            rep[todo], ok[todo] = repair(w[todo], t0[todo], c[todo])
        traj = [[(0, cur[i])] for i in range(n)]     # point 0 = keep the deployed table
        swaps: list[list] = [[] for _ in range(n)]
        idx = np.nonzero(ok)[0]
        if idx.size:
            sub = rep[idx].copy()
            rep_pk = slot_values(sub, w[idx], c[idx]).sum(axis=2).max(axis=1)
            rep_mv = (sub != base2[idx]).sum(axis=(1, 2))
            _, sw = swap_search(sub, w[idx], c[idx].copy(), target[idx], slot_cost[idx],
                                self.max_iters, base=base2[idx], must=must[idx])
            for j, i in enumerate(idx):
                swaps[i] = sw[j]
                traj[i] += [(int(rep_mv[j]), float(rep_pk[j]))] + [(x[4], x[3]) for x in sw[j]]
        if self.budget_slots > 0:
            pos = spend_budget(traj, self.budget_slots)
        else:
            pos = [best_cut(t, cur[i], slot_cost[i], must[i]) for i, t in enumerate(traj)]
        out: list[np.ndarray | None] = []
        for i in range(n):
            k = pos[i] - 1                            # index into [repair, swap 1, swap 2, ...]
            if k < 0:
                out.append(None)
                continue
            t = rep[i].reshape(-1).copy()
            out.append(replay(t, swaps[i][:k]))
        n_scratch = 0
        if self.budget_slots <= 0:
            n_scratch = self._try_scratch(w, base, out, traj, pos, cur, must, slot_cost, c_opt)
        self.last_stats = dict(scratch_layers=n_scratch)
        return out

    def _try_scratch(self, w, base, out, traj, pos, cur, must, slot_cost, c_opt) -> int:
        """Replace layers whose peak stays above ``must`` by a from-scratch plan when its benefit
        minus its migration cost is higher. Returns the number of layers replaced."""
        n = w.shape[0]
        d = self.ep_size
        got = np.array([traj[i][pos[i]][1] if pos[i] >= 0 else np.inf for i in range(n)])
        redo = np.nonzero(got > must)[0]
        if redo.size == 0:
            return 0
        scr, spk = self._scratch(w[redo], c_opt[redo], must[redo] / (1 + self.must_slack) *
                                 (1 + self.target_slack))
        scr = stabilize_slots(scr.reshape(redo.size, -1), base[redo], d)
        replaced = 0
        for j, i in enumerate(redo):
            mv = int((scr[j] != base[i]).sum())
            have = -np.inf if pos[i] < 0 else cur[i] - got[i] - slot_cost[i] * traj[i][pos[i]][0]
            if cur[i] - spk[j] - slot_cost[i] * mv > have:
                out[i] = scr[j]
                replaced += 1
        return replaced

    def _scratch(self, w, counts, target):
        """From-scratch plan: min-max counts, LPT by per-replica load, swap search.
        Returns (tables int64 [k, D, S], peaks [k])."""
        k, num_e = w.shape
        d, s = self.ep_size, self.slots
        items = np.stack([np.repeat(np.arange(num_e), counts[i]) for i in range(k)])
        per = np.take_along_axis(w, items, 1) / np.take_along_axis(counts, items, 1)
        order = np.argsort(-per, axis=1, kind="stable")
        items = np.take_along_axis(items, order, 1)
        table, packed = pack_sequences(items, np.take_along_axis(per, order, 1), d, s, num_e)
        for i in np.nonzero(~packed)[0]:
            table[i] = cyclic_fallback(w[i], counts[i], d, s)
        table = table.reshape(k, d, s)
        pk, _ = swap_search(table, w, counts.copy(), target, np.zeros(k), self.max_iters)
        return table, pk


def replay(table: np.ndarray, moves) -> np.ndarray:
    """Apply local-search moves ``(kind, x, y, ...)`` to a flat table [D*S] (in place)."""
    for kind, x, y, *_ in moves:
        if kind == 0:
            table[x], table[y] = table[y], table[x]
        else:
            table[x] = y
    return table


def best_cut(traj: list[tuple[int, float]], cur: float, slot_cost: float, must: float) -> int:
    """Index on ``[(moved_slots, peak), ...]`` maximising ``cur - peak - slot_cost * moved``
    among the points from the first one whose peak <= must (all points if none reaches it).
    -1 for an empty trajectory."""
    if not traj:
        return -1
    pk = np.array([p for _, p in traj])
    mv = np.array([m for m, _ in traj], dtype=np.float64)
    reach = np.nonzero(pk <= must)[0]
    start = int(reach[0]) if reach.size else 0
    val = cur - pk[start:] - slot_cost * mv[start:]
    return start + int(np.argmax(val))


def spend_budget(traj: list[list[tuple[int, float]]], budget: int) -> list[int]:
    """Pick one point per layer on its trajectory ``[(moved_slots, peak), ...]`` (point 0 = keep
    the deployed table) so that the total moved slots stay within ``budget``, greedily by peak
    reduction per moved slot (best chunk first, ties: lowest layer)."""
    pos = [0] * len(traj)
    left = budget

    def chunk(i):
        """(gain per slot, target point, cost) of layer i's best affordable next chunk."""
        t, p = traj[i], pos[i]
        best = (0.0, -1, 0)
        for q in range(p + 1, len(t)):
            cost = t[q][0] - t[p][0]
            if cost > left:
                continue
            gain = (t[p][1] - t[q][1]) / max(cost, 1)
            if gain > best[0]:
                best = (gain, q, max(cost, 0))
        return best

    cache = [chunk(i) for i in range(len(traj))]
    while True:
        i = max(range(len(traj)), key=lambda j: (cache[j][0], -j), default=-1)
        if i < 0 or cache[i][1] < 0 or cache[i][0] <= 0:
            break
        _, q, cost = cache[i]
        left -= cost
        pos[i] = q
        cache = [chunk(j) if j == i or cache[j][2] > left else cache[j]
                 for j in range(len(traj))]
    return pos
