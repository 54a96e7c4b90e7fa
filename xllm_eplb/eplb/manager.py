"""`EplbManager`: the engine side of EPLB, and the one owner of the placement.

One instance per engine. The step loop calls, per forward::

    info = mgr.eplb_info(allow)          # EplbInfo for the next forward (allow=False: empty)
    ... workers run the forward ...
    mgr.on_outputs(counters, prepared_tokens, activation_token)
    mgr.tick()                           # timeouts; with the sync runner also timer + policy

State: the manager owns the deployed placement (``active_placement``, ``[L, D*S]``, replaced
copy-on-write at each commit) and, through its
:class:`~xllm_eplb.eplb.manager_state.LayerPipeline`, what is in flight (the published round,
tokens, barrier, timeouts). The policy holds no placement: each round the manager hands it the
deployed table (:class:`~xllm_eplb.eplb.gate.Planner`: ``policy.plan`` then the publication
gate). An aborted layer (timeout) simply never reaches the deployed table, so the next round
plans it again from what the workers run; a committed one is written into it.

Load window: :class:`~xllm_eplb.eplb.aggregator.EplbAggregator` (samples tagged with the
placement epoch; commit zeroes, each round halves). Policy input: the logical estimate of
:class:`~xllm_eplb.eplb.estimator.LoadEstimator` (or the raw window) plus the raw physical window
for the gate (which always uses measured load). Counters and heartbeats:
:mod:`~xllm_eplb.eplb.manager_stats`.

Timer: armed by the first valid sample of a placement epoch, ``eplb_update_interval`` seconds; every
commit (a new epoch) disarms it, so it restarts at the next sample. A round starts only when
it fired, the window is not empty and no layer of the previous round is still in flight. The
first round does not wait for the timer: it runs once the window holds
``eplb_first_round_samples`` samples or the timer fired, whichever comes first (0: the timer
only), so EPLB acts within the
first minute of traffic with xLLM's default interval of 1000 s; :meth:`next_round` says which.

Cost (``eplb_plan_on=cost``): pure-decode samples that carry the workers' expert CPU seconds
feed a :class:`~xllm_eplb.eplb.cost_model.CostModel`; once fitted, each round plans and gates
on the modelled step critical path. Every commit opens a
:class:`~xllm_eplb.eplb.cost_check.CostChecks` entry; a layer measured slower after it than
before is rolled back to its previous row (``layers_regressed`` / ``layers_rolled_back``) and
held out of the next rounds (:mod:`~xllm_eplb.eplb.manager_cost`).

Runners: ``"thread"`` (production) aggregates samples and runs the policy on a
:class:`~xllm_eplb.eplb.manager_runner.RebalanceThread`, so a slow policy never stalls the step
loop; ``"sync"`` (tests, ``simulate``) does the same work inside ``on_outputs``/``tick`` with the
injected clock -- deterministic, no sleeps. Both drain samples the same way (:meth:`_drain`).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from typing import Callable

import numpy as np

from xllm_eplb.config import EplbConfig
from xllm_eplb.eplb.aggregator import CounterShapeError, EplbAggregator
from xllm_eplb.eplb.estimator import LoadEstimator
from xllm_eplb.eplb.gate import Planner, Round
from xllm_eplb.eplb.info import NO_TOKEN, EplbInfo
from xllm_eplb.eplb.manager_cost import CostGuard
from xllm_eplb.eplb.manager_runner import RebalanceThread
from xllm_eplb.eplb.manager_state import LayerPipeline
from xllm_eplb.eplb.manager_stats import Counters, Heartbeats, ManagerStats
from xllm_eplb.eplb.placement import diff, initial_phy2log, logical_loads, slots_per_rank
from xllm_eplb.eplb.policy import policy_from_config
from xllm_eplb.errors import ConfigError
from xllm_eplb.obs.logs import event

log = logging.getLogger(__name__)

RUNNERS = ("thread", "sync")
#: the background thread drains queued samples this often (not per sample: see manager_runner)
DRAIN_PERIOD_S = 0.02
#: queued (not yet aggregated) samples kept at most; older ones are dropped if the thread lags
MAX_QUEUED_SAMPLES = 4096

#: ``planner(logical [L, E], physical [L, D, S], deployed [L, D*S]) -> Round``
PlannerFn = Callable[[np.ndarray, np.ndarray, np.ndarray], Round]


class EplbManager:
    """See the module docstring. Shapes: ``L`` MoE layers, ``D`` = ``cfg.ep_size`` ranks,
    ``S`` slots per rank, ``E`` logical experts; placements are ``[L, D*S]`` int64.

    ``num_layers`` / ``num_logical`` come from the model; everything else from ``cfg``.
    ``planner`` (tests): replaces the policy + gate built from ``cfg``; it must carry a
    ``name``. ``initial``: the deployed placement at start, int64 ``[L, D*S]`` (the workers'
    initial table, e.g. ``--eplb_init_placement``; default xLLM's initial layout).
    ``expect_timings``: the caller passes expert timings on pure-decode steps (the engine), so a
    cost-planned round waits for the fitted model from the first sample on.
    """

    def __init__(self, cfg: EplbConfig, num_layers: int, num_logical: int, *,
                 planner: PlannerFn | None = None,
                 clock: Callable[[], float] = time.monotonic, runner: str = "thread",
                 initial: np.ndarray | None = None, expect_timings: bool = False,
                 slots: int | None = None):
        if not isinstance(cfg, EplbConfig):
            raise TypeError(f"EplbManager takes the EplbConfig (cfg.eplb), got "
                            f"{type(cfg).__name__}")
        if runner not in RUNNERS:
            raise ValueError(f"runner={runner!r}: must be one of {', '.join(RUNNERS)}")
        if cfg.ep_size is None:
            raise ConfigError("ep_size: required by the EPLB manager")
        self.num_layers, self.ep_size, self.num_logical = num_layers, cfg.ep_size, num_logical
        # slots: an elastic shrink's layout (any ep_size x slots >= num_logical, Engine.resize)
        self.slots = slots or slots_per_rank(num_logical, cfg.ep_size, cfg.redundant_experts_num)
        self.interval = float(cfg.eplb_update_interval)
        self.first_round_samples = int(cfg.eplb_first_round_samples)
        self.timeout = float(cfg.eplb_prepare_timeout_seconds)
        self.clock = clock
        self.planner = planner if planner is not None else Planner(
            policy_from_config(cfg, num_logical), cfg.eplb_min_peak_load_improvement,
            cfg.eplb_plan_on)
        self.policy_name = str(self.planner.name)
        self.agg = EplbAggregator(num_layers, cfg.ep_size, self.slots, num_logical)
        self.estimator = (LoadEstimator(num_layers, num_logical, cfg.eplb_estimator_window,
                                        cfg.eplb_estimator_decay, cfg.eplb_estimator_trend)
                          if cfg.eplb_use_estimator else None)
        self.pipe = LayerPipeline(num_layers, cfg.ep_size)
        self._active = (np.tile(initial_phy2log(num_logical, cfg.ep_size,
                                                cfg.redundant_experts_num), (num_layers, 1))
                        if initial is None else np.array(initial, dtype=np.int64))
        if self._active.shape != (num_layers, cfg.ep_size * self.slots):
            raise ValueError(f"initial placement of shape {self._active.shape}, expected "
                             f"[layers, ep_size*slots]={(num_layers, cfg.ep_size * self.slots)}")
        self._active.setflags(write=False)
        self._initial = self._active
        self._lock = threading.Lock()
        self._queue: collections.deque = collections.deque()
        self._deadline: float | None = None
        self._deadline_epoch = -1
        self._counters = Counters()
        self.cost = CostGuard(num_layers, cfg.ep_size, num_logical,
                              expect_timings=bool(expect_timings))
        self.hb = Heartbeats(clock(), cfg.eplb_heartbeat_seconds, self.policy_name)
        log.info(event("EPLB manager start", policy=self.policy_name, layers=num_layers,
                       devices=cfg.ep_size, device_experts=self.slots, runner=runner,
                       update_interval_s=self.interval, prepare_timeout_s=self.timeout))
        self._runner = (RebalanceThread(self._rebalance_pass, self._wait_seconds,
                                        self.policy_name) if runner == "thread" else None)

    # --- public API ---------------------------------------------------------------------------

    @property
    def active_placement(self) -> np.ndarray:
        """int64 ``[L, D*S]``: the placement the workers actually run (read-only array)."""
        return self._active

    @property
    def placement_epoch(self) -> int:
        """The placement epoch: +1 per committed activation."""
        return self.agg.placement_epoch

    def eplb_info(self, allow: bool) -> EplbInfo:
        """The control message for the next forward. ``allow=False``: empty, no state change."""
        if not allow:
            return EplbInfo()
        with self._lock:
            return self.pipe.command(self.clock())

    def quiescent(self) -> bool:
        """No round in flight (``--async_scheduling``: a step may be planned before the last
        one's outputs reach :meth:`on_outputs`; it carries no EPLB command)."""
        with self._lock:
            return not self.pipe.in_progress

    def on_outputs(self, counters: list[np.ndarray], prepared_tokens: list[int],
                   activation_token: int, expert_cpu: list | None = None) -> None:
        """One forward's outputs from every rank, in xLLM order: prepared tokens, then the load
        sample (tagged with the placement active now), then the activation completion.

        counters: one ``[L, S]`` int64 prefix-sum array per rank. A malformed output is logged
        and never aggregated (its tokens are still processed). expert_cpu: per rank the ``[L]``
        expert CPU seconds of this step (pure-decode steps only; feeds the cost model) or
        None. NOTE: the thread runner keeps references to these arrays until its next drain:
        the caller must not reuse them.

        NOTE: timeouts are checked *before* the prepared tokens are observed. A rank that froze
        (or slept) mid-round also blocks the forward, so its ready token arrives in the same
        output that ends the freeze; observed first, it would make a layer READY long after its
        deadline. Checked first, the layer is aborted at the deadline the output proves passed
        and the late token is ignored as stale.
        """
        now = self.clock()
        with self._lock:
            self.hb.manager_call(now)
            self._abort_overdue(now)
            self._observe_prepared(prepared_tokens, now)
            self._enqueue(counters, expert_cpu)
        if self._runner is None:
            self._drain()           # sync: the sample counts before this forward's activation
        with self._lock:
            self._observe_activation(int(activation_token))

    def abort_round(self, switched: bool | None = False) -> bool:
        """``--elastic_ep`` recovery: drop the round in flight (``LayerPipeline.abort_round``).
        An activation awaited from the void step is first settled by ``switched``: True (every
        surviving rank switched the layer: it is committed), False (none did: it is not
        deployed), None (some did: nothing is changed and False is returned, the run stops)."""
        with self._lock:
            busy = self.pipe.in_progress
            if self.pipe.awaiting is not None and switched is not None:
                if switched:
                    self._observe_activation(self.pipe.awaited_token())
                else:
                    self.pipe.drop_awaited()
            ok = self.pipe.abort_round()
        if busy and ok:
            log.warning(event("EPLB elastic round aborted", reason="rank lost"))
        return ok

    def tick(self) -> None:
        """Advance timeouts (and, sync runner, the timer and the policy) without outputs."""
        now = self.clock()
        with self._lock:
            self._check_timeouts(now)
        if self._runner is None:
            self._rebalance_pass()

    def window_physical(self) -> np.ndarray:
        """Copy of the measured load window, int64 ``[L, D, S]``."""
        with self._lock:
            return self.agg.physical.copy()

    def stats(self) -> dict:
        """:class:`~xllm_eplb.eplb.manager_stats.ManagerStats` as a dict (metrics,
        /eplb/status): counters, heartbeats (manager clock seconds) and the round's state."""
        with self._lock:
            return ManagerStats(
                **vars(self._counters), **self.hb.stats(), placement_epoch=self.agg.placement_epoch,
                generation=self.agg.placement_epoch,     # deprecated alias (one release)
                window_samples=self.agg.sample_count, layer_in_flight=self.pipe.layer_in_flight(),
                waiting_on=self.pipe.waiting_on(), round_in_progress=self.pipe.in_progress,
                next_prepare_token=self.pipe.next_token, policy=self.policy_name,
                timer_deadline=self._deadline,
                next_round=self._next_round_text(self.clock())).as_dict()

    def inherit_counters(self, old: "EplbManager") -> None:
        """Continue ``old``'s cumulative counters and policy CPU (an elastic shrink or rejoin
        replaces the manager: ``/eplb/status`` and the metrics, which take deltas of these
        totals, must stay monotonic)."""
        with self._lock:
            self._counters = dataclasses.replace(old._counters)
            self.hb.inherit(old.hb)

    def cost_status(self) -> dict:
        """The cost model for /eplb/status: the fit per layer and the modelled step critical
        path (seconds, summed over layers) under the deployed and the initial placement."""
        with self._lock:
            return self.cost.status(self._active, self._initial)

    def close(self) -> None:
        """Stop the background thread (idempotent)."""
        if self._runner is not None:
            self._runner.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # --- rounds: timer, policy inputs, one rebalance pass ----------------------------------

    def _due(self, now: float) -> bool:
        """Timer logic (lock held, queue drained): True when a round must run now."""
        if self._deadline is not None and self._deadline_epoch != self.agg.placement_epoch:
            self._deadline = None                 # a commit happened: restart the interval
        if not self.agg.empty and self._deadline is None:
            self._deadline, self._deadline_epoch = now + self.interval, self.agg.placement_epoch
        if self._first_round_pending() and self.agg.sample_count >= self.first_round_samples:
            self._deadline = None                 # the interval counts from the first round
            return not self.pipe.in_progress
        if self._deadline is None or now < self._deadline:
            return False
        self._deadline = None
        # NOTE: if a round is still in flight the elapsed interval is dropped (re-armed next pass).
        return not self.pipe.in_progress and not self.agg.empty

    def _first_round_pending(self) -> bool:
        """No round has run yet and the first one is paced by samples, not by the timer."""
        return self.first_round_samples > 0 and self._counters.rounds == 0

    def next_round(self) -> str:
        """When the next round runs, in words (the ready line, /eplb/status ``next_round``, the
        bench's EPLB section): ``after 256 load samples (37 so far)``, ``in 12.3 s``, ``at the
        first load sample + 1000 s``, or ``when the round in flight ends``."""
        with self._lock:
            return self._next_round_text(self.clock())

    def _next_round_text(self, now: float) -> str:
        if self.pipe.in_progress:
            return "when the round in flight ends"
        timer = (f"{self.interval:g} s after the next load sample" if self._deadline is None
                 else f"in {max(self._deadline - now, 0.0):.1f} s")
        if self._first_round_pending():
            return (f"after {self.first_round_samples} load samples "
                    f"({self.agg.sample_count} so far; --eplb_first_round_samples) or {timer} "
                    f"(--eplb_update_interval), whichever comes first")
        return f"{timer} (--eplb_update_interval)"

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
                self._counters.count_rollback(back[1])
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
        self._counters.count_round(k, seconds)
        self.hb.count_round(k)
        log.info(event("EPLB rebalance", policy=self.policy_name,
                       layers_updated=f"{k}/{self.num_layers}",
                       duration_ms=round(seconds * 1e3, 3)))

    # --- outputs (lock held) -----------------------------------------------------------------

    def _observe_prepared(self, tokens: list[int], now: float) -> None:
        tokens = list(tokens)
        if len(tokens) != self.ep_size:
            self._counters.count_rejected()
            log.warning(event("EPLB rejected worker output", reason="prepared_tokens",
                              got=len(tokens), expected=self.ep_size))
            return
        if self.pipe.active_token == NO_TOKEN and tokens.count(NO_TOKEN) == len(tokens):
            return                                   # fast path: nothing prepared, nothing due
        for tok in self.pipe.observe_prepared([int(t) for t in tokens], now):
            self._counters.count_stale_token()
            log.warning(event("EPLB ignoring stale prepare token", got=tok,
                              waiting_for=self.pipe.active_token))

    def _observe_activation(self, token: int) -> None:
        waiting = self.pipe.awaited_token()
        layer = self.pipe.observe_activation(token)
        if layer is not None:
            self._commit(layer)
        elif token != NO_TOKEN:
            self._counters.count_stale_token()
            log.warning(event("EPLB ignoring stale activation completion token", got=token,
                              waiting_for=waiting))

    def _enqueue(self, counters: list[np.ndarray], expert_cpu=None) -> None:
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
            self._counters.count_backlog_drop()
        cpu = None
        if expert_cpu is not None:
            cpu = np.asarray(expert_cpu, dtype=np.float64)
            if cpu.shape != (self.ep_size, self.num_layers):
                cpu = None                        # a model without per-layer timings: no cost
        self._queue.append((counters, self._active, self.agg.placement_epoch, cpu))

    def _reject(self, why: str) -> None:
        self._counters.count_rejected()
        log.warning(event("EPLB rejected worker output", reason=why))

    def _commit(self, layer: int) -> None:
        """The activation of ``layer`` came back: write its row into the deployed placement,
        start a new window."""
        row = self.pipe.candidate[layer]
        prev = self._active[layer].copy()
        d = diff(prev, row, self.ep_size)
        active = self._active.copy()
        active[layer] = row
        active.setflags(write=False)
        self._active = active
        self.agg.commit()
        committed = self.cost.on_commit(layer, prev, self.agg.placement_epoch)
        self._deadline = None
        self._counters.count_commit(committed, d.moved_slots, d.weight_copies)
        log.info(event("EPLB layer activated", layer=layer,
                       placement_epoch=self.agg.placement_epoch,
                       slots_moved=d.moved_slots, weight_copies=d.weight_copies))

    # --- samples -----------------------------------------------------------------------------

    def _drain(self) -> None:
        """Aggregate queued samples: take the queue under the lock, decode and scatter without
        it, add under it again (the epoch check then drops samples a commit made stale)."""
        with self._lock:
            if not self._queue:
                return
            items, self._queue = self._queue, collections.deque()
        done = []
        for counters, placement, epoch, cpu in items:
            try:
                deltas = self.agg.decode(counters)
            except CounterShapeError as e:
                done.append((str(e), None, epoch, placement, None))
                continue
            done.append((deltas, logical_loads(deltas, placement, self.num_logical), epoch,
                         placement, cpu))
        with self._lock:
            for deltas, logical, epoch, placement, cpu in done:
                if logical is None:
                    self._reject(deltas)
                    continue
                self._accumulate(deltas, logical, epoch)
                if cpu is not None:
                    self._counters.count_checks(
                        self.cost.observe(deltas, placement, cpu, epoch, logical))

    def _accumulate(self, deltas: np.ndarray, logical: np.ndarray, epoch: int) -> None:
        fresh = self.agg.accumulate(deltas, logical, epoch)
        self._counters.count_sample(fresh)
        if not fresh:
            return
        self.hb.count_sample()
        if self.estimator is not None:
            self.estimator.observe(logical)

    # --- timeouts (lock held) ----------------------------------------------------------------

    def _check_timeouts(self, now: float) -> None:
        """``tick``: abort an overdue layer, then the manager heartbeat."""
        self._abort_overdue(now)
        self.hb.manager_pass(now, self.pipe)

    def _abort_overdue(self, now: float) -> None:
        """An aborted layer is disabled in the pipeline; the deployed table never had it."""
        ab = self.pipe.check_timeout(now, self.timeout)
        if ab is not None:
            self._counters.count_timeout()
            log.warning(event(f"EPLB layer {ab.layer} {ab.kind} timed out after "
                              f"{ab.limit:g}s; skipping this layer for the current round.",
                              layer=ab.layer, token=ab.token, kind=ab.kind.replace(" ", "_"),
                              elapsed_s=round(ab.elapsed, 3)))

    def _wait_seconds(self) -> float:
        """How long the background thread may sleep before its next pass."""
        with self._lock:
            wait = DRAIN_PERIOD_S
            if self._deadline is not None:
                wait = min(wait, max(self._deadline - self.clock(), 0.0))
        return max(wait, 0.001)
