"""`incremental`: migration-aware placement (this project's policy, beyond xLLM).

Per round, starting from the deployed table; LB = ``max(ideal,
min-max per-replica load)`` per layer:
1. free the slots that repeat an expert on the same rank (only xLLM's initial layout has them)
   and fill them (``repair``: min-max replica counts, LPT into the freed slots). Such a *fresh*
   layer is planned down to ``target = (1 + target_slack) x LB``;
2. hysteresis for a *deployed* layer (strict table): it is left alone unless its peak exceeds
   ``(1 + trigger) x LB``, and then fixed only down to ``(1 + settle) x LB`` -- the balance it
   needs, not the best one. ``settle = max(settle_slack, noise)``, ``trigger = max(trigger_slack,
   settle + noise)``, ``noise = noise_z / sqrt(ideal rank load)`` for integer token counts (the
   sampling noise of a rank's load: re-planning below it only chases noise);
3. ``excess.excess_search``: per layer, the move with the largest reduction of the excess over
   the target (``sum_d max(0, R_d - T)``) per newly moved slot, anchored on the most loaded
   rank: swaps (2 slots) and, with ``rewrite_moves``, single-slot replica rewrites; a move must
   gain more than ``move_cost`` x ideal rank load per slot (EasyBalance: benefit - migration
   cost) on deployed layers; the search stops as soon as the layer is within its target;
4. a fresh layer the excess search leaves above ``must = (1 + must_slack) x LB`` also gets the
   xLLM-style swap search (``localsearch.swap_search``) from its result and from the repaired
   table; the lowest peak wins;
5. the move sequence is cut where ``peak reduction - move_cost x ideal x moved slots`` is best,
   among the points at or below the layer's target (``must`` for fresh layers) when one is
   reached; with ``budget_slots > 0`` (or ``budget_bytes`` / ``slot_bytes``) the slots of one
   round are capped over all layers and spent where they buy the most peak reduction per slot;
6. a layer still above ``must`` and its trigger is also planned from scratch (min-max counts, LPT,
   swap search, slot stabilisation); that plan wins only when its benefit minus cost is higher;
7. without a slot budget, a fresh layer is never worse than the ``balanced`` or ``greedy``
   policy's plan of the same load by more than ``must_slack`` x LB (0.4%): a layer above
   ``must`` also gets both peers' plans and the lowest peak wins (ties: this policy's own plan;
   with ``budget_slots`` the budget rules, peers' plans move too much); a layer within ``must``
   skips them (a peer's peak is >= LB, so it could win by ``must_slack`` at most, and the two
   packings cost as much as the rest of a fresh plan: on the DeepSeek dumps no layer at EP32 and
   EP64 and 5 of 58 at EP128 need them). The noise floor of step 2 never applies to a fresh
   layer (it is planned to ``target``).

Noise-aware placement (``peak_z > 0`` with ``step_tokens``): every step above plans on
``noise_aware.noise_weights`` (each expert's expected per-step count plus ``peak_z`` standard
deviations) instead of the mean load, i.e. for the expected per-step peak; the hysteresis noise
floor still uses the raw load.
"""

from __future__ import annotations

import logging

import numpy as np

from xllm_eplb.eplb.balance import rank_loads_from_phy2log
from xllm_eplb.eplb.placement import apply_moves as replay
from xllm_eplb.eplb.placement import replica_counts, undo_swaps
from xllm_eplb.eplb.policy.balanced import balanced_items, finish_balanced, plan_balanced
from xllm_eplb.eplb.policy.base import EplbPolicy
from xllm_eplb.eplb.policy.excess import excess_search
from xllm_eplb.eplb.policy.greedy import greedy_items, plan_greedy
from xllm_eplb.eplb.policy.localsearch import slot_values, swap_search
from xllm_eplb.eplb.policy.noise_aware import noise_weights
from xllm_eplb.eplb.policy.packing import (
    cyclic_fallback,
    fast_path_ok,
    lpt_pack,
    pack_sequences,
    select_replicas_max_load,
    stabilize_slots,
)
from xllm_eplb.eplb.policy.repair import adjust_counts, dedup_ranks, repair
from xllm_eplb.eplb.policy.trajectory import best_cut, spend_budget
from xllm_eplb.errors import ConfigError

