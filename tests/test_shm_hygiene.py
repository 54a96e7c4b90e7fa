"""Shared-memory hygiene (issue #23 item 11): the start-of-serve sweep removes the objects of
dead runs only (never a run someone holds or maps, never a young one), and the launcher's event
channel and ``testing.dist`` create no ``sem.mp-*`` semaphores."""

from __future__ import annotations

import mmap
import multiprocessing as mp
import os
import queue
import signal
import time
import uuid

import posix_ipc
import pytest

from xllm_eplb.ipc import objects
from xllm_eplb.ipc.ring import InputRing
from xllm_eplb.ipc.shm import Segment, object_name, run_prefix, shm_path

CTX = mp.get_context("fork")
OLD = 3600.0


def _rid() -> str:
    return "h" + uuid.uuid4().hex[:10]


def _names(rid: str) -> list[str]:
    return sorted(f for f in os.listdir("/dev/shm") if run_prefix(rid) in f)


def _age(rid: str, seconds: float) -> None:
    t = time.time() - seconds
    for f in _names(rid):
        os.utime(os.path.join("/dev/shm", f), (t, t))


def _killed_creator(rid: str) -> None:
    """A run whose every process was SIGKILLed: a ring (segment + semaphores) left behind."""
    def child():
        InputRing.create(rid, 2, 4, 4096)
        os.kill(os.getpid(), signal.SIGKILL)

    p = CTX.Process(target=child)
    p.start()
    p.join(30)
    assert p.exitcode == -signal.SIGKILL


@pytest.fixture
def rids():
    made: list[str] = []

    def new() -> str:
        made.append(_rid())
        return made[-1]

    yield new
    for r in made:
        objects.clean(r, force=True)
        assert _names(r) == []


def test_sweep_removes_only_dead_old_unmapped_runs(rids):
    dead, young, held, mapped = rids(), rids(), rids(), rids()
    for r in (dead, young, held, mapped):
        _killed_creator(r)
    left = _names(dead)
    assert left and any(n.startswith("sem.") for n in left)
    _age(dead, OLD)
    # held: a live process maps it and holds its flock (Segment.open)
    seg = Segment.open(object_name(held, "extra"), 64)
    _age(held, OLD)
    # mapped without any flock (a mapping outlives its fd), and one semaphore open
    fd = os.open(shm_path(object_name(mapped, "in")), os.O_RDWR)
    mm = mmap.mmap(fd, 0)
    os.close(fd)
    _age(mapped, OLD)
    sem_only = rids()
    _killed_creator(sem_only)
    sem_name = "/" + next(n for n in _names(sem_only) if n.startswith("sem."))[4:]
    posix_ipc.unlink_shared_memory(object_name(sem_only, "in"))
    sem = posix_ipc.Semaphore(sem_name)      # mapped by this process
    _age(sem_only, OLD)
    try:
        mine = {dead, young, held, mapped, sem_only}
        assert set(objects.dead_runs(run_ids=mine)) == {dead}
        removed = objects.sweep_dead_runs(run_ids=mine)
        assert removed == {dead: len(left)}     # the segment and its semaphores
        assert _names(dead) == []
        for r in (young, held, mapped, sem_only):
            assert _names(r), r
    finally:
        sem.close()
        mm.close()
        seg.close()


@pytest.mark.slow            # a child process and gloo ranks (make test-fast skips it)
def test_event_channel_and_run_ranks_create_no_named_semaphores():
    from xllm_eplb.launcher import EventHub
    from xllm_eplb.testing.dist import run_ranks

    before = {f for f in os.listdir("/dev/shm") if f.startswith("sem.mp-")}
    hub = EventHub(mp.get_context("spawn"))
    sender = hub.sender("engine")

    def child():       # echoes the launcher's notice back as an event
        sender.put(("engine", "ready", ""))
        sender.put(("engine", "echo", repr(sender.notice(10))))

    p = CTX.Process(target=child)
    p.start()
    hub.spawned(sender)
    assert hub.get(5) == ("engine", "ready", "")
    assert hub.notify("engine", ("died", "ep1", "killed by SIGKILL"))
    assert hub.get(5) == ("engine", "echo", repr(("died", "ep1", "killed by SIGKILL")))
    p.join(10)
    with pytest.raises(queue.Empty):     # once the child is gone
        hub.get(0.2)
    assert hub.notify("engine", "late") is False
    hub.close()
    assert run_ranks(_rank_sum, 2, timeout=60) == [1, 1]
    mine = {f for f in os.listdir("/dev/shm") if f.startswith("sem.mp-")} - before
    # other processes on the machine may create their own; none of ours is mapped here
    assert not [m for m in mine if m in open(f"/proc/{os.getpid()}/maps").read()]


def _rank_sum(rank: int, world: int) -> int:
    import torch
    import torch.distributed as dist

    x = torch.ones(1)
    dist.all_reduce(x)
    return int(x.item()) - 1
