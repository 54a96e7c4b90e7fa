"""What the engine does, and tells clients, when serving fails under a step (issue #26 item 5).

* A **stalled step** (a frozen or hung worker): after ``--stall_seconds`` every request in flight
  (running and waiting) is finished with an error that names the silent ranks, so streaming
  clients get an error event instead of silence; ``/health`` already reports the stall. The step
  itself keeps waiting: a worker that wakes up completes it (the failed requests' KV caches are
  released by the next step), one that stays silent stops the run at
  ``--worker_timeout_seconds`` as before.
* A **dead rank**: the launcher sends the engine a notice
  (:class:`~xllm_eplb.elastic.notices.WorkerDied`) the moment it sees the child exit; the engine
  fails the step with that message, and every request is told which rank died (not "server
  shutting down"). A survivor's failed collective ("Connection closed by peer") is only the
  consequence: :meth:`FailureWatch.explain` waits a moment for the launcher's notice so the
  message names the dead rank. A dead **launcher** is found at once (its pid is gone) and named.

Everything here runs on the step-loop thread (the scheduler's thread). Elastic EP's own checks
(the silent-worker fence, recovery) are ``elastic/recovery.py``'s.
"""

from __future__ import annotations

import logging

from xllm_eplb.elastic.notices import NoticeBox
from xllm_eplb.elastic.protocol import NOTICE_WAIT, WAIT_SLICE
from xllm_eplb.errors import WorkerFault
from xllm_eplb.obs.logs import event

log = logging.getLogger(__name__)

#: the reason every request gets at an ordinary stop
SHUTDOWN = "server shutting down"

__all__ = ["NOTICE_WAIT", "SHUTDOWN", "WAIT_SLICE", "FailureWatch", "WorkerFault",
           "stall_message"]


def stall_message(step: int, ranks: list[int], seconds: float, stall_seconds: float) -> str:
    names = ", ".join(map(str, ranks)) or "?"
    return (f"engine stalled: step {step} has waited {seconds:.1f}s on rank {names} "
            f"(--stall_seconds={stall_seconds:g}); the request was stopped")


class FailureWatch:
    """The engine's view of failures under a step: stalls, deaths (read from the launcher's
    notices, :class:`~xllm_eplb.elastic.notices.NoticeBox`), the stop reason."""

    def __init__(self, sched, watch, stall_seconds: float, box: NoticeBox | None = None,
                 on_failed=None):
        self.sched, self.watch, self.stall_seconds = sched, watch, stall_seconds
        self.box = box or NoticeBox()
        self.on_failed = on_failed or (lambda reqs: None)   # the finished requests (metrics)
        self.stalled_step = -1

    @property
    def death(self) -> str:
        """The launcher's message for a dead child (or the launcher's own death), once known."""
        return self.box.death

    def between_slices(self, step: int, inp, outs) -> None:
        """Called while a step waits for an output: a death notice raises
        :class:`WorkerFault`; a stall past ``--stall_seconds`` fails the requests in flight
        (once per step)."""
        if self.box.poll(0.0):
            raise WorkerFault(self.death)
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

    def explain(self, fault: BaseException, wait: float = NOTICE_WAIT) -> str:
        """The reason requests get when the run stops on ``fault``: the launcher's death
        notice when one arrives within ``wait`` seconds (the dead rank, not the survivor whose
        collective failed; a dead launcher at once), else the fault itself."""
        return self.death if self.box.wait_death(wait) else str(fault)
