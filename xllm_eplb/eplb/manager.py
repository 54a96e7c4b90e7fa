"""`EplbManager`: the engine side of EPLB (spec sections 4-6, xLLM reference sections 3-4).

One instance per engine. The step loop calls, per forward::

    info = mgr.eplb_info(allow)          # EplbInfo for the next forward (allow=False: empty)
    ... workers run the forward ...
    mgr.on_outputs(counters, prepared_tokens, activation_token)
    mgr.tick()                           # timers, timeouts, (sync runner) the policy

Load window: :class:`~xllm_eplb.eplb.aggregator.EplbAggregator` (samples tagged with the
placement generation; commit zeroes, each round halves). Policy input: the logical estimate of
:class:`~xllm_eplb.eplb.estimator.LoadEstimator` (or the raw window) plus the raw physical window
(the gate always uses measured load). Per-layer tokens/barrier/timeouts:
:class:`~xllm_eplb.eplb.manager_state.LayerPipeline`; counters and heartbeats:
:mod:`~xllm_eplb.eplb.manager_stats`.

Timer: armed by the first valid sample of a generation, ``eplb_update_interval`` seconds; every
commit (a new generation) disarms it, so it restarts at the next sample. A round starts only when
it fired, the window is not empty and no layer of the previous round is still in flight.

Runners: ``"thread"`` (production) aggregates samples and runs the policy on a background
thread so a slow policy never stalls the step loop; ``"sync"`` (tests, ``simulate``) does
everything inside ``on_outputs``/``tick`` with the injected clock -- deterministic, no sleeps.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable

import numpy as np

from xllm_eplb.eplb.aggregator import CounterShapeError, EplbAggregator, scatter_logical
from xllm_eplb.eplb.estimator import LoadEstimator
from xllm_eplb.eplb.info import NO_TOKEN, EplbInfo
from xllm_eplb.eplb.manager_state import LayerPipeline
from xllm_eplb.eplb.manager_stats import Heartbeats, new_counters
from xllm_eplb.eplb.placement import diff, initial_phy2log, slots_per_rank
from xllm_eplb.obs.logs import event

log = logging.getLogger(__name__)

RUNNERS = ("thread", "sync")
#: the background thread drains queued samples this often (not per sample: waking it on every
#: forward would make the step loop fight it for the GIL)
DRAIN_PERIOD_S = 0.02
#: queued (not yet aggregated) samples kept at most; older ones are dropped if the thread lags
MAX_QUEUED_SAMPLES = 4096


def _opt(cfg, name: str, default):
    v = getattr(cfg, name, None)
    return default if v is None else v


def build_policy(cfg, ep_size: int, num_logical: int):
    """The policy named by ``cfg.eplb_policy_kind`` (registry in ``eplb/policy``)."""
    from xllm_eplb.eplb.policy import make_policy
    return make_policy(str(_opt(cfg, "eplb_policy_kind", "balanced")), ep_size, num_logical,
                       int(_opt(cfg, "redundant_experts_num", 1)),
                       float(_opt(cfg, "eplb_min_peak_load_improvement", 0.05)),
                       budget_slots=int(_opt(cfg, "eplb_migration_budget_slots", 0)),
                       num_nodes=int(_opt(cfg, "eplb_num_nodes", 1)))


def _use_estimator(cfg, override: bool | None) -> bool:
    """``override`` (tests, simulate) wins over ``eplb_use_estimator`` (default off)."""
    return bool(_opt(cfg, "eplb_use_estimator", False)) if override is None else bool(override)


class EplbManager:
    """See the module docstring. Shapes: ``L`` MoE layers, ``D`` = ep_size ranks,
    ``S`` slots per rank, ``E`` logical experts; placements are ``[L, D*S]`` int64."""

    def __init__(self, cfg, num_layers: int, ep_size: int, num_logical: int, policy=None,
                 clock: Callable[[], float] = time.monotonic, runner: str = "thread",
                 use_estimator: bool | None = None):
        cfg = getattr(cfg, "eplb", cfg)           # a full Config or its EplbConfig
        if runner not in RUNNERS:
            raise ValueError(f"runner={runner!r}: must be one of {', '.join(RUNNERS)}")
        self.num_layers, self.ep_size, self.num_logical = num_layers, ep_size, num_logical
        redundant = int(_opt(cfg, "redundant_experts_num", 1))
        self.slots = slots_per_rank(num_logical, ep_size, redundant)
        self.interval = float(_opt(cfg, "eplb_update_interval", 1000.0))
        self.timeout = float(_opt(cfg, "eplb_prepare_timeout_seconds", 30.0))
        self.heartbeat_s = float(_opt(cfg, "eplb_heartbeat_seconds", 60.0))
        self.clock, self.runner = clock, runner
        self.policy = policy if policy is not None else build_policy(cfg, ep_size, num_logical)
        self.policy_name = str(getattr(self.policy, "name", type(self.policy).__name__))
        self.agg = EplbAggregator(num_layers, ep_size, self.slots, num_logical)
        self.estimator = (LoadEstimator(num_layers, num_logical,
                                        int(_opt(cfg, "eplb_estimator_window", 16)),
                                        float(_opt(cfg, "eplb_estimator_decay", 0.85)),
                                        bool(_opt(cfg, "eplb_estimator_trend", False)))
                          if _use_estimator(cfg, use_estimator) else None)
        self.pipe = LayerPipeline(num_layers, ep_size)
        self._active = np.tile(initial_phy2log(num_logical, ep_size, redundant), (num_layers, 1))
        self._active.setflags(write=False)
        self.policy.initialize(self._active.copy())
        self._lock = threading.Lock()
        self._data_cv = threading.Condition(self._lock)
        self._queue: collections.deque = collections.deque()
        self._deadline: float | None = None
        self._deadline_gen = -1
        self._stats = new_counters()
        self.hb = Heartbeats(clock(), self.heartbeat_s, self.policy_name)
        self._closed = False
        self._thread: threading.Thread | None = None
        log.info(event("EPLB manager start", policy=self.policy_name, layers=num_layers,
                       devices=ep_size, device_experts=self.slots, runner=runner,
                       update_interval_s=self.interval, prepare_timeout_s=self.timeout))
        if runner == "thread":
            self._thread = threading.Thread(target=self._loop, name="eplb-rebalance",
                                            daemon=True)
            self._thread.start()

    # --- public API ---------------------------------------------------------------------------

    @property
    def active_placement(self) -> np.ndarray:
        """int64 ``[L, D*S]``: the placement the workers actually run (read-only array)."""
        return self._active

    @property
    def generation(self) -> int:
        """Placement generation: +1 per committed activation."""
        return self.agg.generation

    def eplb_info(self, allow: bool) -> EplbInfo:
        """The control message for the next forward. ``allow=False``: empty, no state change."""
        if not allow:
            return EplbInfo()
        with self._lock:
            return self.pipe.command(self.clock())

    def on_outputs(self, counters: list[np.ndarray], prepared_tokens: list[int],
                   activation_token: int) -> None:
        """One forward's outputs from every rank, in xLLM order: prepared tokens, then the load
        sample (tagged with the placement active now), then the activation completion.

        counters: one ``[L, S]`` int64 prefix-sum array per rank. A malformed output is logged
        and never aggregated (its tokens are still processed). NOTE: the thread runner keeps
        references to these arrays until its next drain: the caller must not reuse them.
        """
        now = self.clock()
        with self._lock:
            self.hb.manager_at = now
            self._observe_prepared(prepared_tokens, now)
            self._enqueue(counters)
            self._observe_activation(int(activation_token))

    def tick(self) -> None:
        """Advance timeouts (and, sync runner, the timer and the policy) without outputs."""
        now = self.clock()
        with self._lock:
            self._check_timeouts(now)
        if self.runner == "sync":
            self._rebalance_pass()

    def window_physical(self) -> np.ndarray:
        """Copy of the measured load window, int64 ``[L, D, S]``."""
        with self._lock:
            return self.agg.physical.copy()

    def window_logical(self) -> np.ndarray:
        """Copy of the measured logical window, int64 ``[L, E]``."""
        with self._lock:
            return self.agg.logical.copy()

    def stats(self) -> dict:
        """Counters for metrics and /eplb/status, plus heartbeats (manager clock seconds):
        ``heartbeat_at`` (rebalance loop's last pass), ``manager_heartbeat_at`` (last
        ``on_outputs``/``tick``) and ``policy_cpu_seconds`` (rebalance passes' thread CPU)."""
        with self._lock:
            out = dict(self._stats)
            out.update(self.hb.stats())
            out.update(generation=self.agg.generation, window_samples=self.agg.sample_count,
                       layer_in_flight=self.pipe.layer_in_flight(),
                       waiting_on=self.pipe.waiting_on(), round_in_progress=self.pipe.in_progress,
                       next_prepare_token=self.pipe.next_token, policy=self.policy_name,
                       timer_deadline=self._deadline)
            return out

    def close(self) -> None:
        """Stop the background thread (idempotent)."""
        with self._lock:
            self._closed = True
            self._data_cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=10.0)
            self._thread = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # --- outputs (lock held) -----------------------------------------------------------------

    def _observe_prepared(self, tokens: list[int], now: float) -> None:
        tokens = list(tokens)
        if len(tokens) != self.ep_size:
            self._stats["samples_rejected"] += 1
            log.warning(event("EPLB rejected worker output", reason="prepared_tokens",
                              got=len(tokens), expected=self.ep_size))
            return
        if self.pipe.active_token == NO_TOKEN and tokens.count(NO_TOKEN) == len(tokens):
            return                                   # fast path: nothing prepared, nothing due
        for tok in self.pipe.observe_prepared([int(t) for t in tokens], now):
            self._stats["stale_tokens"] += 1
            log.warning(event("EPLB ignoring stale prepare token", got=tok,
                              waiting_for=self.pipe.active_token))

    def _observe_activation(self, token: int) -> None:
        waiting = self.pipe.awaited_token()
        layer = self.pipe.observe_activation(token)
        if layer is not None:
            self._commit(layer)
        elif token != NO_TOKEN:
            self._stats["stale_tokens"] += 1
            log.warning(event("EPLB ignoring stale activation completion token", got=token,
                              waiting_for=waiting))

    def _enqueue(self, counters: list[np.ndarray]) -> None:
        want = (self.num_layers, self.slots)
        if len(counters) != self.ep_size:
            bad = -1
        elif all(getattr(c, "shape", None) == want for c in counters):
            bad = None
        else:
            bad = next(r for r, c in enumerate(counters) if getattr(c, "shape", None) != want)
        if bad is not None:
            self._reject(f"rank {bad}: counters of shape "
                         f"{getattr(counters[bad], 'shape', None)}, expected {want}"
                         if bad >= 0 else f"{len(counters)} ranks, expected {self.ep_size}")
            return
        if len(self._queue) >= MAX_QUEUED_SAMPLES:
            self._queue.popleft()
            self._stats["samples_backlog_dropped"] += 1
        self._queue.append((counters, self._active, self.agg.generation))
        if self.runner == "sync":
            self._drain()

    def _reject(self, why: str) -> None:
        self._stats["samples_rejected"] += 1
        log.warning(event("EPLB rejected worker output", reason=why))

    def _drain(self) -> None:
        """Aggregate queued samples (lock held): decode, drop stale generations, estimator."""
        while self._queue:
            counters, placement, gen = self._queue.popleft()
            try:
                deltas = self.agg.decode(counters)
            except CounterShapeError as e:
                self._reject(str(e))
                continue
            self._accumulate(deltas, scatter_logical(deltas, placement, self.num_logical), gen)

    def _drain_unlocked(self) -> None:
        """Thread runner: take the queue under the lock, decode and scatter without it, add
        under it again (the generation check then drops samples a commit made stale)."""
        with self._lock:
            items, self._queue = self._queue, collections.deque()
        done = []
        for counters, placement, gen in items:
            try:
                deltas = self.agg.decode(counters)
            except CounterShapeError as e:
                done.append((str(e), None, gen))
                continue
            done.append((deltas, scatter_logical(deltas, placement, self.num_logical), gen))
        with self._lock:
            for deltas, logical, gen in done:
                if logical is None:
                    self._reject(deltas)
                else:
                    self._accumulate(deltas, logical, gen)

    def _accumulate(self, deltas: np.ndarray, logical: np.ndarray, gen: int) -> None:
        if not self.agg.accumulate(deltas, logical, gen):
            self._stats["samples_stale"] += 1
            return
        self._stats["samples"] += 1
        self.hb.batches += 1
        if self.estimator is not None:
            self.estimator.observe(logical)

    def _commit(self, layer: int) -> None:
        """The activation of ``layer`` came back: switch the active placement, new window."""
        row = self.pipe.candidate[layer]
        d = diff(self._active[layer], row, self.ep_size)
        self.policy.commit_layer(layer)
        active = self._active.copy()
        active[layer] = row
        active.setflags(write=False)
        self._active = active
        self.agg.commit()
        self._deadline = None
        self._stats["layers_committed"] += 1
        self._stats["slots_moved"] += d.moved_slots
        self._stats["weight_copies"] += d.weight_copies
        log.info(event("EPLB layer activated", layer=layer, generation=self.agg.generation,
                       slots_moved=d.moved_slots, weight_copies=d.weight_copies))

    # --- timeouts (lock held) ----------------------------------------------------------------

    def _check_timeouts(self, now: float) -> None:
        ab = self.pipe.check_timeout(now, self.timeout)
        if ab is not None:
            self.policy.abort_layer(ab.layer)
            self._stats["layers_timed_out"] += 1
            log.warning(event(f"EPLB layer {ab.layer} {ab.kind} timed out after "
                              f"{ab.limit:g}s; skipping this layer for the current round.",
                              layer=ab.layer, token=ab.token, kind=ab.kind.replace(" ", "_"),
                              elapsed_s=round(ab.elapsed, 3)))
        self.hb.manager_pass(now, self.pipe)

    # --- timer + policy ----------------------------------------------------------------------

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
        """Drain samples, check the timer, run one policy round if due, heartbeat."""
        c0 = time.thread_time()
        if self.runner == "thread":
            self._drain_unlocked()
        with self._lock:
            self._drain()
            now = self.clock()
            run = self._due(now)
            if run:
                logical, physical = self._policy_inputs()
        if run:
            t0 = time.perf_counter()
            cand, update = self.policy.rebalance(logical, physical)
            dt = time.perf_counter() - t0
            with self._lock:
                self._finish_round(np.asarray(cand), np.asarray(update, dtype=bool), dt)
        with self._lock:
            self.hb.loop_pass(self.clock(), time.thread_time() - c0,
                              self._stats["last_policy_seconds"])

    def _finish_round(self, cand: np.ndarray, update: np.ndarray, seconds: float) -> None:
        k = int(update.sum())
        self.pipe.start_round(cand, update)
        self.agg.decay()
        self._stats["rounds"] += 1
        self._stats["layers_published"] += k
        self._stats["last_policy_seconds"] = seconds
        self.hb.layers += k
        log.info(event("EPLB rebalance", policy=self.policy_name,
                       layers_updated=f"{k}/{self.num_layers}",
                       duration_ms=round(seconds * 1e3, 3)))

    # --- background runner -------------------------------------------------------------------

    def _wait_seconds(self) -> float:
        """How long the background thread may sleep (lock held)."""
        wait = DRAIN_PERIOD_S
        if self._deadline is not None:
            wait = min(wait, max(self._deadline - self.clock(), 0.0))
        return max(wait, 0.001)

    def _loop(self) -> None:
        while True:
            with self._lock:
                if not self._closed:
                    self._data_cv.wait(self._wait_seconds())
                if self._closed:
                    return
            try:
                self._rebalance_pass()
            except Exception:                      # never let the loop die silently
                log.exception(event("EPLB rebalance loop error", policy=self.policy_name))
                time.sleep(0.1)
