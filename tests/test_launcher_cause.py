"""The launcher names the cause of a failure, not its consequence (real processes and the real
event pipes): a survivor whose collective failed ("Connection reset by peer") may exit and be
seen before the rank that crashed; the launcher still names the crashed one."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest

from xllm_eplb.child import child_exit, send_event
from xllm_eplb.launcher.events import EventHub
from xllm_eplb.launcher.exits import peer_gone
from xllm_eplb.launcher.launcher import Launcher

pytestmark = pytest.mark.timeout(60)


def _die(events, who: str, detail: str, code: int, delay: float) -> None:
    time.sleep(delay)
    send_event(events, who, "error", detail)
    child_exit(code, events)


def _launcher(ctx, children: list[tuple[str, str, int, float]]) -> Launcher:
    """A real Launcher (no config needed for this part) supervising ``children``."""
    la = Launcher.__new__(Launcher)
    la.ctx, la.events, la.procs, la.errors = ctx, EventHub(ctx), {}, {}
    la.progress, la.t0 = None, time.monotonic()
    la.joining, la.dropped = {}, set()
    for who, detail, code, delay in children:
        sender = la.events.sender(who)
        la.procs[who] = ctx.Process(target=_die, args=(sender, who, detail, code, delay))
        la.procs[who].start()
        la.events.spawned(sender)
    return la


def _wait_exit(la: Launcher, who: str) -> None:
    la.procs[who].join(30)
    assert la.procs[who].exitcode is not None


@pytest.mark.parametrize("crash_delay", [0.3, 0.0])
def test_the_crashed_rank_is_named_when_a_survivor_exits_first(crash_delay):
    ctx = mp.get_context("fork")
    la = _launcher(ctx, [
        ("ep0", "rank 0: RuntimeError: [gloo] Connection reset by peer", 1, 0.0),
        ("ep1", "rank 1: injected crash at phase=mid_transfer layer=0 round=1", 86, crash_delay),
        ("ep2", "", 0, 5.0)])           # a survivor still running
    try:
        _wait_exit(la, "ep0")            # the consequence is seen first
        la._drain_events()
        assert list(la.errors)[0] in ("ep0", "ep1")
        assert la._first_failed("ep0") == "ep1"
        assert "phase=mid_transfer" in la.errors["ep1"]
    finally:
        for p in la.procs.values():
            p.kill()
            p.join(10)
        la.events.close()


def test_a_lost_peer_alone_is_still_named_after_the_wait():
    """No other cause shows up: the survivor that reported is named (after CAUSE_WAIT)."""
    ctx = mp.get_context("fork")
    la = _launcher(ctx, [("ep0", "rank 0: RuntimeError: Connection closed by peer", 1, 0.0),
                         ("ep1", "", 0, 5.0)])
    try:
        _wait_exit(la, "ep0")
        t0 = time.monotonic()
        assert la._first_failed("ep0") == "ep0"
        assert time.monotonic() - t0 < 3.0
    finally:
        for p in la.procs.values():
            p.kill()
            p.join(10)
        la.events.close()


def test_peer_gone_tells_consequences_from_causes():
    assert peer_gone("rank 0: RuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection "
                     "closed by peer [127.0.0.1]:1234")
    assert peer_gone("rank 2: RuntimeError: Connection reset by peer")
    assert not peer_gone("rank 1: injected crash at phase=mid_transfer layer=3 round=1")
    assert not peer_gone("rank 1: ValueError: expert 7 has no replica")
