"""Versioned shm segments: header, attach/reclaim semantics, layout errors, races, shm ls/clean."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal

import pytest
from click.testing import CliRunner

from xllm_eplb.errors import LayoutError
from xllm_eplb.ipc.errors import SegmentBusyError, SegmentMissingError
from xllm_eplb.ipc.shm import (
    HEADER_SIZE,
    LAYOUT_VERSION,
    MAGIC,
    Segment,
    object_name,
    pack_header,
    resolve_run_id,
    shm_path,
    unpack_header,
)

CTX = mp.get_context("fork")


def _raw(name: str) -> bytes:
    with open(shm_path(name), "rb") as f:
        return f.read()


def test_header_round_trip(run_id):
    raw = pack_header(4096, 7)
    assert len(raw) == HEADER_SIZE == 64
    assert unpack_header(raw) == (MAGIC, LAYOUT_VERSION, 64, 4096, 7)
    name = object_name(run_id, "seg")
    with Segment.open(name, 100) as seg:
        assert seg.created and not seg.reclaimed and seg.generation == 1
        assert seg.header() == (MAGIC, 2, 64, 100, 1)
        assert _raw(name)[:64] == pack_header(100, 1)
        assert os.path.getsize(shm_path(name)) == 164
    assert not os.path.exists(shm_path(name)), "last holder must unlink"


def test_names_carry_the_run_prefix():
    assert resolve_run_id("", 8000) == "p8000"
    assert resolve_run_id("abc", 8000) == "abc"
    assert object_name("p8000", "in") == "/xllm_eplb_p8000_in"
    with pytest.raises(Exception, match="run_id"):
        resolve_run_id("bad_id", 1)


def test_attach_preserves_contents(run_id):
    name = object_name(run_id, "seg")
    with Segment.open(name, 64) as a:
        a.write(0, b"hello")
        with Segment.open(name, 64) as b:
            assert not b.created and b.generation == 1
            assert b.read(0, 5) == b"hello"
            b.write(5, b"!")
        assert a.read(0, 6) == b"hello!"


def _create_and_die(name, size):
    seg = Segment.open(name, size)
    seg.write(0, b"\xab" * size)
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.timeout(30)
def test_stale_reclaim_zeroes_and_bumps_generation(run_id):
    name = object_name(run_id, "seg")
    p = CTX.Process(target=_create_and_die, args=(name, 256))
    p.start()
    p.join(20)
    assert p.exitcode == -signal.SIGKILL
    raw = _raw(name)                               # the killed process left its object behind
    assert unpack_header(raw)[4] == 1 and raw[64:] == b"\xab" * 256
    with Segment.open(name, 256) as seg:
        assert seg.reclaimed and seg.created and seg.generation == 2
        assert seg.read(0, 256) == bytes(256)
        assert seg.header()[4] == 2


@pytest.mark.parametrize("size", [0, 64 + 32])
def test_incomplete_creation_of_dead_creator_is_reinitialised(run_id, size):
    name = object_name(run_id, "seg")
    with open(shm_path(name), "wb") as f:   # killed before ftruncate (0) or before the header
        f.write(bytes(size))
    with Segment.open(name, 32) as seg:
        assert seg.reclaimed and seg.generation == 1
        assert seg.header() == (MAGIC, 2, 64, 32, 1)


@pytest.mark.parametrize("what", ["size", "magic", "version", "header_size"])
@pytest.mark.parametrize("held", [True, False])
def test_mismatch_is_rejected_untouched(run_id, what, held):
    name = object_name(run_id, "seg")
    holder = Segment.open(name, 128)
    holder.write(0, b"live data")
    if what == "magic":
        holder.mm[0:8] = b"XLLMSHM1"
    elif what == "version":
        holder.mm[8:12] = (1).to_bytes(4, "little")
    elif what == "header_size":
        holder.mm[12:16] = (128).to_bytes(4, "little")
    before = _raw(name)
    if not held:  # leave a stale object behind: drop the lock but not the name
        holder.mm.close()
        holder._obj.close_fd()
    try:
        with pytest.raises(LayoutError) as ei:
            Segment.open(name, 64 if what == "size" else 128)
        msg = str(ei.value)
        assert name in msg and "shm clean" in msg and "Stop all old" in msg
        assert _raw(name) == before, "a mismatching object must never be resized or wiped"
    finally:
        if held:
            holder.close()


def test_modes_create_and_attach(run_id):
    name = object_name(run_id, "seg")
    with pytest.raises(SegmentMissingError):
        Segment.open(name, 16, mode="attach")
    with Segment.open(name, 16, mode="create"):
        with pytest.raises(SegmentBusyError, match=name):
            Segment.open(name, 16, mode="create")
        with Segment.open(name, None, mode="attach") as b:
            assert b.payload_size == 16
    with pytest.raises(ValueError):
        Segment.open(name, 16, mode="bogus")


def test_no_per_segment_lock_objects(run_id):
    name = object_name(run_id, "seg")
    with Segment.open(name, 16), Segment.open(name, 16):
        mine = [f for f in os.listdir("/dev/shm") if run_id in f]
        assert mine == [name.lstrip("/")]


def _die_holding_the_generation_lock():
    from xllm_eplb.ipc.shm import generation_lock

    with generation_lock():
        os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.timeout(30)
def test_killed_generation_lock_holder_blocks_nobody(run_id):
    p = CTX.Process(target=_die_holding_the_generation_lock)
    p.start()
    p.join(20)
    assert p.exitcode == -signal.SIGKILL
    with Segment.open(object_name(run_id, "seg"), 16) as seg:   # would hang if still locked
        assert seg.generation == 1


def _race_worker(name, iters, seed, q):
    rnd = random.Random(seed)
    bad = []
    for _ in range(iters):
        seg = Segment.open(name, 64)
        if seg.created:
            seg.write(0, os.getpid().to_bytes(8, "little"))
        for _ in range(rnd.randint(0, 3)):
            os.sched_yield()
        try:
            ino_now = os.stat(shm_path(name)).st_ino
        except FileNotFoundError:
            ino_now = None
        if ino_now != os.fstat(seg._obj.fd).st_ino:
            bad.append("name points at another object while mapped")
        if seg.generation != 1 or seg.header()[4] != 1:
            bad.append(f"generation {seg.generation}")
        seg.close()
    q.put(bad)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_concurrent_attach_close_agree_on_one_generation(run_id):
    name = object_name(run_id, "race")
    q = CTX.Queue()
    procs = [CTX.Process(target=_race_worker, args=(name, 60, i, q)) for i in range(8)]
    for p in procs:
        p.start()
    try:
        results = [q.get(timeout=50) for _ in procs]
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs)
    assert [r for r in results if r] == []
    assert not os.path.exists(shm_path(name))


def test_cli_ls_and_clean(run_id):
    from xllm_eplb.commands.shm import shm

    live = Segment.open(object_name(run_id, "live"), 32)
    dead = Segment.open(object_name(run_id, "dead"), 32)
    dead.mm.close()
    dead._obj.close_fd()          # as if killed: object stays, nobody holds it
    runner = CliRunner()
    try:
        out = runner.invoke(shm, ["ls", "--run-id", run_id]).output
        assert f"/xllm_eplb_{run_id}_live" in out and f"/xllm_eplb_{run_id}_dead" in out
        assert str(os.getpid()) in out
        res = runner.invoke(shm, ["clean", "--run-id", run_id])
        assert res.exit_code == 0
        assert f"removed segment /xllm_eplb_{run_id}_dead" in res.output
        assert "_live" not in res.output.split("removed 1")[0]
        assert os.path.exists(shm_path(live.name))
        assert not os.path.exists(shm_path(dead.name))
    finally:
        live.close()
    assert runner.invoke(shm, ["ls", "--run-id", run_id]).output.startswith("no xllm-eplb")
