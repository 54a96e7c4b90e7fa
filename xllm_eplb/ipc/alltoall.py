"""An intra-node all-to-all on POSIX shared memory (``--ep_transport=shm``, issue #39).

The ranks of one node exchange rows through one segment of the run (:class:`ShmAllToAll`),
named ``/xllm_eplb_<run>_a2a<g>`` (``g``: the elastic process-group generation, so a re-formed
group gets fresh buffers) and swept with the rings (``ipc/objects.sweep_run``). No torch
collective runs on the hot path: one round is one write, one signal, one read.

Payload layout (``D`` ranks, ``cap`` bytes of data per rank and phase, little endian)::

    control  D x 64 bytes: rank r's arrived round (u64), waiting-for round (u64),
             pid (u64), process start time (u64; ipc/liveness.CLOSED once it closed)
    boxes    2 phases x D ranks x [D u64 bytes-to-each-rank, padded to 64][cap data bytes,
             padded to 64]

Round ``s`` (1, 2, ...; every rank runs the same sequence) uses phase ``s % 2``. Rank r writes
its rows for every other rank into its own box (destination order), then publishes
``arrived[r] = s`` and wakes the ranks sleeping on round ``s``; it then waits until every rank
has arrived and copies its piece out of every other rank's box. A box of phase ``p`` is written
again only in round ``s + 2``, which no rank enters before every rank arrived at ``s + 1``,
i.e. finished reading round ``s``: two phases need no acknowledgement round. A message larger
than ``cap`` goes in several rounds of ``cap`` bytes (the byte counts travel in the box
header, so every rank computes the same number of rounds).

Waiting: spin for ``spin_s``, then check between ``sched_yield`` calls until ``yield_s`` (a
rank we wait for may be runnable on this core), then sleep on the rank's named semaphore
(``/xllm_eplb_<run>_a2a<g>_s<r>``) in slices of ``SLEEP_SLICE_S`` (a lost wake-up costs one
slice). Every ``LIVENESS_S`` a waiter checks the ranks it waits for (pid + start time,
``ipc/liveness.py``): a dead or closed rank fails the round at once
(:class:`~xllm_eplb.ipc.errors.PeerDeadError`), a silent one after ``timeout_s``
(:class:`~xllm_eplb.ipc.errors.RingTimeoutError`). Either way the group is broken: the worker
drops it and the elastic regroup opens the next generation's segment.

NOTE: the publish/observe order (data, then the round counter) relies on the total store order
of x86-64; :func:`supported` says False elsewhere and the worker keeps ``dist``.

Public API::

    a2a = ShmAllToAll.open(run_id, generation, rank, size, cap_bytes, timeout_s)
    out, got = a2a.all_to_all(inp [N, ...], send [D])   # rows to each rank -> rows, rows from
    pend = a2a.start(inp, send); ...compute...; out, got = a2a.finish(pend)   # the same, split
    a2a.stats()  -> {"rounds": n, "round_s": seconds in rounds, "bytes": sent}
    a2a.close()                                         # idempotent; the last rank unlinks
"""

from __future__ import annotations

import contextlib
import os
import platform
import time
from array import array
from dataclasses import dataclass

import numpy as np
import posix_ipc
import torch

from xllm_eplb.ipc.errors import PeerDeadError, RingTimeoutError
from xllm_eplb.ipc.liveness import CLOSED, peer_gone, self_identity
from xllm_eplb.ipc.shm import HEADER_SIZE, Segment, object_name

CTRL = 64                  # bytes of control per rank (one cache line)
SPIN_S = 50e-6             # default busy-wait before yielding
#: default wait that yields the core between checks, before sleeping: none (docs/benchmarks.md:
#: serve at EP2 ran faster sleeping at once, e.g. compute pinned 283 against 149 tok/s)
YIELD_S = 0.0
SLEEP_SLICE_S = 0.002      # one semaphore sleep (bounds a lost wake-up)
LIVENESS_S = 0.05          # how often a waiter checks the ranks it waits for
_ARRIVED, _WAITING, _PID, _START = 0, 1, 2, 3      # u64 index inside a rank's control line
#: how a survivor's failed round reads when a peer is gone (the launcher's blame skips it)
PEER_GONE_TEXT = "shm all-to-all peer gone"


