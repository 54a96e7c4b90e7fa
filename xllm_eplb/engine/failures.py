"""What the engine does, and tells clients, when serving fails under a step (issue #26 item 5).

* A **stalled step** (a frozen or hung worker): after ``--stall_seconds`` every request in flight
  (running and waiting) is finished with an error that names the silent ranks, so streaming
  clients get an error event instead of silence; ``/health`` already reports the stall. The step
  itself keeps waiting: a worker that wakes up completes it (the failed requests' KV caches are
  released by the next step), one that stays silent stops the run at
  ``--worker_timeout_seconds`` as before.
* A **dead rank**: the launcher sends the engine a notice (``("died", who, message)``) the
  moment it sees the child exit; the engine fails the step with that message, and every request
  is told which rank died (not "server shutting down"). A survivor's failed collective
  ("Connection closed by peer") is only the consequence: :meth:`FailureWatch.explain` waits a
  moment for the launcher's notice so the message names the dead rank.

Everything here runs on the step-loop thread (the scheduler's thread).
"""

from __future__ import annotations

import logging
import time

from xllm_eplb.obs.logs import FILE_ONLY, event

log = logging.getLogger(__name__)

#: the engine waits for a rank's output in slices this long (seconds) between checks
WAIT_SLICE = 0.25
#: how long a fault reported by a survivor waits for the launcher's death notice (seconds)
NOTICE_WAIT = 1.5
#: the reason every request gets at an ordinary stop
SHUTDOWN = "server shutting down"


class WorkerFault(RuntimeError):
    """A worker reported an error, answered the wrong step, went silent, or died."""


def stall_message(step: int, ranks: list[int], seconds: float, stall_seconds: float) -> str:
    names = ", ".join(map(str, ranks)) or "?"
    return (f"engine stalled: step {step} has waited {seconds:.1f}s on rank {names} "
            f"(--stall_seconds={stall_seconds:g}); the request was stopped")


class FailureWatch:
    """The engine's view of failures under a step: stall, death notices, the stop reason.

    ``notices(timeout) -> notice or None`` reads the launcher's notices (``None``: no launcher,
    e.g. a test engine)."""

    def __init__(self, sched, watch, stall_seconds: float, notices=None, on_failed=None,
                 on_elastic=None):
        self.sched, self.watch, self.stall_seconds = sched, watch, stall_seconds
        self.notices = notices
        self.on_failed = on_failed or (lambda reqs: None)   # the finished requests (metrics)
        #: ``on_elastic(seconds)``: CPU of the silent-rank check (``Telemetry.on_elastic``)
        self.on_elastic = on_elastic or (lambda seconds: None)
        self.stalled_step = -1
        self.death: str = ""          # the launcher's message for a dead child, once known
        self.died: tuple | None = None    # that notice: ("died", who, message[, gen, seen])
        self.attached: list[tuple] = []   # elastic: ("attached", who, generation) notices
        #: rejoin: ("join_ready", who, started_at, ready_at, pid) / ("join_dropped", who, why)
        self.joins: list[tuple] = []
        #: rejoin: the joiner a switch waits for, and why it was lost meanwhile (its
        #: ``join_dropped``: the switch is abandoned, ``engine/rejoin.py``)
        self.switching = self.switch_lost = ""
        #: elastic: ``kill(who)`` asks the launcher to SIGKILL a silent worker (None: off)
        self.kill = None
        self.silence_seconds = 0.0
        self.killed_step = -1

    def between_slices(self, step: int, inp, outs) -> None:
        """Called while a step waits for an output: a death notice raises
        :class:`WorkerFault`; a stall past ``--stall_seconds`` fails the requests in flight
        (once per step)."""
        if self._poll(0.0):
            raise WorkerFault(self.death)
        if self.kill is not None:          # --elastic_ep: its CPU is accounted
            c0 = time.thread_time()
            self._fence_silent(step, inp)
            self.on_elastic(time.thread_time() - c0)
        if self.stalled_step == step:
            return
        silent = self.watch.stalled(inp, outs)
        if silent is None:
            return
        self.stalled_step = step
        msg = stall_message(step, silent, self.watch.in_flight_seconds(), self.stall_seconds)
        failed = self.sched.fail_in_flight(msg)
        self.on_failed(failed)
        log.warning(event("engine stall", step=step, waiting_on=",".join(map(str, silent)),
                          seconds=round(self.watch.in_flight_seconds(), 2),
                          requests_failed=len(failed)))

    def _poll(self, timeout: float) -> bool:
        if self.notices is None or self.death:
            return bool(self.death)
        self._handle(self.notices(timeout))
        return bool(self.death)

    def _handle(self, notice) -> None:
        if notice and notice[0] == "attached":
            self.attached.append(notice)
        if notice and notice[0] in ("join_ready", "join_dropped"):
            if notice[0] == "join_dropped" and notice[1] == self.switching:
                self.switch_lost = f"the joiner {notice[1]} died during the switch ({notice[2]})"
            self.joins.append(notice)
        if notice and notice[0] == "died":
            self.died, self.death = tuple(notice), str(notice[2])
            # NOTE: file only: the launcher's console line says it once
            log.error(event("engine notice worker died", proc=notice[1], message=self.death),
                      extra=FILE_ONLY)

    def _fence_silent(self, step: int, inp) -> None:
        """``--elastic_ep``: ranks that have not read this step's input for
        ``--elastic_silence_seconds`` are SIGKILLed by the launcher (once per step): a hang
        becomes a death, which the elastic path recovers from."""
        if self.kill is None or self.killed_step == step:
            return
        if self.watch.in_flight_seconds() <= self.silence_seconds:
            return
        silent = self.watch.unread(inp)
        if silent:
            self.killed_step = step
            log.warning(event("EPLB elastic silent", step=step, ranks=",".join(map(str, silent)),
                              seconds=round(self.watch.in_flight_seconds(), 2)))
            for r in silent:
                self.kill(f"ep{r}")

    def poll_joins(self) -> list[tuple]:
        """Rejoin, at a step boundary: every notice waiting now (a death is kept for the next
        step), then the join notices read so far (taken)."""
        while not self.death and self.notices is not None:
            notice = self.notices(0.0)
            if notice is None:
                break
            self._handle(notice)
        got, self.joins = self.joins, []
        return got

    def clear_death(self) -> None:
        """After a recovery: the next death is a new one."""
        self.death, self.died = "", None

    def next_attached(self, timeout: float):
        """The next ``("attached", who, generation)`` notice within ``timeout`` s, or None
        (a ``died`` notice meanwhile is kept in :attr:`died`)."""
        deadline = time.monotonic() + timeout
        while not self.attached and time.monotonic() < deadline:
            if self.notices is None:
                return None
            notice = self.notices(min(0.1, max(0.0, deadline - time.monotonic())))
            if notice and notice[0] == "attached":
                self.attached.append(notice)
            elif notice and notice[0] in ("join_ready", "join_dropped"):
                self.joins.append(notice)
            elif notice and notice[0] == "died":
                self.died, self.death = tuple(notice), str(notice[2])
        return self.attached.pop(0) if self.attached else None

    def explain(self, fault: BaseException, wait: float = NOTICE_WAIT) -> str:
        """The reason requests get when the run stops on ``fault``: the launcher's death
        notice when one arrives within ``wait`` seconds (the dead rank, not the survivor whose
        collective failed), else the fault itself."""
        deadline = time.monotonic() + wait
        while not self._poll(min(0.1, max(0.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                return str(fault)
        return self.death
