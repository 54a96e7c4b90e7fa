"""Counters and heartbeats of :class:`~xllm_eplb.eplb.manager.EplbManager`: what ``stats()``
reports and the periodic ``EPLB heartbeat`` log lines (spec section 13, xLLM reference 3-4).

Pure bookkeeping: the manager calls it with its lock held and passes its own clock's time
(``time.monotonic`` in the engine, a fake clock in tests); nothing here locks or reads a clock.
"""

from __future__ import annotations

import logging

from xllm_eplb.obs.logs import event

log = logging.getLogger(__name__)

#: cumulative counters of ``EplbManager.stats()`` (never reset; metrics take deltas)
COUNTERS = ("rounds", "layers_published", "layers_committed", "layers_timed_out",
            "slots_moved", "weight_copies", "samples", "samples_rejected", "samples_stale",
            "stale_tokens", "samples_backlog_dropped")


def new_counters() -> dict:
    """Zeroed counters plus ``last_policy_seconds`` (wall seconds of the latest policy round)."""
    out: dict = {k: 0 for k in COUNTERS}
    out["last_policy_seconds"] = 0.0
    return out


class Heartbeats:
    """Liveness of the manager's two sides, times in the manager's clock seconds.

    - rebalance loop (the policy runner: background thread, or the caller of ``tick`` with the
      sync runner): ``loop_at`` = end of its last pass, ``cpu_s`` = thread CPU seconds
      (``time.thread_time``) of all its passes (drain, decode, policy);
    - manager (the step-loop side: ``on_outputs`` and ``tick``): ``manager_at`` = its last call.

    Logs ``EPLB heartbeat rebalance_thread`` every ``period_s`` seconds, and ``EPLB heartbeat
    manager_thread`` every ``period_s`` seconds while a round is in flight (as xLLM).
    """

    def __init__(self, now: float, period_s: float, policy_name: str):
        self.period_s, self.policy_name = float(period_s), policy_name
        self.loop_at = self.manager_at = now
        self.cpu_s = 0.0
        self.batches = 0            # samples aggregated since the last rebalance_thread line
        self.layers = 0             # layers published since the last rebalance_thread line
        self._loop_logged = self._manager_logged = now

    def stats(self) -> dict:
        """``heartbeat_at`` (rebalance loop), ``manager_heartbeat_at``, ``policy_cpu_seconds``."""
        return {"heartbeat_at": self.loop_at, "manager_heartbeat_at": self.manager_at,
                "policy_cpu_seconds": self.cpu_s}

    def loop_pass(self, now: float, cpu_s: float, last_policy_s: float) -> None:
        """One rebalance pass ended at ``now`` after ``cpu_s`` thread CPU seconds."""
        self.loop_at = now
        self.cpu_s += cpu_s
        if now - self._loop_logged < self.period_s:
            return
        log.info(event("EPLB heartbeat rebalance_thread", policy=self.policy_name,
                       batches_since_last=self.batches, layers_updated_since_last=self.layers,
                       last_rebalance_ms=round(last_policy_s * 1e3, 3)))
        self._loop_logged, self.batches, self.layers = now, 0, 0

    def manager_pass(self, now: float, pipe) -> None:
        """A ``tick`` at ``now``; ``pipe``: the manager's
        :class:`~xllm_eplb.eplb.manager_state.LayerPipeline` (what the round waits on)."""
        self.manager_at = now
        if not pipe.in_progress or now - self._manager_logged < self.period_s:
            return
        self._manager_logged = now
        log.info(event("EPLB heartbeat manager_thread", layers_completed=pipe.layers_completed,
                       layers_timed_out=pipe.layers_timed_out, waiting_on=pipe.waiting_on()))
