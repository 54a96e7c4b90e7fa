"""`RebalanceThread`: the background runner of :class:`~xllm_eplb.eplb.manager.EplbManager`.

It calls the manager's rebalance pass (drain queued samples, timer, policy round) on a daemon
thread, so a slow policy never stalls the step loop. It wakes every ``wait_s()`` seconds (the
manager returns at most its drain period, less when the timer fires sooner), not per sample:
waking on every forward would make the step loop fight it for the GIL.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from xllm_eplb.obs.logs import event

log = logging.getLogger(__name__)

#: pause after a pass raised, so that a persistent error does not spin
ERROR_BACKOFF_S = 0.1


class RebalanceThread:
    """Runs ``run_pass()`` until :meth:`close`; ``wait_s()`` = seconds to sleep before the next
    pass. A pass that raises is logged (``EPLB rebalance loop error``) and the loop goes on."""

    def __init__(self, run_pass: Callable[[], None], wait_s: Callable[[], float],
                 label: str):
        self._run_pass, self._wait_s, self._label = run_pass, wait_s, label
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="eplb-rebalance", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self._wait_s()):
            try:
                self._run_pass()
            except Exception:                      # never let the loop die silently
                log.exception(event("EPLB rebalance loop error", policy=self._label))
                self._stop.wait(ERROR_BACKOFF_S)

    def close(self, timeout: float = 10.0) -> None:
        """Stop and join the thread (idempotent)."""
        self._stop.set()
        self.thread.join(timeout=timeout)
