"""Counters and heartbeats of :class:`~xllm_eplb.eplb.manager.EplbManager`: what ``stats()``
reports (:class:`ManagerStats`, the one list of its keys, reused by ``EngineApi.status()``) and the
periodic ``EPLB heartbeat`` log lines.

Pure bookkeeping: the manager calls it with its lock held and passes its own clock's time
(``time.monotonic`` in the engine, a fake clock in tests); nothing here locks or reads a clock.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass

from xllm_eplb.obs.logs import event

log = logging.getLogger(__name__)


@dataclass
class Counters:
    """Cumulative counters of the manager (never reset; metrics take deltas), plus
    ``last_policy_seconds`` (wall seconds of the latest policy round). The manager reports
    each event through one ``count_*`` method; nothing else writes these fields."""

    rounds: int = 0
    layers_published: int = 0
    layers_committed: int = 0
    layers_timed_out: int = 0
    slots_moved: int = 0
    weight_copies: int = 0
    samples: int = 0
    samples_rejected: int = 0
    samples_stale: int = 0
    stale_tokens: int = 0
    samples_backlog_dropped: int = 0
    last_policy_seconds: float = 0.0
    # --- cost model (post-commit checks, eplb/cost_check.py) ---
    cost_checks: int = 0
    layers_regressed: int = 0          # measured slower after a commit
    layers_rolled_back: int = 0
    cost_predicted_gain: float = 0.0   # the last check: modelled relative critical-path drop
    cost_measured_gain: float = 0.0    # ... and the measured one

    def count_round(self, layers: int, seconds: float) -> None:
        """A policy round published ``layers`` layers after ``seconds`` wall seconds."""
        self.rounds += 1
        self.layers_published += layers
        self.last_policy_seconds = seconds

    def count_commit(self, committed: bool, moved_slots: int, weight_copies: int) -> None:
        """A layer's activation came back (``committed`` False: a rollback's restore, no
        commit) after moving ``moved_slots`` slots with ``weight_copies`` weight copies."""
        self.layers_committed += int(committed)
        self.slots_moved += moved_slots
        self.weight_copies += weight_copies

    def count_sample(self, fresh: bool) -> None:
        """A load sample aggregated (``fresh``) or dropped as stale (an older placement
        epoch)."""
        if fresh:
            self.samples += 1
        else:
            self.samples_stale += 1

    def count_rejected(self) -> None:
        """A malformed worker output (counters or prepared tokens): never aggregated."""
        self.samples_rejected += 1

    def count_stale_token(self) -> None:
        """A prepare or activation token that belongs to no layer in flight."""
        self.stale_tokens += 1

    def count_backlog_drop(self) -> None:
        """The oldest queued sample dropped because the rebalance loop lags."""
        self.samples_backlog_dropped += 1

    def count_timeout(self) -> None:
        """A layer aborted by the prepare timeout."""
        self.layers_timed_out += 1

    def count_checks(self, results) -> None:
        """Closed post-commit checks (``CostGuard.observe``'s
        :class:`~xllm_eplb.eplb.cost_check.CheckResult` list): ``cost_checks``, the last gains,
        ``layers_regressed``."""
        for res in results:
            self.cost_checks += 1
            self.cost_measured_gain = res.measured_gain
            self.cost_predicted_gain = res.predicted_gain if res.predicted_gain is not None \
                else 0.0
            self.layers_regressed += int(res.regressed)

    def count_rollback(self, update) -> None:
        """A roll-back round (``CostGuard.rollback_round``'s ``update`` bool [L]): its layers
        into ``layers_rolled_back``."""
        self.layers_rolled_back += int(sum(bool(u) for u in update))


@dataclass
class ManagerStats(Counters):
    """``EplbManager.stats()``: the counters, the heartbeats (manager clock seconds:
    ``heartbeat_at`` = the rebalance loop's last pass, ``manager_heartbeat_at`` = the last
    ``on_outputs``/``tick``; ``policy_cpu_seconds`` = thread CPU of all rebalance passes) and the
    round's state. The defaults are what a manager reports before anything happened."""

    heartbeat_at: float | None = None
    manager_heartbeat_at: float | None = None
    policy_cpu_seconds: float = 0.0
    #: layer activations committed so far (the EPLB placement epoch)
    placement_epoch: int = 0
    #: deprecated name of ``placement_epoch`` (one release)
    generation: int = 0
    window_samples: int = 0
    layer_in_flight: int = -1
    waiting_on: str = "none"
    round_in_progress: bool = False
    next_prepare_token: int = 1
    policy: str = ""
    timer_deadline: float | None = None
    #: when the next round runs, in words (``EplbManager.next_round``)
    next_round: str = ""

    def as_dict(self) -> dict:
        """Flat ``{key: int | float | str | bool | None}`` (the /eplb/status fields)."""
        return asdict(self)


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
        return dict(heartbeat_at=self.loop_at, manager_heartbeat_at=self.manager_at,
                    policy_cpu_seconds=self.cpu_s)

    def manager_call(self, now: float) -> None:
        """An ``on_outputs`` call at ``now`` (the step-loop side is alive)."""
        self.manager_at = now

    def count_sample(self) -> None:
        """A load sample aggregated (for the next ``rebalance_thread`` line)."""
        self.batches += 1

    def count_round(self, layers: int) -> None:
        """A round published ``layers`` layers (for the next ``rebalance_thread`` line)."""
        self.layers += layers

    def inherit(self, old: "Heartbeats") -> None:
        """Continue ``old``'s policy CPU seconds (a replacing manager, ``inherit_counters``)."""
        self.cpu_s += old.cpu_s

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
