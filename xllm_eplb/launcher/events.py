"""The launcher's end of the launcher <-> child channels (the children's end:
``child.EventSender``)."""

from __future__ import annotations

import contextlib
import multiprocessing.connection as mpc
import queue
import time

from xllm_eplb.child import EventSender


class EventHub:
    """The launcher's end of its children's event channels: one pipe per child (duplex, so the
    launcher can also send a child a notice), read with ``get`` as a queue of
    ``(who, stage, detail)`` tuples. No named semaphore is created (see ``child.py``)."""

    def __init__(self, ctx):
        self.ctx = ctx
        self.readers: dict[str, object] = {}    # who -> launcher end
        self._pending: list = []

    def sender(self, who: str) -> EventSender:
        """A new channel for child ``who``: its end (pass it to the spawned process, then call
        :meth:`spawned`)."""
        mine, theirs = self.ctx.Pipe(duplex=True)
        self.readers[who] = mine
        return EventSender(theirs)

    @staticmethod
    def spawned(sender: EventSender) -> None:
        """Close the launcher's copy of a child's end once the child has started (it holds
        its own): the launcher then sees EOF when the child is gone."""
        sender.close()

    def get(self, timeout: float):
        """The next event; raises ``queue.Empty`` after ``timeout`` seconds without one."""
        if not self._pending:
            live = list(self.readers.values())
            for conn in mpc.wait(live, timeout) if live else ():
                self._read(conn)
        if not self._pending:
            time.sleep(0 if self.readers else min(timeout, 0.05))
            raise queue.Empty
        return self._pending.pop(0)

    def _read(self, conn) -> None:
        try:
            while conn.poll():
                self._pending.append(conn.recv())
        except Exception:  # noqa: BLE001 - EOF, or a child killed mid-write: channel gone
            self.readers = {w: c for w, c in self.readers.items() if c is not conn}
            with contextlib.suppress(OSError):
                conn.close()

    def notify(self, who: str, notice) -> bool:
        """Send child ``who`` a notice (best effort; False when its channel is gone)."""
        conn = self.readers.get(who)
        if conn is None:
            return False
        try:
            conn.send(notice)
            return True
        except OSError:
            return False

    def close(self) -> None:
        for conn in self.readers.values():
            with contextlib.suppress(OSError):
                conn.close()
        self.readers = {}

    def join_thread(self) -> None:
        """Nothing to wait for; kept for the Queue interface."""
