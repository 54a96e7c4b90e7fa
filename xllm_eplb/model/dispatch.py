"""Dispatch/combine of routed tokens across the EP group, and the choice of path (spec §9).

Two paths, both built on ``all_to_all_single`` and both taking part in every layer even with
zero local tokens (split sizes are exchanged first with an all_to_all of counts, unless known:
see "Fewer rounds" below):

- ``plain``: all rows (the rank's own included) go through the all_to_all and are waited for
  before any compute; experts run on the received rows; results return by a blocking reverse
  all_to_all.
- ``fused`` (this project's overlapped path on CPU/CUDA): rows for local slots never leave the
  rank; the split-size exchange is posted with ``async_op=True`` and the local experts run while
  it is in flight; the remote rows are then posted async and the caller's ``overlap`` work (the
  shared expert) runs while they are in flight; then the received rows run and return.

Fewer rounds: a 1-rank group (EP1) runs no collective at all (the rows stay local). When
every rank knows every rank's dispatched row count of the step (``peer_rows``: the worker
reads them off the step's message) and the rows are packable and small
(:func:`padded_bounds`), the split-size exchange is dropped: the dispatch all_to_all carries
fixed-size blocks (rank r sends at most ``rows_r * k`` rows to any rank), the unused tail of a
block marked with slot -1, and the receiver reads its split sizes off the blocks. A layer then
costs two rounds (dispatch, combine) instead of three.

Shared-memory transport (``--ep_transport=shm``, issue #39): when the worker hands the layer an
``a2a`` (an ``ipc.alltoall.ShmAllToAll`` of the node's ranks; this module only calls its
``all_to_all(rows, send) -> (rows, got)``), both modes take :func:`_via_shm`: rows and their
metadata travel as one byte record per row (any dtype, one round), the split sizes travel with
them (no split-size round, no padding), the rank's own rows never leave it; a layer costs one
dispatch round and one combine round. ``fused``: the local experts and the shared expert
(``overlap``) run between posting the rows and reading the others'; ``plain``: all rows are
computed at once after the dispatch round, the shared expert after the combine.

Counters are receiver-observed in both paths: every dispatched row carries its local slot and a
``counted`` flag (0 for padding, fillers and masked prefill rows), and the slot's owner counts.
For float32/float64 the two metadata columns are packed into the row (one all_to_all per
direction); bfloat16 rows send them in a second all_to_all.

Mode resolution (:func:`resolve_dispatch_mode`) is a pure function of the config and a
step-level ``pure_decode`` flag.
NOTE: the decision must be identical on every rank or the collectives mismatch, so its inputs are
config values and the engine's step-level flag (and, for the padded dispatch, ``peer_rows``:
the same list on every rank), never the rank's own batch.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from xllm_eplb.model.moe import FusedMoE

log = logging.getLogger(__name__)

PLAIN, FUSED = "plain", "fused"


def resolve_fused_setting(expert_parallel_degree: int, enable_fused_mc2: int) -> int:
    """``enable_fused_mc2`` with auto (-1) resolved: 1 when ``expert_parallel_degree == 2``, else 0."""
    if enable_fused_mc2 == -1:
        return 1 if expert_parallel_degree == 2 else 0
    if enable_fused_mc2 not in (0, 1, 2):
        raise ValueError(f"enable_fused_mc2={enable_fused_mc2} must be -1, 0, 1 or 2")
    return enable_fused_mc2


def fused_precondition_failure(device: str, dtype: str, enable_graph: bool,
                               bf16_supported: bool = True) -> str | None:
    """Why the overlapped path cannot run here, or None if it can.

    - graph mode on an accelerator: the async collectives synchronise with the host and cannot
      be captured in a graph;
    - bfloat16 on a device without bf16 support (``bf16_supported`` = the device's answer).
    """
    if enable_graph and device != "cpu":
        return "graph mode cannot capture the async all_to_all"
    if dtype == "bfloat16" and not bf16_supported:
        return f"bfloat16 unsupported on device={device}"
    return None


def resolve_dispatch_mode(expert_parallel_degree: int, enable_fused_mc2: int, *,
                          pure_decode: bool, precondition_failure: str | None = None
                          ) -> tuple[str, str | None]:
    """-> (mode, fallback reason or None). A reason is returned only when a fused path was asked
    for this step and its preconditions failed (the caller logs it once).

    setting 0: plain; 1: fused; 2: fused only when the step is pure decode (else plain, which
    is not a fallback).
    """
    s = resolve_fused_setting(expert_parallel_degree, enable_fused_mc2)
    if s == 0 or (s == 2 and not pure_decode):
        return PLAIN, None
    if precondition_failure:
        return PLAIN, precondition_failure
    return FUSED, None


@dataclass
class CommStats:
    """Seconds spent blocked on communication (waits + blocking collectives), per step."""

    wait_s: float = 0.0
    calls: int = 0
    extra: dict = field(default_factory=dict)

    def count_wait(self, seconds: float) -> None:
        """One blocking communication call (a wait or a collective) took ``seconds``."""
        self.wait_s += seconds
        self.calls += 1


def _add(stats: CommStats, key: str, v: float) -> None:
    stats.extra[key] = stats.extra.get(key, 0.0) + v


def _a2a(out, inp, out_splits, in_splits, group, async_op=False):
    return dist.all_to_all_single(out, inp, out_splits, in_splits, group=group, async_op=async_op)


def _timed(stats: CommStats, fn):
    t = time.perf_counter()
    r = fn()
    stats.count_wait(time.perf_counter() - t)
    return r


class _Inflight:
    """Rows + their metadata posted in one (float32/64: packed) or two all_to_alls."""

    def __init__(self, works, unpack):
        self.works, self.unpack = works, unpack

    def wait(self, stats: CommStats):
        for w in self.works:
            _timed(stats, w.wait)
        return self.unpack()


PACKABLE = (torch.float32, torch.float64)   # slot ids < 2**24 and 0/1 flags are exact


def _post_rows(xs, meta, out_splits, in_splits, group) -> _Inflight:
    """Post rows xs [n, H] with meta int64 [n, 2] (local slot, counted) asynchronously."""
    n_out, H = sum(out_splits), xs.shape[1]
    if xs.dtype in PACKABLE:
        buf = torch.cat([xs, meta.to(xs.dtype)], dim=1)
        out = buf.new_empty((n_out, H + 2))
        w = _a2a(out, buf, out_splits, in_splits, group, async_op=True)
        return _Inflight([w], lambda: (out[:, :H], out[:, H:].to(torch.int64)))
    xr, mr = xs.new_empty((n_out, H)), meta.new_empty((n_out, 2))
    w1 = _a2a(xr, xs, out_splits, in_splits, group, async_op=True)
    w2 = _a2a(mr, meta, out_splits, in_splits, group, async_op=True)
    return _Inflight([w1, w2], lambda: (xr, mr))


#: the padded dispatch (no split-size round) runs while its send buffer stays under this size
PAD_BYTES = 1 << 20


def padded_bounds(peer_rows, T: int, k: int, rank: int, D: int,
                  row_bytes: int) -> list[int] | None:
    """Rows each rank may send to any one rank (``peer_rows[r] * k``) when the padded dispatch
    applies, else None. ``peer_rows``: every rank's dispatched rows of this step (or None);
    ``row_bytes``: bytes of one packed row. The decision reads only values every rank shares
    (``peer_rows``, ``k``, ``D``, the row size), so every rank takes the same path."""
    if peer_rows is None or len(peer_rows) != D:
        return None
    if int(peer_rows[rank]) != T:
        raise RuntimeError(f"rank {rank}: dispatches {T} rows but peer_rows says "
                           f"{int(peer_rows[rank])}")
    bounds = [int(n) * k for n in peer_rows]
    return bounds if max(bounds) * len(bounds) * row_bytes <= PAD_BYTES else None


def _post_padded(xs, meta, send: list[int], bounds: list[int], me: int, skip: bool,
                 group) -> _Inflight:
    """Post rows xs [n, H] (sorted by destination, ``send`` rows to each rank) with meta
    [n, 2] in blocks of ``bounds[me]`` rows per destination, padding rows' slot -1 (``skip``:
    no block to or from this rank). The result unpacks to (rows, meta, rows received from each
    rank)."""
    D, H = len(send), xs.shape[1]
    ins = [0 if skip and d == me else bounds[me] for d in range(D)]
    outs = [0 if skip and r == me else b for r, b in enumerate(bounds)]
    if any(n > b for n, b in zip(send, ins, strict=True)):
        raise RuntimeError(f"rank {me}: routed rows per rank {send} exceed the blocks {ins}")
    buf = xs.new_zeros((sum(ins), H + 2))
    buf[:, H] = -1
    send_t = torch.tensor(send, dtype=torch.int64, device=xs.device)
    shift = torch.tensor([sum(ins[:d]) - sum(send[:d]) for d in range(D)], dtype=torch.int64,
                         device=xs.device)
    pos = torch.arange(xs.shape[0], device=xs.device) + \
        shift.repeat_interleave(send_t, output_size=xs.shape[0])
    buf[pos, :H] = xs
    buf[pos, H:] = meta.to(xs.dtype)
    out = buf.new_empty((sum(outs), H + 2))
    w = _a2a(out, buf, outs, ins, group, async_op=True)

    def unpack():
        valid = out[:, H] >= 0
        keep = torch.nonzero(valid).flatten()
        got = [int(v.sum()) for v in valid.split(outs)]
        return out[keep, :H], out[keep, H:].to(torch.int64), got
    return _Inflight([w], unpack)


def _local(moe, x, phys, counted, stats, overlap, dropped):
    """A 1-rank group: every slot is local, no collective. -> as :func:`moe_dispatch`."""
    T, k = phys.shape
    flat = phys.reshape(-1)
    live = torch.nonzero(flat >= 0).flatten() if dropped else None
    tok = (live if live is not None else torch.arange(T * k, device=x.device)) // k
    slots = flat if live is None else flat[live]
    ys = moe.compute(x[tok], slots)
    tc = time.perf_counter()
    counts = moe.count(slots, counted[tok])
    _add(stats, "count_s", time.perf_counter() - tc)
    extra = overlap() if overlap is not None else None
    if live is None:
        return ys.reshape(T, k, -1), counts, extra
    y = ys.new_zeros((T * k, x.shape[1]))
    y[live] = ys
    return y.reshape(T, k, -1), counts, extra


def _count(moe, stats, *metas) -> torch.Tensor:
    tc = time.perf_counter()
    m = metas[0] if len(metas) == 1 else torch.cat(metas)
    counts = moe.count(m[:, 0], m[:, 1])
    _add(stats, "count_s", time.perf_counter() - tc)
    return counts


def _records(xs: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    """Rows xs [n, H] (any dtype) and meta int64 [n, 2] -> one byte record per row
    uint8 [n, H * itemsize + 16]."""
    return torch.cat([xs.contiguous().view(torch.uint8), meta.contiguous().view(torch.uint8)],
                     dim=1)


def _unrecord(rec: torch.Tensor, dtype: torch.dtype, H: int):
    """Inverse of :func:`_records` -> (rows [m, H] dtype, meta int64 [m, 2])."""
    nb = H * torch.empty((), dtype=dtype).element_size()
    return rec[:, :nb].contiguous().view(dtype), rec[:, nb:].contiguous().view(torch.int64)


def _via_shm(moe, xs, meta, send: list[int], a2a, stats: CommStats, overlap, fused: bool):
    """Dispatch and combine through the shared-memory all-to-all: one round each way.
    ``xs`` [n, H] sorted by destination (``send[d]`` rows to rank d), ``meta`` [n, 2].
    ``fused``: this rank's own rows and the ``overlap`` work run between posting the remote
    rows and reading the others' (``a2a.start`` / ``a2a.finish``); else every row is read
    first and computed in one call, ``overlap`` after the combine.
    -> (expert outputs in send order [n, H], slot loads [S], overlap() result)."""
    H, dtype, me = xs.shape[1], xs.dtype, moe.ep_rank
    if not fused:
        rec, got = _timed(stats, lambda: a2a.all_to_all(_records(xs, meta), send))
        xr, mr = _unrecord(rec, dtype, H)
        yr = moe.compute(xr, mr[:, 0])
        counts = _count(moe, stats, mr)
        ys, _ = _timed(stats, lambda: a2a.all_to_all(yr, got))
        _add(stats, "a2a_rounds", 2)
        return ys, counts, overlap() if overlap is not None else None
    lo, n_loc = sum(send[:me]), send[me]
    rec = _records(torch.cat([xs[:lo], xs[lo + n_loc:]]), torch.cat([meta[:lo],
                                                                    meta[lo + n_loc:]]))
    s_r = list(send)
    s_r[me] = 0
    pend = _timed(stats, lambda: a2a.start(rec, s_r))
    m_loc = meta[lo:lo + n_loc]
    y_loc = moe.compute(xs[lo:lo + n_loc], m_loc[:, 0])      # while the others' rows come
    extra = overlap() if overlap is not None else None
    rr, got = _timed(stats, lambda: a2a.finish(pend))
    xr, mr = _unrecord(rr, dtype, H)
    yr = moe.compute(xr, mr[:, 0])
    counts = _count(moe, stats, m_loc, mr)
    back, _ = _timed(stats, lambda: a2a.all_to_all(yr, got))
    _add(stats, "a2a_rounds", 2)
    return torch.cat([back[:lo], y_loc, back[lo:]]), counts, extra


def moe_dispatch(moe: FusedMoE, x: torch.Tensor, phys: torch.Tensor, counted: torch.Tensor,
                 group, mode: str, stats: CommStats, overlap=None, splits=None,
                 dropped: bool | None = None, peer_rows: list[int] | None = None,
                 a2a=None) -> tuple[torch.Tensor, torch.Tensor, object]:
    """Route ``x`` [T, H] to global slots ``phys`` [T, k] and back.

    ``counted`` [T] bool (False = not counted in the load). ``splits``: (rows to each rank [D],
    rows from each rank [D]) when every rank already knows them from the step's exchanged
    counts (``replica_dispatch.Routed.splits``; then the split-size all_to_all is skipped; every
    rank passes them or none does). ``dropped``: ``phys`` may hold -1 (a row dropped by expert
    capacity: not dispatched, its output row is 0). ``peer_rows``: every rank's dispatched rows
    of this step (:func:`padded_bounds`; every rank passes them or none does). ``a2a``: the
    node's shared-memory all-to-all (every rank passes one or none does; then ``group`` is not
    used and the mode only names the step). Returns (expert outputs [T, k, H] unweighted, this rank's
    slot loads int64 [S] as observed by the receiver, the result of ``overlap()`` or None).
    """
    T, k = phys.shape
    S, D, H = moe.slots_per_rank, moe.ep_size, x.shape[1]
    if D == 1:
        return _local(moe, x, phys, counted, stats, overlap, dropped)
    pad = (padded_bounds(peer_rows, T, k, moe.ep_rank, D, (H + 2) * x.element_size())
           if splits is None and a2a is None and x.dtype in PACKABLE else None)
    flat = phys.reshape(-1)
    live = None if dropped is None else torch.nonzero(flat >= 0).flatten()
    if live is not None:
        flat = flat[live]
    dest = torch.div(flat, S, rounding_mode="floor")
    order = torch.argsort(dest, stable=True)
    if live is not None:
        order = live[order]                  # positions in [T*k] of the kept rows, by dest
        flat = phys.reshape(-1)
    tok = torch.div(order, k, rounding_mode="floor")
    xs = x[tok]
    meta = torch.stack([flat[order] % S, counted[tok].to(torch.int64)], dim=1)
    send = torch.bincount(dest, minlength=D).to(torch.int64)
    if splits is not None and send.tolist() != list(splits[0]):
        raise RuntimeError(f"rank {moe.ep_rank}: routed rows per rank {send.tolist()} differ "
                           f"from the exchanged split sizes {list(splits[0])}")
    recv = torch.empty_like(send) if splits is None else list(splits[1])   # known: a list
    if a2a is None:       # collectives of this layer on the EP group (split sizes, rows, back)
        _add(stats, "a2a_rounds", (0 if splits is not None or pad is not None else 1)
             + (1 if pad is not None or x.dtype in PACKABLE else 2) + 1)
    if a2a is not None:
        ys, counts, extra = _via_shm(moe, xs, meta, send.tolist(), a2a, stats, overlap,
                                     mode == FUSED)
    elif mode == FUSED:
        ys, extra, counts = _fused(moe, xs, meta, send, recv, group, stats, overlap,
                                   known=splits is not None, pad=pad)
    else:
        s_l = send.tolist()
        if pad is not None:
            xr, mr, r_l = _post_padded(xs, meta, s_l, pad, moe.ep_rank, False,
                                       group).wait(stats)
        else:
            if splits is None:
                _timed(stats, lambda: _a2a(recv, send, None, None, group))
            r_l = recv.tolist() if splits is None else recv
            xr, mr = _post_rows(xs, meta, r_l, s_l, group).wait(stats)   # no compute between
        yr = moe.compute(xr, mr[:, 0])
        counts = _count(moe, stats, mr)
        ys = x.new_empty((sum(s_l), H))
        _timed(stats, lambda: _a2a(ys, yr, s_l, r_l, group))
        extra = overlap() if overlap is not None else None
    y = ys.new_zeros((T * k, H)) if live is not None else torch.empty_like(ys)
    y[order] = ys                            # dropped rows (capacity) stay 0
    return y.reshape(T, k, H), counts, extra


def _fused(moe, xs, meta, send, recv, group, stats, overlap, known=False, pad=None):
    """Overlapped path: local rows never travel. The remote rows are packed while the split
    sizes are exchanged (``known``: ``recv`` is already the list of them; ``pad``: the padded
    blocks' bounds, the split sizes travel with the rows; either way nothing to exchange);
    the local experts and the ``overlap`` work (shared expert) run while the remote rows are
    in flight.
    -> (expert outputs in send order [n, H], overlap() result, slot loads [S])."""
    me, H = moe.ep_rank, xs.shape[1]
    w0 = None if known or pad is not None else _a2a(recv, send, None, None, group,
                                                     async_op=True)
    s_r = send.tolist()
    lo, n_local = sum(s_r[:me]), s_r[me]
    x_loc, m_loc = xs[lo:lo + n_local], meta[lo:lo + n_local]
    x_rem = torch.cat([xs[:lo], xs[lo + n_local:]])          # prepared while counts travel
    m_rem = torch.cat([meta[:lo], meta[lo + n_local:]])
    if w0 is not None:
        _timed(stats, w0.wait)
    s_r[me] = 0
    if pad is not None:
        inflight = _post_padded(x_rem, m_rem, s_r, pad, me, True, group)
    else:
        r_r = recv if known else recv.tolist()
        r_r[me] = 0
        inflight = _post_rows(x_rem, m_rem, r_r, s_r, group)
    y_loc = moe.compute(x_loc, m_loc[:, 0])                 # local experts overlap the dispatch
    extra = overlap() if overlap is not None else None     # so does the shared expert
    if pad is not None:
        xr, mr, r_r = inflight.wait(stats)
    else:
        xr, mr = inflight.wait(stats)
    yr = moe.compute(xr, mr[:, 0])
    counts = _count(moe, stats, m_loc, mr)
    back = xs.new_empty((x_rem.shape[0], H))
    _timed(stats, lambda: _a2a(back, yr, s_r, r_r, group))
    return torch.cat([back[:lo], y_loc, back[lo:]]), extra, counts
