"""Is a registered peer process still running? (pid + start time, zombies count as dead)."""

from __future__ import annotations

import os

CLOSED = (1 << 64) - 1  # start-time marker written by a peer that closed its end cleanly


def proc_start_time(pid: int) -> int | None:
    """Start time (clock ticks since boot) of a running, non-zombie ``pid``; None otherwise."""
    if pid <= 0:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    # fields after the ")" that closes the command name: state is field 3, starttime field 22
    rest = raw[raw.rfind(b")") + 2:].split()
    if len(rest) < 20 or rest[0] in (b"Z", b"X"):
        return None
    try:
        return int(rest[19])
    except ValueError:
        return None


def self_identity() -> tuple[int, int]:
    """``(pid, start_time)`` of this process, for registration in a ring header."""
    pid = os.getpid()
    return pid, proc_start_time(pid) or 0


def peer_gone(pid: int, start: int) -> bool:
    """True when a registered peer has exited or closed its end (pid 0 = not registered yet)."""
    if pid == 0:
        return False
    if start == CLOSED:
        return True
    now = proc_start_time(pid)
    return now is None or (start != 0 and now != start)
