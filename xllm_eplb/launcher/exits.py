"""How the launcher names a child's exit and when it saw it (the console line and the launcher
log say both alike), and where its log is."""

from __future__ import annotations

import contextlib
import signal
import time

from xllm_eplb.ipc.alltoall import PEER_GONE_TEXT


def wall_clock() -> str:
    """``HH:MM:SS.mmm`` local time: when the launcher saw a death or killed a child (the
    console line and the launcher log carry the same stamp)."""
    now = time.time()
    return time.strftime("%H:%M:%S", time.localtime(now)) + f".{int(now % 1 * 1000):03d}"


def describe_exit(code: int | None) -> str:
    """``exit code 3`` / ``killed by SIGKILL`` / ``still running``."""
    if code is None:
        return "still running"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
        return f"killed by signal {-code}"
    return f"exit code {code}"


#: how a survivor's failed collective reads when a peer is gone (gloo: the peer's sockets closed;
#: --ep_transport=shm: ``ipc.alltoall.PEER_GONE_TEXT``)
PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe",
             PEER_GONE_TEXT)


def peer_gone(error: str) -> bool:
    """True when ``error`` is only the consequence of another process's death (its peer)."""
    return any(s in error for s in PEER_GONE)


def log_name(who: str) -> str:
    """Log file of a process: ``engine.log``, ``rank3.log``, ``launcher.log``."""
    return f"rank{who[2:]}.log" if who.startswith("ep") else f"{who}.log"
