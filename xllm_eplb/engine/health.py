"""Step-in-flight tracking and stall detection, read at scrape time by ``/health`` and
``/metrics`` (HTTP thread) while the step loop writes (plain attribute stores; no lock needed).

A step that has run longer than ``--stall_seconds`` is a stall. The ranks it waits on are the
ones that have not yet read the step's input frame (a frozen or dead worker never reads it; the
others then block in the MoE all-to-all after reading); when every rank has read it, the ranks
whose output has not arrived.
"""

from __future__ import annotations

import contextlib
import time

from xllm_eplb.ipc.ring_layout import READER, RING_HEADER, U64, WSEQ

#: a step in flight longer than this names the ranks it waits on in /health (``degraded``)
SUSPECT_SECONDS = 1.0


def reader_behind(ring, index: int) -> bool:
    """True when reader ``index`` of the broadcast ``ring`` has not read the newest frame
    (its read sequence, kept in the ring header, is behind the write sequence)."""
    wseq = U64.unpack(ring.seg.read(WSEQ, 8))[0]
    rseq = U64.unpack(ring.seg.read(RING_HEADER + READER.size * index, 8))[0]
    return rseq < wseq


class StepWatch:
    """The engine's in-flight step: when it started and which ranks have answered."""

    def __init__(self, ep_size: int, stall_seconds: float):
        self.D, self.stall_seconds = ep_size, stall_seconds
        self.started = 0.0                  # time.monotonic() of the in-flight step, 0 = none
        self.answered = [False] * ep_size
        self.last_done = time.monotonic()
        #: the input-ring reader (= worker) of each rank; an elastic shrink compacts the ranks
        self.readers = list(range(ep_size))

    def resize(self, readers: list[int]) -> None:
        """Elastic shrink: rank ``r`` is now worker ``readers[r]``."""
        self.D, self.readers, self.answered = len(readers), list(readers), [False] * len(readers)

    def begin(self) -> None:
        self.answered = [False] * self.D
        self.started = time.monotonic()

    def answer(self, rank: int) -> None:
        self.answered[rank] = True

    def end(self) -> None:
        self.started = 0.0
        self.last_done = time.monotonic()

    def in_flight_seconds(self) -> float:
        s = self.started
        return time.monotonic() - s if s else 0.0

    def waiting_on(self, inp=None, outs=None) -> list[int]:
        """Ranks the in-flight step waits on (see the module docstring); [] when none."""
        if not self.started:
            return []
        answered = list(self.answered)
        pending = [r for r in range(self.D) if not answered[r]]
        if outs is not None:
            pending = [r for r in pending if not _has_frame(outs[r])]
        if inp is not None:
            with contextlib.suppress(Exception):
                unread = [r for r in pending if reader_behind(inp.ring, self.readers[r])]
                if unread:
                    return unread
        return pending

    def unread(self, inp) -> list[int]:
        """Workers (input-ring readers, the ids the launcher kills by) silent in the in-flight
        step: those that have not read its input frame, else
        those whose process is stopped (SIGSTOP; mid-step the others wait for it inside the
        all-to-all and cannot be told apart otherwise); [] when none or unknown."""
        if not self.started:
            return []
        with contextlib.suppress(Exception):
            behind = [w for w in self.readers if reader_behind(inp.ring, w)]
            return behind or [w for w in self.readers if stopped(reader_pid(inp.ring, w))]
        return []

    def suspect(self, inp) -> list[int] | None:
        """The silent ranks of a step in flight longer than :data:`SUSPECT_SECONDS`: those that
        have not read its input, or whose process is stopped (:meth:`unread`; a rank that is
        only slow has read it), else None. A frozen rank shows within a second, long before
        ``--stall_seconds`` or an elastic fence."""
        if self.in_flight_seconds() <= min(SUSPECT_SECONDS, self.stall_seconds):
            return None
        silent = [self.readers.index(w) for w in self.unread(inp) if w in self.readers]
        return silent or None

    def stalled(self, inp=None, outs=None) -> list[int] | None:
        """The silent ranks when the in-flight step is older than the threshold, else None."""
        if self.in_flight_seconds() <= self.stall_seconds:
            return None
        return self.waiting_on(inp, outs)

    def verdict(self, inp, outs) -> tuple[str, list[int]] | None:
        """What ``/health`` says of the step in flight: ``("stalled", ranks)`` past
        ``--stall_seconds`` (503), ``("degraded", ranks)`` past :data:`SUSPECT_SECONDS` (200),
        or None."""
        silent = self.stalled(inp, outs)
        if silent is not None:
            return "stalled", silent
        slow = self.suspect(inp)
        return None if slow is None else ("degraded", slow)


def reader_pid(ring, index: int) -> int:
    """The pid registered by reader ``index`` of the broadcast ``ring`` (0 = none)."""
    return READER.unpack(ring.seg.read(RING_HEADER + READER.size * index, READER.size))[1]


def stopped(pid: int) -> bool:
    """True when process ``pid`` is stopped (state ``T``, e.g. SIGSTOP)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def silent_ranks(ring, ranks: list[int]) -> list[int]:
    """A remote node's silent ranks (global ids; reader ``i`` of the node's input ring is
    ``ranks[i]``; ``node/bridge.py`` fences them): those that have not read the newest frame,
    else those whose process is stopped (SIGSTOP)."""
    with contextlib.suppress(Exception):
        behind = [r for i, r in enumerate(ranks) if reader_behind(ring, i)]
        return behind or [r for i, r in enumerate(ranks) if stopped(reader_pid(ring, i))]
    return []


def _has_frame(out) -> bool:
    try:
        return out.ring.pending() > 0
    except Exception:  # noqa: BLE001 - a closed ring: nothing to read
        return False
