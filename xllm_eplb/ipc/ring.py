"""Forward rings engine <-> workers, built on :class:`~xllm_eplb.ipc.broadcast.Ring`.

Objects of run ``R`` (names from :func:`~xllm_eplb.ipc.shm.object_name`)::

    /xllm_eplb_R_in           InputRing: engine -> all workers (every worker reads every message)
    /xllm_eplb_R_in_d<i>, _s<i>   its semaphores, one pair per worker i
    /xllm_eplb_R_out<r>       OutputRing of worker r: worker r -> engine
    /xllm_eplb_R_out<r>_d0, _s0

Typical use::

    # engine (owner: creates rings and semaphores, unlinks them on close)
    inp = InputRing.create(run_id, num_readers=N, slots=8, frame_bytes=1 << 20)   # producer
    outs = [OutputRing.create(run_id, r, slots=8, frame_bytes=256 << 10) for r in range(N)]
    inp.put(ForwardInput(step, batches, info), timeout=60)
    outputs = [o.get(timeout=60) for o in outs]
    # worker r
    inp = InputRing.attach(run_id, reader_index=r, timeout=30)
    out = OutputRing.attach(run_id, r, timeout=30)                                  # producer
    msg = inp.get(timeout=None); out.put(ForwardOutput(...), timeout=60)

When a launcher owns the objects instead, it calls ``create(..., producer=False)`` /
``create(..., reader=False)`` and the engine attaches with ``InputRing.attach(run_id,
producer=True)`` / ``OutputRing.attach(run_id, r, reader=True)``.

Errors: ``RingTimeoutError`` (a ``TimeoutError``) and ``PeerDeadError`` name the ring;
``FrameTooLargeError`` when an encoded message exceeds a slot; ``LayoutError`` on a dimension or
layout mismatch. A frame with a bad header (or body checksum, on rings created with
``checksum=True``), a body that is not a valid message, an unknown schema version or another
run id is logged and skipped by the reader (``get`` keeps waiting for the next one).
"""

from __future__ import annotations

import functools
import time

from xllm_eplb.ipc.broadcast import Ring
from xllm_eplb.ipc.messages import KIND_INPUT, KIND_OUTPUT, ForwardInput, ForwardOutput
from xllm_eplb.ipc.messages import decode as _decode
from xllm_eplb.ipc.messages import encode as _encode
from xllm_eplb.ipc.shm import object_name, validate_run_id

DEFAULT_SLOTS = 8
DEFAULT_INPUT_FRAME_BYTES = 1 << 20
DEFAULT_OUTPUT_FRAME_BYTES = 256 << 10


def input_ring_name(run_id: str) -> str:
    return object_name(run_id, "in")


def output_ring_name(run_id: str, rank: int) -> str:
    return object_name(run_id, f"out{int(rank)}")


def _claim_reader0(ring: Ring) -> None:
    ring.claim_reader(0)


