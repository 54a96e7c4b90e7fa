"""The replica each routed token of one MoE layer goes to on this rank (``eplb_replica_routing``).

Input: the layer's logical top-k ids ``[T, k]`` of this rank's tokens (every row that is
dispatched, padding included). Output (:class:`Routed`): global physical slots ``[T, k]``, and,
when the step's counts were exchanged, the split sizes of the dispatch all_to_all (so that
exchange is skipped: the count exchange replaces it).

- ``static``: ``FusedMoE.log2phy`` (xLLM's ``r % logcnt[e]`` rule); no exchange.
- ``spread``: the rank's own counts only (``replica_routing.source_row`` of its row); no exchange.
- ``balanced``: one ``all_gather`` of the rank's counts on the EP group; every rank runs the
  same solve on the same gathered array and the layer's
  :class:`~xllm_eplb.eplb.replica_routing.RoutingPlan`, then takes its own share of it and the
  split sizes (rows it sends, rows it receives). A decode step at small EP gathers the projected
  counts (D + n ints a rank: per rank of single-replica experts, per flexible expert) and runs
  ``replica_routing.balanced_share`` on plain lists; larger steps gather the [D, E] counts and
  run ``replica_routing.balanced_rank``. Both give the same slots (tested).

Cost accounting (``stats.extra``): ``route_exchange_s`` wall seconds of the count all-gather
(also in ``stats.wait_s``), ``route_solve_s`` thread CPU seconds of the local count, the solve
and the assignment (independent of how the machine's cores are shared), ``cap_dropped`` /
``cap_rerouted`` rows.

NOTE (cross-rank rule): the mode, the placement behind the plan and the exchanged counts are the
only inputs of the solve; they are identical on every rank (the mode is config, the placement
activates at the same step everywhere, the counts are all-gathered), so every rank computes the
same assignment and split sizes with no further message. Whether a layer exchanges counts
depends on config only, never on the rank's batch, so the collectives always match.
"""

from __future__ import annotations

import time
from array import array
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from xllm_eplb.eplb import capacity
from xllm_eplb.eplb import replica_routing as rr

STATIC, SPREAD, BALANCED = rr.MODES


@dataclass
class Routed:
    """One layer's routing on one rank. ``phys`` int64 [T, k] global slots; ``splits`` =
    (rows sent to each rank [D], rows received from each rank [D]) when known from the
    exchanged counts, else None; ``counts`` int64 [D, E] the exchanged counts or None."""

    phys: torch.Tensor
    splits: tuple[list[int], list[int]] | None = None
    counts: np.ndarray | None = None


def local_counts(ids: torch.Tensor, num_logical: int) -> torch.Tensor:
    """Routed rows per logical expert of this rank: ids [T, k] -> int64 [E]."""
    return torch.bincount(ids.reshape(-1), minlength=num_logical).to(torch.int64)


def exchange_counts(mine: torch.Tensor, group, ep_size: int, stats) -> np.ndarray:
    """All-gather every rank's counts (int64 [E], or any int64 vector of one length on every
    rank, e.g. the projected counts [D + n]) on the EP group -> int64 [D, E] (row = rank).
    Blocking; its seconds go to ``stats.wait_s`` and ``stats.extra["route_exchange_s"]``.
    A 1-rank group exchanges nothing."""
    if ep_size == 1:
        return mine.reshape(1, -1).cpu().numpy()
    t = time.perf_counter()
    parts = [torch.empty_like(mine) for _ in range(ep_size)]
    dist.all_gather(parts, mine.contiguous(), group=group)
    out = torch.stack(parts).cpu().numpy()
    dt = time.perf_counter() - t
    stats.count_wait(dt)
    _add(stats, "route_exchange_s", dt)
    return out


def _add(stats, key: str, v: float) -> None:
    stats.extra[key] = stats.extra.get(key, 0.0) + v


def splits_of(full: np.ndarray, rank: int, ep_size: int) -> tuple[list[int], list[int]]:
    """Split sizes from the tokens-per-(source, slot) matrix ``full`` [D, D*S]: (rows this rank
    sends to each rank [D], rows it receives from each source [D])."""
    s = full.shape[1] // ep_size
    send = full[rank].reshape(ep_size, s).sum(axis=1)
    recv = full[:, rank * s:(rank + 1) * s].sum(axis=1)
    return send.tolist(), recv.tolist()