__all__ = ["IncrementalPolicy", "best_cut", "dedup_ranks", "replay", "spend_budget"]

log = logging.getLogger(__name__)


class IncrementalPolicy(EplbPolicy):
    """Options: ``budget_slots`` (moved slots per round over all layers, 0 = auto: cost-based),
    ``budget_bytes`` + ``slot_bytes`` (the same in bytes), ``move_cost`` (fraction of the ideal
    rank load one moved slot costs), ``target_slack``, ``must_slack``, ``count_slack``,
    ``trigger_slack``, ``settle_slack``, ``noise_z`` (0 = no noise floor), ``rewrite_moves``
    (None = only on deployed layers where one replica exceeds the target; see the module doc),
    ``max_iters`` (search iterations, 0 = 8 x slots), ``cold_slack`` (a deployed layer whose
    peak exceeds ``(1 + cold_slack) x LB`` is planned like a fresh one, from its deployed table:
    a host engine's strict initial layout; 0 = off), ``peak_z`` + ``step_tokens``
    (noise-aware placement: sigma multiple >= 0, 0 = plan on the mean; routed tokens, top-k
    occurrences, per forward step over all ranks, > 0 when ``peak_z`` > 0)."""

    name = "incremental"

    def __init__(self, ep_size, num_logical, redundant, slots=None, *, budget_slots: int = 0,
                 budget_bytes: int = 0, slot_bytes: int = 0, move_cost: float = 2e-4,
                 target_slack: float = 2e-3, must_slack: float = 4e-3, count_slack: float = 0.02,
                 max_iters: int = 0, trigger_slack: float = 0.02, settle_slack: float = 0.009,
                 noise_z: float = 2.5, rewrite_moves=None, peak_z: float = 0.0,
                 step_tokens: float = 0.0, cold_slack: float = 0.0):
        super().__init__(ep_size, num_logical, redundant, slots)
        self.peak_z, self.step_tokens = _check_noise_aware(peak_z, step_tokens)
        if budget_bytes and slot_bytes:
            budget_slots = max(1, int(budget_bytes) // int(slot_bytes))
        for key, val in (("trigger_slack", trigger_slack), ("settle_slack", settle_slack),
                         ("target_slack", target_slack)):
            if not 0.0 <= float(val) < 1.0:
                raise ConfigError(f"incremental {key}={val}: must be in [0, 1)")
        if float(settle_slack) > float(trigger_slack):
            raise ConfigError(f"incremental settle_slack={settle_slack} must be <= "
                              f"trigger_slack={trigger_slack}")
        self.budget_slots = int(budget_slots)
        self.move_cost, self.target_slack = float(move_cost), float(target_slack)
        self.count_slack, self.must_slack = float(count_slack), float(must_slack)
        self.trigger_slack, self.settle_slack = float(trigger_slack), float(settle_slack)
        self.rewrite_moves = None if rewrite_moves is None else bool(rewrite_moves)
        self.noise_z = float(noise_z)
        self.cold_slack = float(cold_slack)
        if self.cold_slack < 0:
            raise ConfigError(f"incremental cold_slack={cold_slack}: must be >= 0 (0 = off)")
        self.max_iters = int(max_iters) or 8 * self.num_slots
        self.last_stats: dict = {}       # diagnostics of the latest plan() (bench, tests)

    def plan(self, logical, deployed):
        raw = np.asarray(logical, dtype=np.float64)
        w = noise_weights(raw, self.step_tokens, self.peak_z) if self.peak_z > 0 else raw
        n, num_e = w.shape
        d, s = self.ep_size, self.slots
        base = np.asarray(deployed, dtype=np.int64).copy()
        unseeded = (base < 0).any(axis=1)
        base[unseeded] = self.initial_row()
        t0 = dedup_ranks(base.reshape(n, d, s))
        c0 = replica_counts(t0.reshape(n, -1), num_e)          # free slots (-1) not counted
        free = (t0 < 0).sum(axis=(1, 2))
        c_opt = select_replicas_max_load(w, self.num_slots - num_e, d)
        # NOTE: a deployed strict layer keeps its replica counts here; only the excess search's
        # single-slot rewrites change them (see `_search` and ``rewrite_moves``).
        # base itself obeys one replica per rank (a layer with nothing deployed never counts: its
        # replica counts are planned, whatever the initial layout holds)
        strict = ~(t0 < 0).any(axis=(1, 2)) & ~unseeded
        ideal = w.sum(axis=1) / d
        lb = np.maximum(ideal, (w / c_opt).max(axis=1))
        if self.cold_slack > 0:    # a deployed layer far off its bound: a cold start, plan it fresh
            cold = rank_loads_from_phy2log(base, w, d).max(axis=1) > lb * (1 + self.cold_slack)
            strict &= ~cold
        c = adjust_counts(w, c0, free, d, c_opt, self.count_slack)
        c[strict] = c0[strict]
        fresh = ~strict | unseeded
        # hysteresis: a deployed layer is re-planned only above `trigger`, and then only down to
        # `settle`; a layer coming from xLLM's initial layout is planned down to `target`
        settle, trigger = self._hysteresis(logical, raw.sum(axis=1) / d)
        target = np.where(fresh, lb * (1 + self.target_slack), lb * (1 + settle))
        start = np.where(fresh, target, lb * (1 + trigger))
        slot_cost = self.move_cost * ideal
        base2 = base.reshape(n, d, s)
        # NOTE: keeping a base with same-rank duplicates (xLLM's initial layout) is allowed: it is
        # what is deployed; every table this policy emits is strict.
        cur = rank_loads_from_phy2log(base, w, d).max(axis=1)
        rep = t0.copy()
        ok = np.ones(n, dtype=bool)
        # a layer with nothing deployed starts from the LPT packing of the min-max counts: no
        # slot of it is deployed, so no move costs anything (the search then starts near target)
        lpt = np.zeros(n, dtype=bool)
        if unseeded.any():
            u = np.nonzero(unseeded)[0]
            packed, lpt[u] = lpt_pack(w[u], c_opt[u], d, s)
            c[u[lpt[u]]] = c_opt[u[lpt[u]]]
            rep[u[lpt[u]]] = packed[lpt[u]].reshape(-1, d, s)
        todo = np.nonzero(~(strict & (c == c0).all(axis=1)) & ~lpt)[0]   # steady state: nothing
        if todo.size:
            rep[todo], ok[todo] = repair(w[todo], t0[todo], c[todo])
        # point 0 = keep the deployed table; a layer with nothing deployed has no table to keep
        # (its seed is an initial layout nobody deployed): point 0 can never win there
        traj = [[(0, np.inf if unseeded[i] else cur[i])] for i in range(n)]
        moves: list[list] = [[] for _ in range(n)]
        idx = np.nonzero(ok & (fresh | (cur > start)))[0]
        n_fb = 0
        if idx.size:
            sub = rep[idx].copy()
            self._add_points(traj, idx, sub, w, c, base2)
            mv, n_fb = self._search(sub, w[idx], c[idx], base2[idx], fresh[idx], target[idx],
                                    start[idx], lb[idx], slot_cost[idx])
            self._add_moves(traj, moves, idx, mv)
        if self.budget_slots > 0:
            pos = spend_budget(traj, self.budget_slots)
        else:
            cut = np.where(fresh, lb * (1 + self.must_slack), target)
            pos = [best_cut(t, cur[i], slot_cost[i], cut[i]) for i, t in enumerate(traj)]
        out = _cut_tables(rep, moves, pos)
        n_scratch = 0
        if self.budget_slots <= 0:
            must = np.maximum(lb * (1 + self.must_slack), start)
            n_scratch = self._try_scratch(w, base, out, traj, pos, cur, must, slot_cost, c_opt)
        n_peer = 0
        if self.budget_slots <= 0:               # a slot budget caps the moves: no peer plan
            n_peer = self._peer_pass(logical, w, base, out, fresh, lb)
        n_filled = self._fill_unseeded(out, unseeded, rep, ok, w, c)
        self.last_stats = dict(scratch_layers=n_scratch, searched_layers=int(idx.size),
                               fresh_fallback_layers=n_fb, peer_plan_layers=n_peer,
                               filled_layers=n_filled)
        return out

    def _peer_pass(self, logical, w, base, out: list, fresh, lb) -> int:
        """The peers' plans of the fresh layers still above ``must`` (in place on ``out``);
        returns how many layers a peer plan replaced. A peer's peak is >= LB, so a layer at or
        below ``must`` (LB x (1 + must_slack)) cannot lose more than must_slack to one: the
        peers plan only the rest."""
        n = len(out)
        own = np.array([np.inf if out[i] is None else 0.0 for i in range(n)])
        have = np.nonzero(np.isfinite(own))[0]
        if have.size:
            own[have] = rank_loads_from_phy2log(np.stack([out[i] for i in have]), w[have],
                                                self.ep_size).max(axis=1)
        miss = fresh & (own > lb * (1 + self.must_slack))
        return self._never_worse_than_peers(w if self.peak_z > 0 else logical, w, base, out,
                                            np.nonzero(miss)[0])

    def _fill_unseeded(self, out, unseeded, rep, ok, w, c) -> int:
        """The fresh-plan contract: a layer with nothing deployed (``-1`` row) always gets a full
        valid table, never "keep" (a uniform or all-zero layer is already as balanced as its
        repaired table, so the search keeps it): the repaired table, else the cyclic layout of
        its replica counts. Returns the number of layers filled here."""
        filled = 0
        for i in np.nonzero(unseeded)[0]:
            if out[i] is not None:
                continue
            row = rep[i].reshape(-1) if ok[i] else cyclic_fallback(w[i], c[i], self.ep_size,
                                                                  self.slots)
            if row is None or (row < 0).any():
                row = plan_greedy(w[i][None, :], self.ep_size, self.slots)[0]
            out[i] = np.asarray(row, dtype=np.int64).copy()
            filled += 1
        return filled

    def _never_worse_than_peers(self, logical, w, base, out, idx) -> int:
        """Step 7: for the fresh layers ``idx``, replace ``out[i]`` (in place) by the
        ``balanced`` or ``greedy`` plan of the same load when its peak (even split, on ``w``) is
        strictly lower; greedy's plan is slot-stabilised against the base. Returns the number of
        layers replaced. (Vectorised over the layers: one peak computation per candidate.)"""
        if idx.size == 0:
            return 0
        d, s = self.ep_size, self.slots
        lg = np.asarray(logical)[idx]
        own = np.stack([base[i] if out[i] is None else out[i] for i in idx])
        best_pk = rank_loads_from_phy2log(own, w[idx], d).max(axis=1)
        best = np.full(idx.size, -1)
        rows = peer_plans(lg, base[idx], d, s)
        tables = []
        for k, cand in enumerate(rows):
            have = np.array([r is not None for r in cand])
            tab = np.stack([own[j] if r is None else r for j, r in enumerate(cand)])
            if k == 1 and have.any():
                tab[have] = stabilize_slots(tab[have], base[idx][have], d)
            pk = rank_loads_from_phy2log(tab, w[idx], d).max(axis=1)
            win = have & (pk < best_pk)
            best[win], best_pk[win] = k, pk[win]
            tables.append(tab)
        for j in np.nonzero(best >= 0)[0]:
            out[idx[j]] = tables[best[j]][j].astype(np.int64)
        return int((best >= 0).sum())

    def _search(self, sub, w, c, base, fresh, target, start, lb, slot_cost):
        """Moves for the layers of ``sub`` [k, D, S] (the repaired tables; other args [k, ...]).
        Returns (moves per layer, number of fresh layers that took the swap fallback)."""
        k = sub.shape[0]
        # rewrites (replica count changes) where one replica alone exceeds the target: swaps
        # cannot fix such a layer (``rewrite_moves`` None = there only, True/False = all/none)
        rw = np.full(k, bool(self.rewrite_moves)) if self.rewrite_moves is not None else \
            (w / np.maximum(c, 1)).max(axis=1) > target
        rw &= ~fresh                                 # fresh layers got min-max counts already
        pk = np.zeros(k)
        mv: list = [None] * k
        for grp in (np.nonzero(rw)[0], np.nonzero(~rw)[0]):
            if grp.size == 0:
                continue
            t = sub[grp]
            pk[grp], m = excess_search(t, w[grp], c[grp].copy(), target[grp], self.max_iters,
                                       base=base[grp], start=np.minimum(start, target)[grp],
                                       min_gain=np.where(fresh[grp], 0.0, slot_cost[grp]),
                                       rewrites=bool(rw[grp[0]]))
            sub[grp] = t
            for j, x in enumerate(grp):
                mv[x] = m[j]
        # fresh layers the excess search left above `must`: the xLLM-style swap search (the slot
        # cost only breaks ties above `must`) (a) from the excess result, (b) from the repaired
        # table; the lowest peak wins
        must = lb * (1 + self.must_slack)
        redo = np.nonzero(fresh & (pk > must))[0]
        if redo.size == 0:
            return mv, 0
        pa, ma = swap_search(sub[redo], w[redo], c[redo].copy(), target[redo], slot_cost[redo],
                             self.max_iters, base=base[redo], must=must[redo])
        rep0 = sub[redo].copy()
        for j, x in enumerate(redo):                 # undo the excess moves: the repaired table
            rep0[j] = undo_swaps(rep0[j], mv[x])
        pb, mb = swap_search(rep0, w[redo], c[redo].copy(), target[redo], slot_cost[redo],
                             self.max_iters, base=base[redo], must=must[redo])
        for j, x in enumerate(redo):
            best = min((pk[x], 0), (pa[j], 1), (pb[j], 2))[1]
            mv[x] = [mv[x], mv[x] + ma[j], mb[j]][best]
        return mv, int(redo.size)

    def _hysteresis(self, loads, ideal):
        """Per-layer (settle, trigger) slacks [L]. With integer token counts a rank's load has
        sampling noise ~ sqrt(load): a deployed layer is not chased below ``noise_z`` relative
        standard deviations of the ideal rank load (settle), nor re-planned unless its peak is
        another ``noise_z`` deviations above that (trigger)."""
        settle = np.full(ideal.shape, self.settle_slack)
        trigger = np.full(ideal.shape, self.trigger_slack)
        if self.noise_z > 0 and np.asarray(loads).dtype.kind in "iu":
            rel = self.noise_z / np.sqrt(np.maximum(ideal, 1.0))
            settle = np.maximum(settle, rel)
            trigger = np.maximum(trigger, settle + rel)
        return settle, trigger

    @staticmethod
    def _add_points(traj, grp, sub, w, c, base2) -> None:
        """Append the repaired table (before any search move) to the layers' trajectories."""
        pk = slot_values(sub, w[grp], c[grp]).sum(axis=2).max(axis=1)
        mv = (sub != base2[grp]).sum(axis=(1, 2))
        for j, i in enumerate(grp):
            traj[i].append((int(mv[j]), float(pk[j])))

    @staticmethod
    def _add_moves(traj, moves, grp, mv) -> None:
        for j, i in enumerate(grp):
            moves[i] = mv[j]
            traj[i] += [(x[4], x[3]) for x in mv[j]]

    def _try_scratch(self, w, base, out, traj, pos, cur, must, slot_cost, c_opt) -> int:
        """Replace layers whose peak stays above ``must`` by a from-scratch plan when its benefit
        minus its migration cost is higher. Returns the number of layers replaced."""
        n = w.shape[0]
        d = self.ep_size
        got = np.array([traj[i][pos[i]][1] if pos[i] >= 0 else np.inf for i in range(n)])
        redo = np.nonzero(got > must)[0]
        if redo.size == 0:
            return 0
        ideal = w[redo].sum(axis=1) / d
        lb = np.maximum(ideal, (w[redo] / c_opt[redo]).max(axis=1))
        scr, spk = self._scratch(w[redo], c_opt[redo], lb * (1 + self.target_slack))
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
        k = w.shape[0]
        d, s = self.ep_size, self.slots
        table = lpt_pack(w, counts, d, s)[0].reshape(k, d, s)
        pk, _ = swap_search(table, w, counts.copy(), target, np.zeros(k), self.max_iters)
        return table, pk


def peer_plans(lg: np.ndarray, prev: np.ndarray, d: int, s: int) -> list[list]:
    """[balanced's rows, greedy's rows] for loads ``lg`` [k, E] (each a list of [D*S] or None).
    Both packings run as ONE ``pack_sequences`` call over 2k layers (the packing costs one numpy
    pass per item whatever the layer count); balanced's integer packing loads are exact in
    float64 below ``EXACT_FLOAT_LIMIT``, so the decisions are those of the separate calls."""
    if not fast_path_ok(lg):
        return [plan_balanced(lg, prev, d, s), plan_greedy(lg, d, s)]
    bi, be, rc, ok_b = balanced_items(lg, d, s)
    gi, ge, ok_g = greedy_items(lg, d, s)
    k = lg.shape[0]
    table, packed = pack_sequences(np.concatenate([bi, gi]),
                                   np.concatenate([be.astype(np.float64), ge]), d, s,
                                   lg.shape[1])
    bal = finish_balanced(lg, prev, table[:k], packed[:k], rc, ok_b, d, s)
    gre = [table[k + i] if ok_g[i] and packed[k + i] else None for i in range(k)]
    return [bal, gre]


def _check_noise_aware(peak_z, step_tokens) -> tuple[float, float]:
    """Validated ``(peak_z, step_tokens)`` of the noise-aware option (ConfigError naming the
    option, the value and the rule)."""
    try:
        z, t = float(peak_z), float(step_tokens)
    except (TypeError, ValueError):
        raise ConfigError(f"incremental peak_z={peak_z!r}, step_tokens={step_tokens!r}: must be "
                          f"numbers") from None
    if not (np.isfinite(z) and z >= 0):
        raise ConfigError(f"incremental peak_z={peak_z}: must be a finite number >= 0")
    if not (np.isfinite(t) and t >= 0):
        raise ConfigError(f"incremental step_tokens={step_tokens}: must be a finite number >= 0")
    if z > 0 and t <= 0:
        raise ConfigError(f"incremental peak_z={peak_z} needs step_tokens > 0 (routed tokens, "
                          f"top-k occurrences, per forward step over all ranks), got "
                          f"{step_tokens}")
    return z, t


def _cut_tables(rep: np.ndarray, moves: list, pos: list) -> list[np.ndarray | None]:
    """Per layer the table at trajectory point ``pos[i]`` (0: keep the deployed one -> None;
    1: the repaired table ``rep[i]`` [D, S]; k > 1: it after the first k - 1 moves), flat
    int64 [D*S]."""
    out: list[np.ndarray | None] = []
    for i in range(len(pos)):
        k = pos[i] - 1                            # index into [repair, move 1, move 2, ...]
        out.append(None if k < 0 else replay(rep[i].reshape(-1).copy(), moves[i][:k]))
    return out