@dataclass
class _Pending:
    """One message between :meth:`ShmAllToAll.start` and :meth:`ShmAllToAll.finish`."""

    inp: torch.Tensor              # kept alive: ``flat`` views its bytes
    send: list[int]                # rows to each rank
    flat: np.ndarray               # uint8 [N * row_b]
    stream: np.ndarray             # uint8: the bytes for the other ranks, in rank order
    lens: list[int]                # bytes to each rank (0 for this one)
    lo: int                        # this rank's own rows: flat[lo:hi]
    hi: int
    row_b: int                     # bytes per row
    got: list                      # per source rank: the byte pieces read so far
    j: int = 0                     # the round of this message in flight

    def next_round(self) -> None:
        """Its next ``cap`` bytes go out in the next round."""
        self.j += 1


def supported() -> bool:
    """True where the transport's memory ordering holds (x86-64: total store order)."""
    return platform.machine().lower() in ("x86_64", "amd64")


def segment_name(run_id: str, generation: int) -> str:
    return object_name(run_id, f"a2a{int(generation)}")


def semaphore_name(run_id: str, generation: int, rank: int) -> str:
    return object_name(run_id, f"a2a{int(generation)}_s{int(rank)}")


def _round64(n: int) -> int:
    return (n + 63) // 64 * 64


def payload_bytes(size: int, cap_bytes: int) -> int:
    """Bytes of the segment's payload for ``size`` ranks and ``cap_bytes`` per box (each box
    rounded up to 64 bytes, so every box and its u64 header stay aligned)."""
    return size * CTRL + 2 * size * (_round64(8 * size) + _round64(cap_bytes))


