"""The manager's rounds (:class:`RoundsMixin`, mixed into
:class:`~xllm_eplb.eplb.manager.EplbManager`): the timer, the policy's inputs, one rebalance
pass (drain, roll back layers measured slower, run the planner when due, heartbeat) and the
start of a planned round. Uses the manager's lock, aggregator, estimator, pipeline, cost guard,
planner, counters and heartbeats."""

from __future__ import annotations

import logging
import time

import numpy as np

from xllm_eplb.eplb.gate import Round
from xllm_eplb.obs.logs import event

log = logging.getLogger("xllm_eplb.eplb.manager")


class RoundsMixin:
    """Timer + policy of :class:`~xllm_eplb.eplb.manager.EplbManager`."""

    def _due(self, now: float) -> bool:
        """Timer logic (lock held, queue drained): True when a round must run now."""
        if self._deadline is not None and self._deadline_gen != self.agg.generation:
            self._deadline = None                 # a commit happened: restart the interval
        if not self.agg.empty and self._deadline is None:
            self._deadline, self._deadline_gen = now + self.interval, self.agg.generation
        if self._deadline is None or now < self._deadline:
            return False
        self._deadline = None
        # NOTE: if a round is still in flight the elapsed interval is dropped (re-armed next pass).
        return not self.pipe.in_progress and not self.agg.empty

    def _policy_inputs(self) -> tuple[np.ndarray, np.ndarray]:
        """(logical [L, E], physical [L, D, S]) snapshots for the policy (lock held)."""
        physical = self.agg.physical.copy()
        if self.estimator is None or self.estimator.count == 0:
            return self.agg.logical.copy(), physical
        return self.estimator.as_counts(min(self.estimator.count,
                                            self.estimator.window)), physical

    def _rebalance_pass(self) -> None:
        """Drain samples, check the timer, run one policy round if due, heartbeat.

        The planner runs without the lock on the deployed table of the moment: no commit can
        replace it meanwhile, since a round starts only when none is in flight."""
        c0 = time.thread_time()
        self._drain()
        with self._lock:
            back = None if self.pipe.in_progress else self.cost.rollback_round(self._active)
            if back is not None:
                self.pipe.start_round(*back)
            run = self._due(self.clock())
            if run:
                logical, physical = self._policy_inputs()
                deployed = self._active
                snap = (self.cost.snapshot() if getattr(self.planner, "plan_on", "") == "cost"
                        else None)
                run = not (snap is None and self.cost.waiting(self.agg.sample_count,
                                                               self.planner))
        if run:
            t0 = time.perf_counter()
            kw = {"cost": snap} if snap is not None else {}
            rnd = self.planner(logical, physical, deployed, **kw)
            dt = time.perf_counter() - t0
            with self._lock:
                self._finish_round(rnd, dt)
        with self._lock:
            self.hb.loop_pass(self.clock(), time.thread_time() - c0,
                              self._counters.last_policy_seconds)

    def _finish_round(self, rnd: Round, seconds: float) -> None:
        table, update = self.cost.filter_round(rnd, self._active)
        k = int(update.sum())
        self.pipe.start_round(table, update)
        self.agg.decay()
        self._counters.rounds += 1
        self._counters.layers_published += k
        self._counters.last_policy_seconds = seconds
        self.hb.layers += k
        log.info(event("EPLB rebalance", policy=self.policy_name,
                       layers_updated=f"{k}/{self.num_layers}",
                       duration_ms=round(seconds * 1e3, 3)))

