"""Process hygiene for the launcher's children (engine and workers call these first).

Every child names itself, ignores terminal ^C (only the launcher decides when to stop; the
launcher spawns it with SIGINT already ignored, :func:`spawn_ignoring_sigint`, so a ^C while it
still imports is ignored too), dies
with the launcher (Linux ``PR_SET_PDEATHSIG`` plus a parent-pid check), reports start-up stages
on its end of the launcher's event channel (:class:`EventSender`) and leaves with ``os._exit``.

NOTE: the event channel is one pipe per child, not a ``multiprocessing.Queue``: a spawn-context
Queue is three named POSIX semaphores (``/dev/shm/sem.mp-*``) that only the creator's resource
tracker unlinks, so a launcher SIGKILLed together with its tracker (a killed process group)
left them behind (issue #23 item 11). A pipe is an fd: the kernel frees it with its holders.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading

PR_SET_PDEATHSIG = 1
#: ``PR_SET_PDEATHSIG`` of the children that act on their launcher's death (the engine, a node's
#: relay), not SIGTERM, which a live launcher sends for a stop: Linux sends it as soon as the
#: launcher's spawning thread exits, while a SIGKILLed launcher's other threads may still be
#: going (its pid still the child's parent for a moment), so only this signal tells a child
#: for certain that its launcher died (:func:`on_launcher_death`)
LAUNCHER_DEATHSIG = signal.SIGUSR1
_launcher_died = False


def child_setup(title: str, parent_pid: int, deathsig: int = signal.SIGKILL,
                on_death=None) -> None:
    """Name the process, ignore terminal ^C, and die with the launcher.

    ``deathsig`` is delivered when the launcher dies (Linux ``PR_SET_PDEATHSIG``); with
    ``on_death`` it is :data:`LAUNCHER_DEATHSIG` instead, handled by ``on_death()``
    (:func:`on_launcher_death`, installed before the death signal is armed). The parent check
    covers a launcher that died before the call.
    """
    with contextlib.suppress(Exception):
        import setproctitle

        setproctitle.setproctitle(title)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # the launcher spawned this process with SIGINT blocked (spawn_ignoring_sigint)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    if on_death is not None:
        on_launcher_death(on_death)
        deathsig = LAUNCHER_DEATHSIG
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(deathsig), 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(1)


@contextlib.contextmanager
def spawn_ignoring_sigint():
    """Around a spawn (the launcher's main thread): the child starts with SIGINT ignored, from
    its first instruction, so a terminal ^C (sent to the whole process group) while it still
    imports torch ends no child with a ``KeyboardInterrupt`` traceback.

    NOTE: an ignored disposition survives ``exec`` and Python leaves an inherited SIG_IGN in
    place (it installs its ``KeyboardInterrupt`` handler only over SIG_DFL); a handled one is
    reset to SIG_DFL by ``exec``. The launcher's own SIGINT is blocked meanwhile: Linux keeps a
    blocked signal pending even while it is ignored, so a ^C during the spawn still reaches the
    launcher's handler once the mask is restored (:func:`child_setup` unblocks it in the child).
    Off the main thread (no signal handling there) it changes nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


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
    """False once :data:`LAUNCHER_DEATHSIG` came (:func:`on_launcher_death`) or the process was
    re-parented."""
    return not _launcher_died and os.getppid() == parent_pid


def on_launcher_death(action) -> None:
    """On :data:`LAUNCHER_DEATHSIG` (armed by ``child_setup(..., on_death=)``): from then on
    :func:`parent_alive` is False, then ``action()`` runs (in the signal handler); a later call
    replaces the action (the engine's serving loop stops differently from its start-up)."""
    def handler(*_args) -> None:
        global _launcher_died
        _launcher_died = True
        action()

    signal.signal(LAUNCHER_DEATHSIG, handler)


def send_event(events, who: str, stage: str, detail: str = "") -> None:
    """Report a start-up stage (``who``: ``engine`` or ``ep<r>``) to the launcher."""
    with contextlib.suppress(Exception):
        events.put((who, stage, detail))


class EventSender:
    """A child's end of the launcher's event channel (one pipe per child; picklable into a
    spawned child). ``put((who, stage, detail))`` is thread-safe (one lock per process);
    ``notice(timeout)`` reads what the launcher sent this child (the engine: a worker's death,
    ``("died", who, detail)``), or None."""

    def __init__(self, conn):
        self.conn = conn
        self._lock = threading.Lock()

    def __getstate__(self):
        return {"conn": self.conn}

    def __setstate__(self, state):
        self.conn, self._lock = state["conn"], threading.Lock()

    def put(self, item) -> None:
        with self._lock:
            self.conn.send(item)

    def notice(self, timeout: float = 0.0):
        """The launcher's next notice to this child, or None within ``timeout`` seconds."""
        try:
            if self.conn.poll(timeout):
                return self.conn.recv()
        except (EOFError, OSError):
            pass
        return None

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.close()

    def join_thread(self) -> None:
        """Nothing to wait for (a pipe write is synchronous); kept for the Queue interface."""