class ShmAllToAll:
    """One rank's end of the shared-memory all-to-all (see the module docstring)."""

    def __init__(self, seg: Segment, sems: list, run_id: str, generation: int, rank: int,
                 size: int, cap_bytes: int, timeout_s: float, spin_s: float,
                 yield_s: float = YIELD_S):
        self.seg, self.sems = seg, sems
        self.run_id, self.generation = run_id, generation
        self.rank, self.size, self.cap = rank, size, cap_bytes
        self.timeout_s, self.spin_s, self.yield_s = timeout_s, spin_s, yield_s
        self.seq = 0
        self.closed = False
        self._hdr = _round64(8 * size)
        self._box = self._hdr + _round64(cap_bytes)      # aligned, as payload_bytes
        #: the payload as bytes (numpy: slice copies are one memcpy) and as u64 words
        #: (memoryview: one control word or header entry reads in ~50 ns)
        self._bytes = np.frombuffer(seg.mm, dtype=np.uint8)[HEADER_SIZE:]
        self._words = memoryview(seg.mm)[HEADER_SIZE:].cast("B").cast("Q")   # 64-aligned
        self._pending = False
        self._rounds = 0
        self._round_s = 0.0
        self._sent = 0
        pid, start = self_identity()
        self._set(rank, _PID, pid)
        self._set(rank, _START, start)

    def _get(self, rank: int, field: int) -> int:
        return self._words[rank * (CTRL // 8) + field]

    def _set(self, rank: int, field: int, value: int) -> None:
        self._words[rank * (CTRL // 8) + field] = value

    def _box_at(self, phase: int, rank: int) -> int:
        """Payload offset of ``rank``'s box of ``phase``."""
        return self.size * CTRL + (phase * self.size + rank) * self._box

    # ------------------------------------------------------------------ open / close
    @classmethod
    def open(cls, run_id: str, generation: int, rank: int, size: int, cap_bytes: int,
             timeout_s: float, spin_s: float = SPIN_S,
             yield_s: float = YIELD_S) -> "ShmAllToAll":
        """Map (create or attach) the generation's segment and the ranks' semaphores.

        ``cap_bytes``: data bytes per rank and phase (every rank passes the same value, else
        the segment's size differs: ``LayoutError``); ``timeout_s``: a round's limit;
        ``spin_s`` / ``yield_s``: how long a wait spins, then yields, before it sleeps."""
        if not 0 <= rank < size:
            raise ValueError(f"rank={rank}: must be in [0, size={size})")
        if cap_bytes < 64:
            raise ValueError(f"cap_bytes={cap_bytes}: must be >= 64")
        seg = Segment.open(segment_name(run_id, generation), payload_bytes(size, cap_bytes))
        try:
            sems = [posix_ipc.Semaphore(semaphore_name(run_id, generation, r),
                                        posix_ipc.O_CREAT, mode=0o600, initial_value=0)
                    for r in range(size)]
        except BaseException:
            seg.close()
            raise
        return cls(seg, sems, run_id, generation, rank, size, cap_bytes, timeout_s, spin_s,
                   yield_s)

    def close(self) -> None:
        """Mark this rank closed (a peer waiting on it fails at once), unmap; the last rank
        out unlinks the segment; each rank unlinks its own semaphore."""
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(Exception):
            self._set(self.rank, _START, CLOSED)
            self._wake_all()
        self._words.release()
        self._words = self._bytes = None            # the mmap closes only unexported
        for r, s in enumerate(self.sems):
            if r == self.rank:
                with contextlib.suppress(posix_ipc.ExistentialError):
                    s.unlink()
            s.close()
        self.seg.close()

    def __enter__(self) -> "ShmAllToAll":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ rounds
    def stats(self) -> dict:
        """Rounds run, seconds spent inside them (write + wait + read), bytes sent."""
        return {"rounds": self._rounds, "round_s": self._round_s, "bytes": self._sent}

    def all_to_all(self, inp: torch.Tensor, send: list[int]) -> tuple[torch.Tensor, list[int]]:
        """Rows ``inp`` [N, ...] (sorted by destination: ``send[d]`` rows to rank d,
        ``sum(send) == N``) -> (rows received [M, ...] ordered by source rank, rows from each
        rank [D]). Every rank calls it in the same order with the same row shape and dtype;
        the rows for this rank never touch the segment."""
        return self.finish(self.start(inp, send))

    def start(self, inp: torch.Tensor, send: list[int]) -> "_Pending":
        """The first half of :meth:`all_to_all`: write and publish this rank's rows (the
        first ``cap`` bytes of them); the caller may compute, then calls :meth:`finish`
        before any other round. ``inp`` must not change until then."""
        if self.closed:
            raise RuntimeError(f"{self.seg.name}: all-to-all is closed")
        if self._pending:
            raise RuntimeError(f"{self.seg.name}: a round is already in flight")
        D, me = self.size, self.rank
        if len(send) != D or sum(send) != inp.shape[0]:
            raise ValueError(f"rank {me}: send={list(send)} must have {D} entries summing to "
                             f"the {inp.shape[0]} input rows")
        t0 = time.perf_counter()
        row_shape = tuple(inp.shape[1:])
        row_b = inp.element_size() * int(np.prod(row_shape, dtype=np.int64))
        if row_b == 0:
            raise ValueError(f"rank {me}: rows of shape {row_shape} hold no bytes (the "
                             "row counts travel as byte counts)")
        flat = inp.contiguous().view(torch.uint8).reshape(-1).numpy() if inp.numel() else \
            np.empty(0, dtype=np.uint8)
        lens = [n * row_b for n in send]
        lo = sum(lens[:me])
        hi = lo + lens[me]
        lens[me] = 0
        if hi == lo:                                # the others' bytes, in rank order
            stream = flat
        elif lo == 0 or hi == flat.size:
            stream = flat[hi:] if lo == 0 else flat[:lo]
        else:
            stream = np.concatenate([flat[:lo], flat[hi:]])
        pend = _Pending(inp, list(send), flat, stream, lens, lo, hi, row_b,
                        [[] for _ in range(D)])
        self._post(pend)
        self._pending = True
        self._round_s += time.perf_counter() - t0
        return pend

    def finish(self, pend: "_Pending") -> tuple[torch.Tensor, list[int]]:
        """The second half of :meth:`all_to_all`: wait for every rank, read (and run the
        further rounds of a message over ``cap``) -> (rows, rows from each rank)."""
        t0 = time.perf_counter()
        try:
            while not self._collect(pend):
                pend.next_round()
                self._post(pend)
        finally:
            self._pending = False
        me, inp, row_b = self.rank, pend.inp, pend.row_b
        empty = pend.stream[:0]
        pieces = [np.concatenate(g) if len(g) > 1 else (g[0] if g else empty)
                  for g in pend.got]
        pieces[me] = pend.flat[pend.lo:pend.hi]
        got = [p.size // row_b for p in pieces]
        out = np.concatenate(pieces) if len(pieces) > 1 else pieces[0].copy()
        self._round_s += time.perf_counter() - t0
        self._sent += pend.stream.size
        row_shape = tuple(inp.shape[1:])
        if not out.size:                    # torch views no empty array as another dtype
            return inp.new_empty((0, *row_shape)), got
        return torch.from_numpy(out).view(inp.dtype).view(-1, *row_shape), got

    def _post(self, pend: "_Pending") -> None:
        """Round ``pend.j`` of the message: header, bytes ``[j*cap, (j+1)*cap)``, publish."""
        D, me, cap, j = self.size, self.rank, self.cap, pend.j
        self.seq += 1
        mine = self._box_at(self.seq % 2, me)
        self._words[mine // 8:mine // 8 + D] = array("Q", pend.lens)
        total = pend.stream.size
        a, b = min(j * cap, total), min((j + 1) * cap, total)
        if b > a:
            self._bytes[mine + self._hdr:mine + self._hdr + b - a] = pend.stream[a:b]
        self._publish(self.seq)

    def _collect(self, pend: "_Pending") -> bool:
        """Wait for round ``pend.j``, copy this rank's bytes out of every other box; True
        when no rank has more to send."""
        D, me, cap, j, s = self.size, self.rank, self.cap, pend.j, self.seq
        self._wait_all(s)
        words, mem = self._words, self._bytes
        more = pend.stream.size > (j + 1) * cap
        for r in range(D):
            if r == me:
                continue
            box = self._box_at(s % 2, r)
            their = words[box // 8:box // 8 + D].tolist()
            lo = sum(their[:me])
            hi = lo + their[me]
            a, b = max(lo, j * cap), min(hi, (j + 1) * cap)
            if b > a:
                start = box + self._hdr + a - j * cap
                pend.got[r].append(mem[start:start + b - a].copy())
            more |= sum(their) > (j + 1) * cap
        self._rounds += 1
        return not more

    def _publish(self, s: int) -> None:
        """Round ``s`` is written: say so, wake the ranks that sleep on it."""
        self._set(self.rank, _ARRIVED, s)
        for r in range(self.size):
            if r != self.rank and self._get(r, _WAITING) == s:
                self.sems[r].release()

    def _wake_all(self) -> None:
        for r in range(self.size):
            if r != self.rank:
                self.sems[r].release()

    def _wait_all(self, s: int) -> None:
        """Until every rank arrived at round ``s``: spin, then sleep on the semaphore; a dead
        or closed rank fails at once, a silent one after ``timeout_s``."""
        me = self.rank
        t0 = time.perf_counter()
        if self._arrived(s):
            return
        while time.perf_counter() - t0 < self.spin_s:
            if self._arrived(s):
                return
        # NOTE: more ranks than cores (4 ranks on 2): the rank we wait for may be runnable on
        # this very core; yielding lets it run (bench_a2a-style probe, EP4 on 2 cores: p50
        # 85 us a round with a 1 ms yielding wait, 510 us sleeping after 50 us), but in serve
        # the spinning rank lost its core to the engine when it finally slept: off by default
        while time.perf_counter() - t0 < self.yield_s:
            os.sched_yield()
            if self._arrived(s):
                return
        self._set(me, _WAITING, s)
        sem = self.sems[me]
        check = t0
        try:
            while not self._arrived(s):
                with contextlib.suppress(posix_ipc.BusyError):
                    sem.acquire(SLEEP_SLICE_S)
                now = time.perf_counter()
                if now - check >= LIVENESS_S:
                    check = now
                    self._check_peers(s, now - t0)
        finally:
            self._set(me, _WAITING, 0)
            for _ in range(self.size):          # drain extra wake-ups of this round
                try:
                    sem.acquire(0)
                except posix_ipc.BusyError:
                    break

    def _arrived(self, s: int) -> bool:
        w, step = self._words, CTRL // 8
        return all(w[r * step] >= s for r in range(self.size))

    def _check_peers(self, s: int, waited: float) -> None:
        late = [r for r in range(self.size) if self._get(r, _ARRIVED) < s]
        for r in late:
            if peer_gone(self._get(r, _PID), self._get(r, _START)):
                raise PeerDeadError(f"{self.seg.name}: {PEER_GONE_TEXT}: rank {r} exited or "
                                    f"closed during round {s} (rank {self.rank} waited "
                                    f"{waited:.3f}s)")
        if waited > self.timeout_s:
            raise RingTimeoutError(f"{self.seg.name}: ranks {late} silent for "
                                   f"{waited:.1f}s > {self.timeout_s}s in round {s}")