class _MessageRing:
    """A :class:`Ring` that carries one message kind of one run."""

    _kind = ""

    def __init__(self, ring: Ring, run_id: str, rank: int | None = None):
        self.ring = ring
        #: an OutputRing's worker rank (None on the InputRing)
        self.rank = rank
        self.run_id = run_id
        self._decode_msg = functools.partial(_decode, run_id=run_id, kind=self._kind)
        self._codec_s = 0.0      # encode + decode seconds since take_codec_seconds()

    def _decoder(self, body: bytes):
        t0 = time.perf_counter()
        try:
            return self._decode_msg(body)
        finally:
            self._codec_s += time.perf_counter() - t0

    def take_codec_seconds(self) -> float:
        """Seconds spent encoding and decoding messages since the last call (the step-time
        breakdown's ring share)."""
        s, self._codec_s = self._codec_s, 0.0
        return s

    @classmethod
    def _open(cls, ring: Ring, run_id: str, claim, rank: int | None = None):
        """Wrap a created or attached ``ring`` after ``claim(ring)`` (this end: producer or
        reader; None: neither, the launcher's case); a failed claim closes the ring."""
        try:
            if claim is not None:
                claim(ring)
        except BaseException:
            ring.close()
            raise
        return cls(ring, run_id, rank)

    @property
    def name(self) -> str:
        return self.ring.name

    @property
    def generation(self) -> int:
        return self.ring.seg.generation

    def put(self, msg, timeout: float | None = None, *, bad_checksum: bool = False) -> int:
        """Encode and publish ``msg``; blocks (up to ``timeout`` s, None = forever) on a full
        ring. Returns the frame sequence number. ``bad_checksum``: fault injection only."""
        return self.ring.put_bytes(_encode(msg, self.run_id), timeout, bad_checksum=bad_checksum)

    def get(self, timeout: float | None = None, *, strict: bool = False):
        """Next valid message (bad frames are logged and skipped; ``strict``: BadFrameError)."""
        return self.ring.get_bytes(timeout, decode=self._decoder, strict=strict)

    def close(self) -> None:
        self.ring.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class InputRing(_MessageRing):
    """Engine -> workers: one producer, ``num_readers`` workers, each reads every ``ForwardInput``."""

    _kind = KIND_INPUT

    @classmethod
    def create(cls, run_id: str, num_readers: int, slots: int = DEFAULT_SLOTS,
               frame_bytes: int = DEFAULT_INPUT_FRAME_BYTES, *, producer: bool = True,
               checksum: bool = False) -> "InputRing":
        """Engine (or launcher with ``producer=False``); ``checksum=True`` adds a body
        checksum to every frame (costs ~1 us per 4 KiB per reader; see broadcast.py)."""
        ring = Ring.create(input_ring_name(validate_run_id(run_id)), num_readers, slots,
                           frame_bytes, checksum)
        return cls._open(ring, run_id, Ring.claim_producer if producer else None)

    @classmethod
    def attach(cls, run_id: str, reader_index: int | None = None, *, producer: bool = False,
               num_readers: int | None = None, slots: int | None = None,
               frame_bytes: int | None = None, timeout: float = 0.0,
               skip: bool = False) -> "InputRing":
        """Worker: ``reader_index=r``; an engine that did not create the ring: ``producer=True``.
        Dimensions given are checked against the ring (LayoutError on mismatch). ``skip``: an
        elastic replacement reader starts at the newest frame (``Ring.claim_reader``)."""
        if (reader_index is None) == (not producer):
            raise ValueError("InputRing.attach: give exactly one of reader_index / producer=True")
        ring = Ring.attach(input_ring_name(validate_run_id(run_id)), num_readers=num_readers,
                           slots=slots, frame_bytes=frame_bytes, timeout=timeout)
        return cls._open(ring, run_id, Ring.claim_producer if producer else
                         lambda r: r.claim_reader(reader_index, skip=skip))

    def put(self, msg: ForwardInput, timeout: float | None = None) -> int:
        if not isinstance(msg, ForwardInput):
            raise TypeError(f"ring {self.name}: put expects ForwardInput, got {type(msg).__name__}")
        seq = super().put(msg, timeout)
        for i in getattr(self, "retired", ()):
            self._sink(i)
        return seq

    def retire_reader(self, index: int) -> None:
        """Producer, ``--elastic_ep`` shrink: reader ``index`` (a dead worker, not replaced)
        will never read again; from now on the producer consumes its frames itself (so
        back-pressure never waits on it)."""
        self.retired = getattr(self, "retired", set()) | {int(index)}
        self._sink(index)

    def unretire_reader(self, index: int) -> None:
        """Producer, elastic rejoin: reader ``index`` reads again (a joiner claimed it at the
        newest frame, ``claim_reader(skip=True)``, while the producer put nothing)."""
        self._sink(index)
        self.retired = getattr(self, "retired", set()) - {int(index)}

    def _sink(self, index: int) -> None:
        data, space = self.ring._data[index], self.ring._space[index]
        while data.value > 0:        # frames pending for that reader: give their slots back
            data.acquire(0)
            space.release()

    def get(self, timeout: float | None = None) -> ForwardInput:
        return super().get(timeout)


class OutputRing(_MessageRing):
    """Worker ``rank`` -> engine: one producer (the worker), one reader (the engine)."""

    _kind = KIND_OUTPUT

    @classmethod
    def create(cls, run_id: str, rank: int, slots: int = DEFAULT_SLOTS,
               frame_bytes: int = DEFAULT_OUTPUT_FRAME_BYTES, *, reader: bool = True,
               checksum: bool = False) -> "OutputRing":
        """Engine (or launcher with ``reader=False``); ``checksum=True``: body checksums."""
        ring = Ring.create(output_ring_name(validate_run_id(run_id), rank), 1, slots,
                           frame_bytes, checksum)
        return cls._open(ring, run_id, _claim_reader0 if reader else None, rank)

    @classmethod
    def attach(cls, run_id: str, rank: int, *, producer: bool = True, reader: bool = False,
               slots: int | None = None, frame_bytes: int | None = None,
               timeout: float = 0.0) -> "OutputRing":
        """Worker: ``attach(run_id, rank)``; an engine that did not create it: ``reader=True``."""
        if reader:
            producer = False
        ring = Ring.attach(output_ring_name(validate_run_id(run_id), rank), num_readers=1,
                           slots=slots, frame_bytes=frame_bytes, timeout=timeout)
        return cls._open(ring, run_id, Ring.claim_producer if producer else _claim_reader0, rank)

    def put(self, msg: ForwardOutput, timeout: float | None = None, *,
            bad_checksum: bool = False) -> int:
        if not isinstance(msg, ForwardOutput):
            raise TypeError(f"ring {self.name}: put expects ForwardOutput, got {type(msg).__name__}")
        return super().put(msg, timeout, bad_checksum=bad_checksum)

    def get(self, timeout: float | None = None) -> ForwardOutput:
        """Strict: one frame per step, so a bad frame raises BadFrameError (never skipped)."""
        return super().get(timeout, strict=True)