def _assign(moe, ids: torch.Tensor, row, plan, mode: str) -> torch.Tensor:
    """Global slots [T, k] of ids [T, k] (-1 = dropped, stays -1) from this source's row."""
    live = ids >= 0
    if mode == STATIC:
        return torch.where(live, moe.route(ids.clamp(min=0)), -1)
    a = ids.cpu().numpy()
    keep = a >= 0
    out = np.full(a.shape, -1, dtype=np.int64)
    out[keep] = rr.assign_tokens(a[keep].reshape(-1, 1), row, plan).ravel()
    return torch.from_numpy(out).to(ids.device)


def spread_slots(moe, ids: torch.Tensor) -> torch.Tensor:
    """``spread`` without the [D, D*S] matrix: the ``i``-th row (row-major order) of expert
    ``e`` on source ``r`` goes to replica ``(r + i) % count(e)``, which gives each replica exactly
    ``replica_routing.route(..., "spread")``'s share (``c // k`` plus one when ``(j - r) mod k <
    c mod k``). ids [T, k] (-1 = dropped, stays -1) -> global slots [T, k]."""
    plan = moe.routing_plan()
    if ids.numel() <= rr.ROWS_PY:                 # a decode step's few rows: plain lists
        seen = [0] * moe.num_logical
        out_l = []
        slot_of, cnt, r = plan.slot_lists, plan.cnt_l, moe.ep_rank
        for e in ids.reshape(-1).tolist():
            if e < 0:
                out_l.append(-1)
                continue
            i = seen[e]
            seen[e] = i + 1
            out_l.append(slot_of[e][(r + i) % cnt[e]])
        return _tensor(out_l, ids.device).view(ids.shape)
    flat = ids.cpu().numpy().ravel()
    live = flat >= 0
    e = flat[live]
    order = np.argsort(e, kind="stable")
    per = np.bincount(e, minlength=moe.num_logical)
    i = np.empty_like(e)
    i[order] = np.arange(e.size) - (np.cumsum(per) - per)[e[order]]
    out = np.full(flat.shape, -1, dtype=np.int64)
    out[live] = plan.slot_of[e, (moe.ep_rank + i) % plan.cnt[e]]
    return torch.from_numpy(out.reshape(ids.shape)).to(ids.device)


def local_counts_live(ids: torch.Tensor, num_logical: int) -> torch.Tensor:
    """Like :func:`local_counts`, ignoring dropped (-1) rows (numpy's bincount: a few
    microseconds where torch's costs tens on a decode step's few rows)."""
    flat = ids.reshape(-1).cpu().numpy()
    return torch.from_numpy(np.bincount(flat[flat >= 0], minlength=num_logical)
                            .astype(np.int64)).to(ids.device)


def _tensor(values: list, device: torch.device) -> torch.Tensor:
    """int64 tensor of a list of ints through ``array('q')`` + ``torch.frombuffer``: a few
    times cheaper than ``torch.tensor(list)`` when the caches are cold (measured)."""
    if not values:
        return torch.zeros(0, dtype=torch.int64, device=device)
    t = torch.frombuffer(array("q", values), dtype=torch.int64)
    return t if device.type == "cpu" else t.to(device)


def _route_balanced(moe, ids: torch.Tensor, group, stats, counts, plan) -> Routed:
    """``balanced``: count (unless ``counts`` are given), exchange, then this rank's share of
    the solve. A decode step's few rows at small EP go through plain lists: the rank counts its
    row of the projected counts (``replica_balance.project``: per rank of single-replica
    experts, then per flexible expert; D + n ints) straight from its rows, all-gathers those,
    and runs ``balanced_share``: one ``tolist`` in, one tensor out, where the numpy path makes
    dozens of library calls, each costing tens of microseconds once the expert GEMMs have
    evicted the caches. Otherwise the [D, E] counts and ``balanced_rank``. The local count, the
    solve and the assignment are timed; ``Routed.counts`` is the [D, E] counts when exchanged
    or given, else None."""
    t = time.thread_time()
    e_n, d = moe.num_logical, moe.ep_size
    small = ids.numel() <= rr.ROWS_PY and d * e_n <= rr.CELLS_PY
    rows = ids.reshape(-1).tolist() if small else None
    if small and counts is None:
        key = plan.proj_key
        mine = [0] * (d + plan.flex_e.size)
        for e in rows:
            if e >= 0:                   # -1: dropped by capacity (fallback re-routing)
                mine[key[e]] += 1
        _add(stats, "route_solve_s", time.thread_time() - t)
        gathered = exchange_counts(_tensor(mine, ids.device), group, d, stats)
        t = time.thread_time()
        slots, send, recv = rr.balanced_share(gathered.tolist(), plan, moe.ep_rank, rows)
    elif small:
        slots, send, recv = rr.balanced_rows(rr.check_counts(counts, plan).tolist(), plan,
                                             moe.ep_rank, rows)
    else:
        if counts is None:
            mine_t = local_counts_live(ids, e_n)
            _add(stats, "route_solve_s", time.thread_time() - t)
            counts = exchange_counts(mine_t, group, d, stats)
            t = time.thread_time()
        a = ids.cpu().numpy()
        keep = a >= 0
        out = np.full(a.shape, -1, dtype=np.int64)
        out[keep], send, recv = rr.balanced_rank(counts, plan, moe.ep_rank, a[keep])
        phys = torch.from_numpy(out).to(ids.device)
    if small:
        phys = _tensor(slots, ids.device).view(ids.shape)
    _add(stats, "route_solve_s", time.thread_time() - t)
    return Routed(phys, (send, recv), counts)


