"""``StepTimer``: where one forward step's wall time goes, by phase, in seconds.

One process owns one timer: a worker times its model phases and its loop, the engine its
scheduling, HTTP and ring waits. ``section(phase)`` is a context manager;
``add(phase, seconds)`` records a span measured elsewhere. ``take()`` returns the seconds
accumulated since the last ``take()`` (a ``{phase: seconds}`` dict holding only phases that
ran) and resets them, so a worker can ship its numbers with each step output.

CPU torch ops are synchronous, so ``time.perf_counter`` around a section is its cost. On CUDA
the caller synchronises where it wants the split to be exact (the timer never does).

Disabled costs nothing: :data:`NULL` has the same API and does no work.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

#: the phases a step is split into (the engine adds ``http``; unknown names are accepted)
PHASES = ("attention", "router", "experts", "dispatch", "ring", "eplb_hooks", "sampling",
          "schedule", "idle", "other")


class StepTimer:
    """Accumulates seconds per phase until :meth:`take`."""

    enabled = True

    def __init__(self) -> None:
        self._acc: dict[str, float] = {}

    def add(self, phase: str, seconds: float) -> None:
        self._acc[phase] = self._acc.get(phase, 0.0) + seconds

    @contextmanager
    def section(self, phase: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(phase, time.perf_counter() - t0)

    def take(self) -> dict[str, float]:
        """Seconds per phase since the last call; resets."""
        out, self._acc = self._acc, {}
        return out


class _NullTimer(StepTimer):
    enabled = False

    def add(self, phase: str, seconds: float) -> None:
        pass

    @contextmanager
    def section(self, phase: str):
        yield

    def take(self) -> dict[str, float]:
        return {}


#: the timer of a process that does not time its steps
NULL: StepTimer = _NullTimer()
