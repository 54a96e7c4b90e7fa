"""Forward rings across real processes: order, back-pressure, dead peers, bad frames, cleanup."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import time
import uuid

import numpy as np
import pytest

from xllm_eplb.errors import LayoutError
from xllm_eplb.ipc import objects
from xllm_eplb.ipc.broadcast import FRAME_HEADER, Ring
from xllm_eplb.ipc.errors import (
    FrameTooLargeError,
    PeerDeadError,
    RingTimeoutError,
    SegmentBusyError,
    SegmentMissingError,
)
from xllm_eplb.ipc.messages import SCHEMA_VERSION, ForwardInput, ForwardOutput, encode
from xllm_eplb.ipc.ring import InputRing, OutputRing
from xllm_eplb.ipc.shm import run_prefix
from xllm_eplb.model.batch import RankBatch, SeqRow

CTX = mp.get_context("fork")


def _mine(rid):
    return [f for f in os.listdir("/dev/shm") if run_prefix(rid) in f]


@pytest.fixture
def run_id():
    rid = "t" + uuid.uuid4().hex[:10]
    yield rid
    objects.clean(rid, force=True)
    assert not _mine(rid)


def _reap(procs, timeout=10):
    for p in procs:
        p.join(timeout)
        if p.is_alive():
            p.kill()
            p.join(5)


def test_single_process_order_and_wraparound(run_id):
    with InputRing.create(run_id, 2, slots=3, frame_bytes=1024) as eng, \
            InputRing.attach(run_id, 0) as w0, InputRing.attach(run_id, 1) as w1:
        for step in range(10):
            eng.put(ForwardInput(step, [RankBatch([SeqRow(step, [1, 2], 0, True)])]), timeout=1)
            assert w0.get(timeout=1).step == step
            assert w1.get(timeout=1).batches[0].rows[0].req_id == step
        assert eng.ring.put_bytes(b"", timeout=1) == 10        # sequence numbers
    assert not _mine(run_id), "clean shutdown leaves nothing in /dev/shm"


def test_timeouts_name_the_ring(run_id):
    with InputRing.create(run_id, 1, slots=2, frame_bytes=1024) as eng, \
            InputRing.attach(run_id, 0) as w0:
        with pytest.raises(RingTimeoutError, match=f"/xllm_eplb_{run_id}_in") as ei:
            w0.get(timeout=0.05)
        assert isinstance(ei.value, TimeoutError)
        eng.put(ForwardInput(0), timeout=0)
        eng.put(ForwardInput(1), timeout=0)
        with pytest.raises(RingTimeoutError, match="reader 0 to free a slot"):
            eng.put(ForwardInput(2), timeout=0.05)
        assert [w0.get(0).step, w0.get(0).step] == [0, 1]
        eng.put(ForwardInput(3), timeout=0)
        assert w0.get(0).step == 3


def test_frame_too_large_is_rejected_and_ring_stays_usable(run_id):
    with InputRing.create(run_id, 1, slots=2, frame_bytes=1024) as eng, \
            InputRing.attach(run_id, 0) as w0:
        big = ForwardInput(0, [RankBatch([SeqRow(1, list(range(2000)), 0, True)])])
        with pytest.raises(FrameTooLargeError, match=r"exceeds the slot capacity of 992 bytes"):
            eng.put(big, timeout=1)
        eng.put(ForwardInput(1), timeout=1)
        assert w0.get(timeout=1).step == 1


def test_layout_and_ownership_errors(run_id):
    with pytest.raises(SegmentMissingError):
        InputRing.attach(run_id, 0)
    with InputRing.create(run_id, 2, slots=4, frame_bytes=2048):
        with pytest.raises(LayoutError, match="slots 4 != expected 8"):
            InputRing.attach(run_id, 0, slots=8)
        with pytest.raises(SegmentBusyError):
            InputRing.create(run_id, 2, slots=4, frame_bytes=2048)
        with pytest.raises(ValueError, match="reader index 5"):
            InputRing.attach(run_id, 5)
        with InputRing.attach(run_id, 1):
            pass                                    # a closed reader slot can be taken again
        with InputRing.attach(run_id, 0):
            with pytest.raises(SegmentBusyError, match="reader 0 is already attached"):
                InputRing.attach(run_id, 0)


def _worker(run_id, rank, n, slow, kill_at):
    """Read n inputs, echo each as an output; record back-pressure as seen by the reader."""
    inp = InputRing.attach(run_id, reader_index=rank, timeout=10)
    out = OutputRing.attach(run_id, rank, timeout=10)
    max_pending = 0
    for i in range(n):
        if i == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        msg = inp.get(timeout=20)
        max_pending = max(max_pending, inp.ring.pending())
        if slow:
            time.sleep(0.002)
        # the reader's worst back-pressure rides in an int field of the output
        out.put(ForwardOutput(msg.step, rank, np.full((2, 3), msg.step), sampled={i: rank},
                              prepared_token=max_pending), timeout=20)
    inp.close()
    out.close()


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_order_and_back_pressure_across_processes(run_id):
    n, slots, workers = 60, 4, 3
    eng = InputRing.create(run_id, workers, slots=slots, frame_bytes=4096)
    outs = [OutputRing.create(run_id, r, slots=64, frame_bytes=4096) for r in range(workers)]
    procs = [CTX.Process(target=_worker, args=(run_id, r, n, r == 0, -1)) for r in range(workers)]
    for p in procs:
        p.start()
    try:
        for step in range(n):   # the producer runs ahead until the slow reader blocks it
            eng.put(ForwardInput(step), timeout=20)
        for r, o in enumerate(outs):
            got = [o.get(timeout=20) for _ in range(n)]
            assert [g.step for g in got] == list(range(n))
            assert all(g.rank == r and int(g.counters[1, 2]) == g.step for g in got)
            # never more than a full ring of unread frames (the producer may refill the slot
            # freed by the get just before pending() is read); the slow reader hit the limit
            worst = max(g.prepared_token for g in got)
            assert worst <= slots and (r != 0 or worst >= slots - 1)
    finally:
        _reap(procs)
        eng.close()
        for o in outs:
            o.close()
    assert all(p.exitcode == 0 for p in procs)
    assert not _mine(run_id)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_kill_9_of_worker_while_engine_waits(run_id):
    eng = InputRing.create(run_id, 2, slots=2, frame_bytes=4096)
    outs = [OutputRing.create(run_id, r, slots=4, frame_bytes=4096) for r in range(2)]
    for o in outs:
        o.ring.poll_interval = 0.05
    eng.ring.poll_interval = 0.05
    procs = [CTX.Process(target=_worker, args=(run_id, r, 10, False, 3 if r == 1 else -1))
             for r in range(2)]
    for p in procs:
        p.start()
    try:
        for step in range(3):
            eng.put(ForwardInput(step), timeout=10)
            assert [o.get(timeout=10).step for o in outs] == [step, step]
        eng.put(ForwardInput(3), timeout=10)
        assert outs[0].get(timeout=10).step == 3
        t0 = time.monotonic()
        with pytest.raises(PeerDeadError, match=r"out1: producer \(pid \d+\) is gone"):
            outs[1].get(timeout=30)          # worker 1 was SIGKILLed before reading step 3
        assert time.monotonic() - t0 < 29    # detected by liveness, not by the timeout
        # the producer too: reader 1 is a full ring behind and dead
        eng.put(ForwardInput(4), timeout=10)
        with pytest.raises(PeerDeadError, match="reader 1"):
            eng.put(ForwardInput(5), timeout=30)
    finally:
        for p in procs:
            p.kill()
        _reap(procs)
        eng.close()
        for o in outs:
            o.close()
    assert procs[1].exitcode == -signal.SIGKILL
    assert not _mine(run_id), "the engine's close removes everything despite the killed worker"


def _engine_dies(run_id):
    InputRing.create(run_id, 1, slots=2, frame_bytes=1024)
    OutputRing.create(run_id, 0, slots=2, frame_bytes=1024)
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_sigkill_leaves_only_reclaimable_objects(run_id):
    p = CTX.Process(target=_engine_dies, args=(run_id,))
    p.start()
    p.join(20)
    assert p.exitcode == -signal.SIGKILL
    assert len(_mine(run_id)) == 2 + 4              # 2 segments + 2 semaphore pairs
    with pytest.raises(SegmentMissingError, match="no live holder"):
        InputRing.attach(run_id, 0)                 # nobody to talk to
    with InputRing.create(run_id, 1, slots=2, frame_bytes=1024) as eng, \
            InputRing.attach(run_id, 0) as w:       # a new run reclaims the stale objects
        assert eng.generation == 2
        eng.put(ForwardInput(7), timeout=1)
        assert w.get(timeout=1).step == 7
    removed = objects.clean(run_id)                 # what is left: the dead run's out0
    assert sorted(o.name for o in removed) == sorted(
        f"/xllm_eplb_{run_id}_out0{s}" for s in ("", "_d0", "_s0"))
    assert not _mine(run_id)


def _reader_sees_dead_producer(run_id, q):
    w = InputRing.attach(run_id, 0, timeout=10)
    w.ring.poll_interval = 0.05
    try:
        w.get(timeout=30)
        q.put("no error")
    except PeerDeadError as e:
        q.put(str(e))
    w.close()


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_worker_detects_dead_engine(run_id):
    q = CTX.Queue()
    eng = InputRing.create(run_id, 1, slots=2, frame_bytes=1024)
    p = CTX.Process(target=_reader_sees_dead_producer, args=(run_id, q))
    p.start()
    try:
        time.sleep(0.2)
        eng.close()                                 # closed end counts as gone
        assert "producer" in q.get(timeout=20)
    finally:
        _reap([p])


def test_bad_frames_are_logged_and_skipped(run_id, caplog):
    caplog.set_level(logging.ERROR)
    with InputRing.create(run_id, 1, slots=8, frame_bytes=1024, checksum=True) as eng, \
            InputRing.attach(run_id, 0) as w:
        ring: Ring = eng.ring
        eng.ring.put_bytes(encode(ForwardInput(1), "otherrun"), timeout=1)   # another run
        body = bytearray(encode(ForwardInput(2), run_id))
        v = b"\xa1v" + bytes([SCHEMA_VERSION])                               # "v": version
        ring.put_bytes(bytes(body).replace(v, b"\xa1v\x09"), timeout=1)       # schema 9
        seq = ring.put_bytes(encode(ForwardInput(3), run_id), timeout=1)
        off = ring._frames + (seq % ring.slots) * ring.frame_bytes + FRAME_HEADER
        ring.seg.write(off + 3, b"\xff\xff")                                  # corrupted body
        ring.put_bytes(b"\x93\x01", timeout=1)                                # truncated msgpack
        eng.put(ForwardInput(4), timeout=1)
        assert w.get(timeout=1).step == 4
        errors = [r.getMessage() for r in caplog.records if "bad frame" in r.getMessage()]
        assert len(errors) == 4
        assert all(f"ring=/xllm_eplb_{run_id}_in" in e for e in errors)
        assert "otherrun" in errors[0] and "schema version 9" in errors[1]
        assert "checksum mismatch" in errors[2] and "not msgpack" in errors[3]


@pytest.mark.parametrize("size", [1000, 20000, 65536 + 3])
def test_checksums_catch_corruption_small_and_large(run_id, size, caplog):
    from xllm_eplb.ipc import checksum as ck

    body = os.urandom(size)
    algo = ck.algo_for(size)
    assert algo == (ck.CRC32 if size < ck.SUM_THRESHOLD else ck.SUM64)
    flipped = bytearray(body)
    flipped[size // 2] ^= 0x40
    assert ck.checksum(bytes(flipped), algo) != ck.checksum(body, algo)
    assert ck.checksum(body[:-1], algo) != ck.checksum(body, algo)     # truncation / tail byte
    caplog.set_level(logging.ERROR)
    with InputRing.create(run_id, 1, slots=4, frame_bytes=size + 64, checksum=True) as eng, \
            InputRing.attach(run_id, 0) as w:
        ring = eng.ring
        assert w.ring.checksum                      # the reader learns it from the header
        seq = ring.put_bytes(body, timeout=1)
        off = ring._frames + (seq % ring.slots) * ring.frame_bytes + FRAME_HEADER
        ring.seg.write(off + size // 2, bytes([body[size // 2] ^ 0x40]))
        ring.put_bytes(body, timeout=1)
        assert w.ring.get_bytes(timeout=1) == body and w.ring.pending() == 0
        assert any("checksum mismatch" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("where", [0, 4, 8, 20])   # magic, length, seq, checksum kind
def test_default_ring_checks_every_frame_header(run_id, where, caplog):
    caplog.set_level(logging.ERROR)
    with InputRing.create(run_id, 1, slots=4, frame_bytes=1024) as eng, \
            InputRing.attach(run_id, 0) as w:
        assert not w.ring.checksum                  # default: no body checksum
        eng.put(ForwardInput(1), timeout=1)
        ring = eng.ring
        ring.seg.write(ring._frames + where, b"\x07")
        eng.put(ForwardInput(2), timeout=1)
        assert w.get(timeout=1).step == 2
        assert any("header crc mismatch" in r.getMessage() for r in caplog.records)


def test_short_timeouts_and_frame_header_crc(run_id):
    """A get timeout below / above one poll slice is honoured; frames still arrive after a
    timed-out get; the stored header crc is crc32 of the 24 header bytes (wire format)."""
    import zlib

    with InputRing.create(run_id, 3, slots=2, frame_bytes=1024) as eng, \
            InputRing.attach(run_id, 2) as w:
        w.ring.poll_interval = 0.02
        for timeout in (0, 0.01, 0.07):             # inside the first slice / several slices
            t0 = time.monotonic()
            with pytest.raises(RingTimeoutError, match="timed out waiting for a frame"):
                w.get(timeout=timeout)
            assert time.monotonic() - t0 >= timeout * 0.9
        seq = eng.ring.put_bytes(b"x" * 100, timeout=1)
        assert w.ring.get_bytes(timeout=1) == b"x" * 100
        off = eng.ring._frames + (seq % eng.ring.slots) * eng.ring.frame_bytes
        raw = eng.ring.seg.read(off, 28)
        assert raw[:4] == b"FRM1"
        assert zlib.crc32(raw[:24]) == int.from_bytes(raw[24:28], "little")