def route_layer(moe, ids: torch.Tensor, group, mode: str, stats,
                counts: np.ndarray | None = None) -> Routed:
    """Global slots of this rank's routed ids [T, k] (-1 = dropped by capacity, stays -1)
    under ``mode`` (see the module doc). ``counts``: the step's already exchanged [D, E] counts
    of these ids (every rank passes them or none does); ``balanced`` exchanges them itself when
    not given."""
    if mode not in rr.MODES:
        raise ValueError(f"eplb_replica_routing={mode!r} is not one of {', '.join(rr.MODES)}")
    if mode == STATIC and counts is None:
        return Routed(_assign(moe, ids, None, None, STATIC) if (ids < 0).any()
                      else moe.route(ids))
    plan = moe.routing_plan()
    if mode == SPREAD and counts is None:
        t = time.thread_time()
        phys = spread_slots(moe, ids)
        _add(stats, "route_solve_s", time.thread_time() - t)
        return Routed(phys)
    if mode == BALANCED:
        return _route_balanced(moe, ids, group, stats, counts, plan)
    if counts is None:
        counts = exchange_counts(local_counts_live(ids, moe.num_logical), group, moe.ep_size,
                                 stats)
    t = time.thread_time()
    full = rr.route(counts, plan, mode)
    phys = _assign(moe, ids, full[moe.ep_rank], plan, mode)
    splits = splits_of(full, moe.ep_rank, moe.ep_size)
    _add(stats, "route_solve_s", time.thread_time() - t)
    return Routed(phys, splits, counts)


def route_step(moe, ids: torch.Tensor, group, eplb_cfg, stats,
               next_ids: torch.Tensor | None = None) -> Routed:
    """One layer's routing with expert capacity (``moe_capacity_mode``) applied first.

    ``none``: :func:`route_layer` as it is. Otherwise the step's counts are exchanged once
    (all-gather [D, E]), every rank computes the same capacities and quotas
    (``eplb/capacity.py``), drops (or, with ``moe_fallback_routing`` and ``next_ids`` [T], the
    tokens' next choices, re-routes) its overflow rows, then routes the rest. Without fallback
    the kept counts are known on every rank, so they also give the split sizes; with fallback
    the re-routed rows are local knowledge, so ``balanced`` exchanges the final counts once
    more and static / spread use the ordinary split-size exchange.
    Every dispatched row takes capacity (graph-mode padding rows included).
    NOTE (cross-rank rule): whether a layer exchanges, and how often, depends on config only."""
    mode, cap_mode = eplb_cfg.eplb_replica_routing, eplb_cfg.moe_capacity_mode
    if cap_mode == "none":
        return route_layer(moe, ids, group, mode, stats)
    E, r = moe.num_logical, moe.ep_rank
    counts = exchange_counts(local_counts(ids, E), group, moe.ep_size, stats)
    t = time.thread_time()
    cap = capacity.capacity(counts.sum(axis=0), cap_mode, eplb_cfg.moe_capacity_factor)
    keep = capacity.keep_quota(counts, cap)
    fb = eplb_cfg.moe_fallback_routing and next_ids is not None
    room = capacity.room_quota(counts, cap)[r] if fb else None
    new, rerouted, dropped = capacity.fallback(
        ids.cpu().numpy(), next_ids.cpu().numpy() if fb else None, keep[r], room,
        keep.sum(axis=0))
    _add(stats, "cap_rerouted", rerouted)
    _add(stats, "cap_dropped", dropped)
    _add(stats, "route_solve_s", time.thread_time() - t)
    stats.extra["cap_last"] = cap
    ids2 = torch.from_numpy(new).to(ids.device)
    if not fb:
        return route_layer(moe, ids2, group, mode, stats, counts=keep)
    return route_layer(moe, ids2, group, mode, stats)
