"""Process hygiene for the launcher's children (engine and workers call these first).

Every child names itself, ignores terminal ^C (only the launcher decides when to stop), dies
with the launcher (Linux ``PR_SET_PDEATHSIG`` plus a parent-pid check), reports start-up stages
on the launcher's event queue and leaves with ``os._exit``.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1

def child_setup(title: str, parent_pid: int, deathsig: int = signal.SIGKILL) -> None:
    """Name the process, ignore terminal ^C, and die with the launcher.

    ``deathsig`` is delivered when the launcher dies (Linux ``PR_SET_PDEATHSIG``); the parent
    check covers a launcher that died before the call.
    """
    with contextlib.suppress(Exception):
        import setproctitle

        setproctitle.setproctitle(title)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(deathsig), 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(1)


def child_exit(code: int, events=None) -> None:
    """Leave a child process now: flush the event queue and stdio, then ``os._exit`` (skips
    interpreter teardown, which with torch loaded can take seconds on a busy machine)."""
    if events is not None:
        with contextlib.suppress(Exception):
            events.close()
            events.join_thread()
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def parent_alive(parent_pid: int) -> bool:
    return os.getppid() == parent_pid


def send_event(events, who: str, stage: str, detail: str = "") -> None:
    """Report a start-up stage (``who``: ``engine`` or ``ep<r>``) to the launcher."""
    with contextlib.suppress(Exception):
        events.put((who, stage, detail))
