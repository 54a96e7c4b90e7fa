"""Broadcast ring over a :class:`~xllm_eplb.ipc.shm.Segment` (the mechanism under
:mod:`xllm_eplb.ipc.ring`): one producer, N readers, every reader reads every frame, in order.

Payload layout (header, per-reader records, frames): :mod:`xllm_eplb.ipc.ring_layout`.

Synchronisation (no busy spinning): per reader ``i`` two named POSIX semaphores,
``<ring>_d<i>`` (frames ready for ``i``, starts 0) and ``<ring>_s<i>`` (free slots for ``i``,
starts ``slots``). ``put`` takes one "space" from every reader (back-pressure: it blocks, with a
timeout, while the slowest reader is a full ring behind), writes the frame, then posts every
reader's "data". ``get`` waits on its "data", copies the frame out, posts its "space".
All waits are sliced (``poll_interval`` s); between slices the peer's pid + start time
registered in the header is checked, so a dead peer raises :class:`PeerDeadError` within one
slice instead of blocking forever; a timeout raises :class:`RingTimeoutError` naming the ring.

Hot path (what one message costs; see ``docs/benchmarks.md``): ``get`` is one
``sem_timedwait`` bounded by the first slice (it returns at once when a frame is ready), one
28-byte header copy checked by a single crc32 (crc32 of header + stored crc = a fixed residue),
one body copy, one read_seq store and one post; ``put`` is one trywait per reader, one header
pack + crc32, one body copy, one write_seq store and one post per reader. The clock, the
deadline arithmetic and the peer's ``/proc`` liveness check run only once a wait is needed.

A frame that fails its magic / length / sequence / checksum check, or whose body the ``decode``
callable rejects with :class:`MessageError`, is logged (``shm ring bad frame ring=...``) and
skipped; the reader keeps going. A *strict* reader (``get_bytes(strict=True)``: the engine's
output rings, one frame per step) raises :class:`BadFrameError` naming the ring instead.

NOTE: the ring's *owner* (``Ring.create``) creates the semaphores and unlinks them on close;
creation and attach happen under the generation lock, so an attacher sees all or nothing.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import struct
import time
import zlib
from typing import Callable

import posix_ipc

from xllm_eplb.ipc.checksum import NONE, algo_for, checksum
from xllm_eplb.ipc.errors import (
    BadFrameError,
    FrameTooLargeError,
    MessageError,
    PeerDeadError,
    RingTimeoutError,
    SegmentBusyError,
    SegmentMissingError,
)
from xllm_eplb.ipc.liveness import CLOSED, peer_gone, self_identity
from xllm_eplb.ipc.ring_layout import (
    FHDR,
    FHDR_CRC,
    FLAG_CHECKSUM,
    FRAME_HEADER,
    FRAME_MAGIC,
    PROD,
    READER,
    RHDR,
    RING_HEADER,
    RING_MAGIC,
    RING_VERSION,
    U64,
    WSEQ,
    WSEQ_ABS,
    check_ring_header,
    frames_off,
    parse_frame,
    ring_payload_size,
    sem_names,
)
from xllm_eplb.ipc.shm import HEADER_SIZE, Segment, generation_lock

log = logging.getLogger(__name__)

POLL_INTERVAL = 0.2


class Ring:
    """A single-producer, N-reader broadcast ring (see module docstring).

    Roles: :meth:`create` makes the owner; :meth:`claim_producer` / :meth:`claim_reader` register
    this process (pid + start time) in the header for the peer's liveness checks.
    """

    def __init__(self, seg: Segment, slots: int, frame_bytes: int, num_readers: int,
                 sems: list, owner: bool, flags: int = 0):
        self.seg = seg
        self.name = seg.name
        self.slots, self.frame_bytes, self.num_readers = slots, frame_bytes, num_readers
        self._data = sems[0::2]
        self._space = sems[1::2]
        self.owner = owner
        self.poll_interval = POLL_INTERVAL
        self._frames = frames_off(num_readers)
        self._frames_abs = HEADER_SIZE + self._frames   # offsets into seg.mm (header included)
        self._rseq_abs = 0
        self._mm = seg.mm
        self._cap = frame_bytes - FRAME_HEADER
        self._rdata = self._rspace = None    # this reader's semaphores (claim_reader)
        self.checksum = bool(flags & FLAG_CHECKSUM)
        self.reader_index: int | None = None
        self.is_producer = False
        self._seq = 0
        self.closed = False

    # ------------------------------------------------------------ create / attach
    @classmethod
    def create(cls, name: str, num_readers: int, slots: int, frame_bytes: int,
               checksum: bool = False) -> "Ring":
        """Create (or reclaim a stale) ring; raises SegmentBusyError if live holders exist.

        ``checksum``: frames carry a body checksum, checked by readers (recorded in the
        ring header, so every end agrees)."""
        flags = FLAG_CHECKSUM if checksum else 0
        if num_readers < 1 or slots < 2 or frame_bytes < FRAME_HEADER + 32:
            raise ValueError(f"ring {name}: num_readers={num_readers} (>=1), slots={slots} (>=2), "
                             f"frame_bytes={frame_bytes} (>= {FRAME_HEADER + 32}) out of range")
        size = ring_payload_size(num_readers, slots, frame_bytes)
        with generation_lock():
            seg = Segment.open_locked(name, size, mode="create")
            try:
                seg.write(0, RHDR.pack(RING_MAGIC, RING_VERSION, slots, frame_bytes,
                                        num_readers, flags, 0, 0, 0))
                sems = []
                for i, sname in enumerate(sem_names(name, num_readers)):
                    with contextlib.suppress(posix_ipc.ExistentialError):
                        posix_ipc.unlink_semaphore(sname)  # leftover of a killed run
                    sems.append(posix_ipc.Semaphore(sname, posix_ipc.O_CREX, mode=0o600,
                                                    initial_value=0 if i % 2 == 0 else slots))
            except BaseException:
                for sname in sem_names(name, num_readers):
                    with contextlib.suppress(posix_ipc.ExistentialError):
                        posix_ipc.unlink_semaphore(sname)
                seg.close_locked()
                raise
        log.debug("shm ring create ring=%s readers=%d slots=%d frame_bytes=%d generation=%d",
                  name, num_readers, slots, frame_bytes, seg.generation)
        return cls(seg, slots, frame_bytes, num_readers, sems, owner=True, flags=flags)

    @classmethod
    def attach(cls, name: str, *, num_readers: int | None = None, slots: int | None = None,
               frame_bytes: int | None = None, timeout: float = 0.0) -> "Ring":
        """Attach to a live ring; dimensions given are checked (LayoutError on mismatch).

        ``timeout``: keep retrying this long while the ring does not exist yet.
        """
        deadline = time.monotonic() + timeout
        while True:
            try:
                return cls._attach_once(name, num_readers, slots, frame_bytes)
            except SegmentMissingError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.05)

    @classmethod
    def _attach_once(cls, name, num_readers, slots, frame_bytes) -> "Ring":
        with generation_lock():
            seg = Segment.open_locked(name, None, mode="attach")
            sems = []
            try:
                dims = check_ring_header(seg, num_readers, slots, frame_bytes)
                for sname in sem_names(name, dims[2]):
                    try:
                        sems.append(posix_ipc.Semaphore(sname))
                    except posix_ipc.ExistentialError:
                        raise SegmentMissingError(f"ring {name}: semaphore {sname} is missing "
                                                  "(owner closed the ring)") from None
            except BaseException:
                for sem in sems:
                    sem.close()
                seg.close_locked()
                raise
        return cls(seg, *dims[:3], sems, owner=False, flags=dims[3])

    # ------------------------------------------------------------ roles
    def claim_producer(self) -> "Ring":
        """Register this process as the producer (refused while another live one holds it)."""
        with generation_lock():
            self._claim(PROD, "producer")
        self.is_producer = True
        self._seq = U64.unpack(self.seg.read(WSEQ, 8))[0]
        return self

    def claim_reader(self, index: int, *, skip: bool = False) -> "Ring":
        """Register this process as reader ``index``; it resumes at that reader's position
        (``skip``: at the newest frame instead, dropping what a dead predecessor left unread;
        NOTE: only while the producer puts nothing, e.g. an elastic replacement that the
        engine waits for)."""
        if not 0 <= index < self.num_readers:
            raise ValueError(f"ring {self.name}: reader index {index} not in [0, {self.num_readers})")
        off = RING_HEADER + READER.size * index
        with generation_lock():
            self._claim(off + 8, f"reader {index}")
        self.reader_index = index
        self._rseq_abs = HEADER_SIZE + off
        self._rdata, self._rspace = self._data[index], self._space[index]
        if skip:
            while self._rdata.value > 0:        # frames pending for this reader: give back
                self._rdata.acquire(0)
                self._rspace.release()
            U64.pack_into(self._mm, self._rseq_abs, U64.unpack(self.seg.read(WSEQ, 8))[0])
        self._seq = U64.unpack(self.seg.read(off, 8))[0]
        return self

    def _claim(self, off: int, role: str) -> None:
        old_pid, old_start = struct.unpack("<QQ", self.seg.read(off, 16))
        pid, start = self_identity()
        if old_pid != 0 and not peer_gone(old_pid, old_start):
            raise SegmentBusyError(f"ring {self.name}: {role} is already attached by live pid "
                                   f"{old_pid}")
        self.seg.write(off, struct.pack("<QQ", pid, start))

    # ------------------------------------------------------------ waits
    def _wait(self, sem, deadline: float | None, what: str, peer: Callable[[], str | None]):
        """Acquire ``sem`` before ``deadline`` (monotonic s), checking ``peer()`` each slice.

        A first non-blocking try means ``timeout=0`` polls once."""
        while True:
            if sem.value > 0:
                sem.acquire(0)
                return
            if deadline is None:
                slice_s = self.poll_interval
            else:
                slice_s = min(self.poll_interval, deadline - time.monotonic())
                if slice_s <= 0:
                    raise RingTimeoutError(f"ring {self.name}: timed out waiting for {what}")
            try:
                sem.acquire(slice_s)
                return
            except posix_ipc.BusyError:
                pass
            except posix_ipc.SignalError:
                continue
            dead = peer()
            if dead:
                raise PeerDeadError(f"ring {self.name}: {dead} while waiting for {what}")

    def _reader_gone(self, i: int) -> str | None:
        _, pid, start, _ = READER.unpack(self.seg.read(RING_HEADER + READER.size * i, 32))
        return f"reader {i} (pid {pid}) is gone" if peer_gone(pid, start) else None

    def _producer_gone(self) -> str | None:
        pid, start = struct.unpack("<QQ", self.seg.read(PROD, 16))
        return f"producer (pid {pid}) is gone" if peer_gone(pid, start) else None

    # ------------------------------------------------------------ put / get
    @property
    def capacity(self) -> int:
        """Largest body (bytes) one frame can carry."""
        return self._cap

    def put_bytes(self, body: bytes, timeout: float | None = None, *,
                  bad_checksum: bool = False) -> int:
        """Publish ``body`` to every reader; returns its sequence number.

        ``bad_checksum`` (fault injection only): the header carries a wrong body checksum.

        Fast path (every reader has a free slot): one trywait per reader, one header pack,
        one body copy, one post per reader; no clock reads, no liveness checks."""
        if not self.is_producer:
            raise RuntimeError(f"ring {self.name}: put by a process that is not its producer")
        n = len(body)
        if n > self._cap:
            raise FrameTooLargeError(
                f"ring {self.name}: message of {n} bytes exceeds the slot capacity of "
                f"{self._cap} bytes (frame_bytes {self.frame_bytes} - {FRAME_HEADER}); "
                "raise shm_input_frame_bytes / shm_output_frame_bytes")
        taken = 0
        try:
            for sem in self._space:
                try:
                    sem.acquire(0)           # fast path: this process is the only taker
                except posix_ipc.BusyError:
                    self._wait_space(sem, taken, timeout)
                taken += 1
        except BaseException:
            for sem in self._space[:taken]:
                sem.release()
            raise
        seq = self._seq
        mm, off = self._mm, self._frames_abs + (seq % self.slots) * self.frame_bytes
        if self.checksum:
            algo = algo_for(n)
            hdr = FHDR.pack(FRAME_MAGIC, n, seq, checksum(body, algo) ^ bad_checksum, algo)
        else:
            hdr = FHDR.pack(FRAME_MAGIC, n, seq, 0, NONE)
        FHDR_CRC.pack_into(mm, off, hdr, zlib.crc32(hdr))
        mm[off + FRAME_HEADER:off + FRAME_HEADER + n] = body
        self._seq = seq + 1
        U64.pack_into(mm, WSEQ_ABS, seq + 1)
        for d in self._data:
            d.release()
        return seq

    def _wait_space(self, sem, i: int, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        self._wait(sem, deadline, f"reader {i} to free a slot",
                   functools.partial(self._reader_gone, i))

    def get_bytes(self, timeout: float | None = None,
                  decode: Callable[[bytes], object] | None = None, *, strict: bool = False):
        """Next valid frame body (or ``decode(body)``); bad frames are logged and skipped
        (``strict``: logged, then :class:`BadFrameError` naming the ring and the reason).

        Fast path: one ``sem_timedwait`` of at most one ``poll_interval`` slice (it returns at
        once when a frame is ready, and it is also the first slice of a wait), one header
        copy + crc, one body copy, one post. The clock and the producer's liveness are read
        only when that first slice times out."""
        data = self._rdata
        if data is None:
            raise RuntimeError(f"ring {self.name}: get by a process that is not a reader")
        poll = self.poll_interval
        while True:
            first = poll if timeout is None or timeout >= poll else max(timeout, 0.0)
            try:
                data.acquire(first)
            except posix_ipc.BusyError:
                self._wait_more(data, timeout, first)
            except posix_ipc.SignalError:    # interrupted: nothing waited for sure
                self._wait_more(data, timeout, 0.0)
            seq = self._seq
            got = self._read_frame(seq)
            self._seq = seq + 1
            U64.pack_into(self._mm, self._rseq_abs, seq + 1)
            self._rspace.release()
            if type(got) is bytes:
                if decode is None:
                    return got
                try:
                    return decode(got)
                except MessageError as e:
                    got = str(e)
            log.error("shm ring bad frame ring=%s reader=%d seq=%d reason=%s",
                      self.name, self.reader_index, seq, got)
            if strict:
                raise BadFrameError(f"ring {self.name}: bad frame seq={seq}: {got}")

    def _wait_more(self, data, timeout: float | None, waited: float) -> None:
        """The first slice (``waited`` s) of a get found no frame: check the producer, then
        keep waiting in slices until ``timeout`` (counted from the start of the get)."""
        if waited > 0:
            dead = self._producer_gone()
            if dead:
                raise PeerDeadError(f"ring {self.name}: {dead} while waiting for a frame")
        deadline = None if timeout is None else time.monotonic() + timeout - waited
        self._wait(data, deadline, "a frame", self._producer_gone)

    def _read_frame(self, seq: int) -> bytes | str:
        """The body of frame ``seq``, or why it is rejected (a str)."""
        off = self._frames_abs + (seq % self.slots) * self.frame_bytes
        return parse_frame(self._mm, off, seq, self._cap, self.checksum)

    def pending(self) -> int:
        """Frames written but not yet read by this reader (from the header; diagnostic)."""
        wseq = struct.unpack("<Q", self.seg.read(WSEQ, 8))[0]
        return wseq - self._seq

    # ------------------------------------------------------------ close
    def close(self) -> None:
        """Mark this end closed, close the semaphores (owner: unlink them), unmap."""
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(Exception):
            if self.is_producer:
                self.seg.write(PROD + 8, struct.pack("<Q", CLOSED))
            if self.reader_index is not None:
                off = RING_HEADER + READER.size * self.reader_index
                self.seg.write(off + 16, struct.pack("<Q", CLOSED))
        with generation_lock():
            if self.owner:
                for sname in sem_names(self.name, self.num_readers):
                    with contextlib.suppress(posix_ipc.ExistentialError):
                        posix_ipc.unlink_semaphore(sname)
            for s in self._data + self._space:
                with contextlib.suppress(Exception):
                    s.close()
            self.seg.close_locked()

    def __enter__(self) -> "Ring":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
