"""The engine process: HTTP API, continuous-batching step loop, EPLB manager, metrics.

One step (``Engine.step``), in data order (docs/architecture.md)::

    batches = scheduler.schedule()                     # one RankBatch per DP rank
    info = manager.eplb_info(allow)                    # allow: pure-decode boundary, no warm-up
    input_ring.put(ForwardInput(step, batches, info))  # every worker reads it
    outputs = [ring.get() for ring in output_rings]    # one ForwardOutput per rank
    manager.on_outputs(counters, prepared_tokens, activation_token)
    scheduler.update(sampled) -> finished requests (tokens to the HTTP handlers)
    # telemetry -> metrics: run by the next step right after its input is written (it
    # overlaps the workers' forward; ``Engine.account``), or before the loop idles

``--async_scheduling`` (default on): while step n runs, the loop plans step n+1
(``Engine.plan_ahead``: ``scheduler.schedule(ahead=True)``, no EPLB command) and writes it the
moment n's outputs are read, before n's bookkeeping; so the workers wait for the engine only
for the ring hop. Not while an EPLB round is in flight (its commands follow each step's
outputs, ``manager.quiescent``) or a membership change waits (``membership.quiet``): then the
next step is planned after the outputs, as without the flag.

The loop times itself (``engine/breakdown.py``): ``/eplb/status`` ``step_breakdown``.

With ``enable_eplb=false`` there is no manager: every forward carries an empty ``EplbInfo``.
Idle (no requests): the loop blocks on the request queue (``IDLE_WAIT`` s slices; 0.05 s with
``--elastic_ep``, to see a death notice at once) and only
ticks the manager's timeouts; the manager's policy thread sleeps on its own condition.
"""

from __future__ import annotations

import contextlib
import logging
import time

from xllm_eplb import __version__
from xllm_eplb.config import Config, node_of_rank, ranks_per_node, resolve_backend
from xllm_eplb.engine.breakdown import StepBreakdown
from xllm_eplb.engine.failures import WAIT_SLICE, FailureWatch, WorkerFault
from xllm_eplb.engine.health import StepWatch
from xllm_eplb.engine.live_stats import LiveStats
from xllm_eplb.engine.membership import IDLE_WAIT, NoMembership
from xllm_eplb.engine.scheduler import Request, Scheduler, is_pure_decode_step
from xllm_eplb.engine.telemetry import Telemetry, slot_loads
from xllm_eplb.engine.tokenizer import BOS_ID
from xllm_eplb.eplb.info import NO_TOKEN, EplbInfo
from xllm_eplb.eplb.membership_plan import resized_manager
from xllm_eplb.eplb.placement_file import initial_placement
from xllm_eplb.eplb.recorder import ExpertRecorder
from xllm_eplb.ipc.errors import IpcError, RingTimeoutError
from xllm_eplb.ipc.messages import ForwardInput
from xllm_eplb.model.batch import RankBatch, SeqRow
from xllm_eplb.obs.logs import event
from xllm_eplb.obs.metrics import EngineMetrics

log = logging.getLogger(__name__)

#: first forwards wait for every worker to join torch.distributed and build its shard
STARTUP_TIMEOUT = 600.0


__all__ = ["IDLE_WAIT", "Engine", "WorkerFault", "agreed_token", "step_kind"]


def step_kind(batches: list[RankBatch], warmup: bool, pure_decode: bool) -> str:
    """warmup / decode (``pure_decode``: the step's flag) / idle / prefill / mixed."""
    if warmup:
        return "warmup"
    if pure_decode:
        return "decode"
    rows = [r for b in batches for r in b.rows]
    if not rows:
        return "idle"
    return "prefill" if all(r.is_prefill for r in rows) else "mixed"


def agreed_token(tokens: list[int]) -> int:
    """The activation token every rank returned, or -1 when they disagree (never commit)."""
    first = tokens[0]
    if any(t != first for t in tokens):
        log.warning(event("EPLB activation token mismatch", tokens=",".join(map(str, tokens))))
        return NO_TOKEN
    return first


def decode_costs(outs, pure: bool) -> list | None:
    """The ranks' per-layer expert CPU seconds of a pure-decode step (the cost model's input),
    else None (prefill rows are not all counted)."""
    return [o.timings.expert_cpu_s for o in outs] if pure else None


class Engine:
    """Owns the scheduler, the rings' engine ends, the manager and the telemetry."""

    def __init__(self, cfg: Config, inp, outs, *, manager=None, metrics=None, box=None,
                 cores: dict | None = None):
        self.cfg, self.inp, self.outs = cfg, inp, outs
        #: every worker's output ring (worker id -> ring); ``outs`` are the members' in rank
        #: order, ``workers`` their ids (``resize``)
        self.rings, self.workers = dict(enumerate(outs)), list(range(len(outs)))
        self.D = cfg.eplb.ep_size
        rt = cfg.runtime
        self.sched = Scheduler(self.D, rt.max_batch_size, rt.max_prefill_tokens)
        self.manager = manager
        self.metrics = metrics or EngineMetrics(
            self.D, cfg.num_moe_layers, per_layer=cfg.serve.enable_per_layer_metrics,
            version=__version__, backend=resolve_backend(rt.device, rt.backend),
            policy=cfg.eplb.eplb_policy_kind, hot_experts=cfg.serve.metrics_hot_experts,
            all_experts=cfg.serve.enable_expert_metrics)
        self.metrics.enabled.set(1 if manager is not None else 0)
        self.tele = Telemetry(self.metrics, cfg.num_moe_layers, self.D,
                              ranks_per_node=ranks_per_node(cfg))
        self.live = LiveStats(   # vLLM-style live view: token metrics, experts, stats line
            self.metrics, num_layers=cfg.num_moe_layers, num_experts=cfg.model.num_experts,
            kv_capacity=self.D * rt.max_batch_size * cfg.model.max_position_embeddings,
            stats_interval_s=cfg.serve.log_stats_interval, now=time.monotonic())
        self.rank_node = [node_of_rank(cfg, r) for r in range(self.D)]   # multi-node (#14)
        for r, n in enumerate(self.rank_node):
            self.metrics.rank_node.labels(str(r)).set(n)
        self.watch = StepWatch(self.D, cfg.serve.stall_seconds)
        self.breakdown = StepBreakdown(self.D)       # /eplb/status step_breakdown
        # stall -> clients told; the launcher's death notices (``box``, from engine/process)
        self.failures = FailureWatch(self.sched, self.watch, cfg.serve.stall_seconds, box,
                                     on_failed=self._finished)
        self.placement = initial_placement(cfg)       # [L, D*S]: what the workers start from
        self.recorder = ExpertRecorder(cfg.num_moe_layers, self.D, cfg.slots_per_rank,
                                       cfg.model.num_experts, cfg.eplb.eplb_record_trace_max_steps)
        #: the membership port (``engine/membership.py``): ``--elastic_ep``'s recovery state
        #: machine, injected after the warm-up (:meth:`use_membership`), else a no-op
        self.membership = NoMembership()
        self.step_no = 0
        #: the step written and not yet read back: (input, its start, its EPLB CPU seconds)
        self._in_flight: tuple[ForwardInput, float, float] | None = None
        self._last_refresh = 0.0
        #: steps planned while the one before ran (``--async_scheduling``; /eplb/status)
        self.planned_ahead = 0
        #: this node's cores and processes (``engine/process.host_cores``; /eplb/status)
        self.cores: dict = cores or {}
        self._pending = None         # the last step's deferred bookkeeping (``account``)
        self._pending_eplb_s = 0.0
        self._plan_eplb_s = 0.0      # the manager's CPU in the last :meth:`prepare`
        self.state = "starting"
        self.stopping = False
        #: True during :meth:`warmup` (a stop then leaves at the next wait slice)
        self.warming = False

    # --- one forward -----------------------------------------------------------------------
    def use_manager(self, manager) -> None:
        """Inject the EPLB manager (``engine/process.make_manager``; None: EPLB off; an
        elastic resize: ``eplb/membership_plan.resized_manager``)."""
        self.manager = manager
        self.metrics.enabled.set(1 if manager is not None else 0)

    def use_membership(self, membership) -> None:
        """Inject the membership port (``--elastic_ep``: ``elastic/recovery.EngineRecovery``)."""
        self.membership = membership

    def step(self, batches: list[RankBatch], *, warmup: bool = False,
             timeout: float | None = None) -> list | None:
        """Run one forward on every rank; returns the rank-ordered outputs (None: a rank died
        and ``--elastic_ep`` voided the step)."""
        self.send(self.prepare(batches, warmup=warmup))
        return self.finish(timeout=timeout)

    def prepare(self, batches: list[RankBatch], *, warmup: bool = False) -> ForwardInput:
        """The next step's input. Its EPLB command comes from the manager only at a pure-decode
        boundary with no step in flight (a step planned ahead carries none)."""
        pure = is_pure_decode_step(batches)
        allow = pure and not warmup and self._in_flight is None
        c0 = time.thread_time()
        info = self.manager.eplb_info(allow) if self.manager is not None else EplbInfo()
        self._plan_eplb_s = time.thread_time() - c0
        self.breakdown.lap("eplb_hooks")
        return ForwardInput(self.step_no + 1, batches, info, warmup=warmup, pure_decode=pure)

    def send(self, msg: ForwardInput) -> None:
        """Write ``msg`` to the input ring: it is now the step in flight."""
        self.step_no = msg.step
        t0 = time.perf_counter()
        self.watch.begin()
        self.inp.put(msg, timeout=self.cfg.runtime.worker_timeout_seconds)
        if time.perf_counter() - t0 > 0.01:
            self.metrics.ring_full.labels("input").inc()
        self._in_flight = (msg, t0, self._plan_eplb_s)

    def finish(self, *, timeout: float | None = None, ahead=None) -> list | None:
        """Read the step in flight back and do its bookkeeping; returns the rank-ordered
        outputs (None: void, ``--elastic_ep``). ``ahead() -> ForwardInput | None`` plans the
        next step meanwhile; it is written as soon as the outputs are read."""
        msg, t0, eplb_s = self._in_flight
        warmup, pure = msg.warmup, msg.pure_decode
        self.account()                    # the previous step's, while the workers run this one
        nxt = ahead() if ahead is not None else None
        outs = self._gather(timeout or self.cfg.runtime.worker_timeout_seconds)
        self._in_flight = None
        if outs is None:                  # elastic: a rank died, the step (and nxt) was void
            return None
        seconds = time.perf_counter() - t0
        self.watch.end()
        if nxt is not None:
            self.send(nxt)
        self.breakdown.forward(outs)
        self._ring_occupancy()
        if self.recorder.active and not warmup:     # off: this test is all it costs
            self.recorder.add([o.counters for o in outs], self.active_placement)
        # the placement this step ran under (an activation may commit in on_outputs)
        self._pending = (step_kind(msg.batches, warmup, pure), outs, seconds,
                         self.active_placement)
        if self.manager is not None and not warmup:
            c0 = time.thread_time()
            self.manager.on_outputs([o.counters for o in outs], [o.prepared_token for o in outs],
                                    agreed_token([o.activation_token for o in outs]),
                                    expert_cpu=decode_costs(outs, pure))
            self.tele.on_eplb(self.manager.stats())
            eplb_s += time.thread_time() - c0
            self.breakdown.lap("eplb_hooks")
        self._pending_eplb_s = eplb_s
        if warmup:
            self.account()
            self.breakdown.lap("telemetry")
        return outs

    def plan_ahead(self) -> ForwardInput | None:
        """``--async_scheduling``: the next step, planned while the one in flight runs (new
        requests and cancels taken in first), or None: stopping, an EPLB round or a membership
        change in flight, or no row to run (see the module docstring)."""
        if self.stopping or not self.membership.quiet() or (
                self.manager is not None and not self.manager.quiescent()):
            return None
        self.sched.pull()
        self._cancelled(self.sched.reap_cancelled())
        self._maybe_refresh()
        if not self.sched.can_plan_ahead():
            return None
        batches = self.sched.schedule(ahead=True)
        self.live.on_scheduled(batches, self.sched.running, time.monotonic())
        self.breakdown.lap("schedule")
        self.planned_ahead += 1
        return self.prepare(batches)

    def account(self) -> None:
        """The last step's bookkeeping (expert loads, step metrics), deferred: the next
        :meth:`step` runs it after writing its input, so it overlaps the workers' forward
        instead of delaying it; the loop runs it when no step follows (idle, an elastic
        boundary, the stop). Never deferred: the manager's ``on_outputs`` (the EPLB protocol
        orders it before the next ``eplb_info``) and the recorder (exact counts at ``stop``)."""
        if self._pending is None:
            return
        (kind, outs, seconds, placement), self._pending = self._pending, None
        if kind != "warmup" and outs[0].counters.size:
            self.live.on_slot_loads(slot_loads(outs), placement)
        self.tele.on_step(kind, outs, seconds, eplb_engine_s=self._pending_eplb_s)

    def _gather(self, timeout: float) -> list | None:
        """Every rank's output of the step; ``--elastic_ep``: None after a recovery from a
        rank's death (``elastic/recovery.py``; the step is void)."""
        got: dict[int, object] = {}
        try:
            for r in range(self.D):
                got[r] = self._get(r, timeout)
            return [got[r] for r in range(self.D)]
        except WorkerFault as e:
            if e.output is not None:     # the frame that failed is read
                got[e.output.rank] = e.output
            self.membership.recover(e, got)
            return None

    @property
    def active_placement(self):
        """int64 ``[L, D*S]``: the manager's deployed table, or (EPLB off) the initial one."""
        return self.manager.active_placement if self.manager is not None else self.placement

    def _ring_occupancy(self) -> None:
        """Frames still unread in the fullest output ring after the gather (back-pressure)."""
        with contextlib.suppress(Exception):
            ring = max(self.outs, key=lambda o: o.ring.pending()).ring
            self.metrics.ring_occupancy.labels("output").set(ring.pending() / ring.slots)

    def _wait_output(self, rank: int, timeout: float):
        """Rank ``rank``'s output within ``timeout`` s, read in ``WAIT_SLICE`` slices; between
        slices the failure watch acts on a stall or a death notice (``engine/failures.py``)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                return self.outs[rank].get(timeout=max(0.0, min(WAIT_SLICE, left)))
            except RingTimeoutError:
                if self.stopping and self.warming:
                    # a stop during the warm-up (workers still loading, some never will):
                    # leave now (engine/process.py's start-up exit), not at STARTUP_TIMEOUT
                    raise SystemExit(0) from None
                if left <= WAIT_SLICE:
                    raise
                if self.state == "serving":     # not the warm-up (workers still loading)
                    self.failures.between_slices(self.step_no, self.inp, self.outs)
                    self.membership.between_slices(self.step_no, self.watch.in_flight_seconds(),
                                                   lambda: self.watch.unread(self.inp))

    def _get(self, rank: int, timeout: float):
        try:
            out = self._wait_output(rank, timeout)
        except RingTimeoutError:
            # NOTE: every rank blocks in the all-to-all behind a silent one: name the ranks
            # that did not read this step's input (or did not answer), not the first waited on.
            silent = self.watch.waiting_on(self.inp, self.outs) or [rank]
            for r in silent:
                self.metrics.worker_up.labels(str(r)).set(0)
            names = ", ".join(map(str, silent))
            raise WorkerFault(f"rank {names}: stopped answering: no output for step "
                              f"{self.step_no} within --worker_timeout_seconds={timeout:g}"
                              ) from None
        except IpcError as e:
            self.metrics.worker_up.labels(str(rank)).set(0)
            raise WorkerFault(f"rank {rank}: no output for step {self.step_no}: {e}") from None
        self.watch.answer(rank)
        if out.error:
            raise WorkerFault(out.error, output=out)
        if out.step != self.step_no or out.rank != rank:
            raise WorkerFault(f"rank {rank}: answered step {out.step} rank {out.rank}, expected "
                              f"step {self.step_no}", output=out)
        return out

    # --- warm-up and loop ------------------------------------------------------------------
    def warmup(self) -> None:
        """Two warm-up forwards (never counted, never EPLB boundaries): every rank prefills a
        dummy row; then only rank 0 has a row (the empty-rank path)."""
        row = [BOS_ID] + list(range(1, 8))
        first = [RankBatch([SeqRow(-(r + 1), row, 0, True)]) for r in range(self.D)]
        second = [RankBatch([SeqRow(-1, row[:3], 0, True)] if r == 0 else [])
                  for r in range(self.D)]
        t0 = time.perf_counter()
        self.warming = True
        try:
            self.step(first, warmup=True, timeout=STARTUP_TIMEOUT)
            self.step(second, warmup=True)
        finally:
            self.warming = False
        log.info(event("engine warmup done", steps=2, seconds=round(time.perf_counter() - t0, 3)))

    def run(self) -> None:
        """Serve until :meth:`request_stop` (signal) or a worker fault (raises)."""
        self.state = "serving"
        self.breakdown.reset()
        ahead = self.plan_ahead if self.cfg.runtime.async_scheduling else None
        while not self.stopping:
            if self._in_flight is None and not self._start_step():
                continue
            outs = self.finish(ahead=ahead)
            if outs is None:         # --elastic_ep: the step died with a rank (voided)
                self.breakdown.lap("elastic")
                continue
            self._commit(outs)

    def _start_step(self) -> bool:
        """Nothing in flight: wait for work (idle), pass a membership boundary, schedule and
        write the next step. False: no step was written (idle or stopping)."""
        lap = self.breakdown.lap
        busy = self.sched.has_work
        if not busy and self._pending is not None:
            self.account()       # no step to overlap it with: before blocking
            lap("telemetry")
        c0 = time.thread_time()
        self.sched.pull(timeout=self.membership.idle_wait)
        lap("schedule" if busy else "idle")
        self._cancelled(self.sched.reap_cancelled())
        if self._maybe_refresh():
            c0 = None           # once a second either way: not an idle wake's cost
        if self.stopping or not self.sched.has_work:
            self.account()
            self.membership.when_idle()     # a death while idle: recover now
            if c0 is not None:
                self.membership.idle_cpu(time.thread_time() - c0)
            lap("idle")
            return False
        self.membership.at_boundary()       # a rejoin grows here (resize accounts first)
        batches = self.sched.schedule()
        self.live.on_scheduled(batches, self.sched.running, time.monotonic())
        lap("schedule")
        self.send(self.prepare(batches))
        return True

    def _commit(self, outs: list) -> None:
        """A step's sampled tokens to their requests (and the HTTP handlers)."""
        sampled: dict[int, int] = {}
        logprobs: dict = {}
        for o in outs:
            sampled.update(o.sampled)
            logprobs.update(o.logprobs)
        # NOTE: planned ahead, a row of a request that ended in the step before is not its token
        sampled = {r: t for r, t in sampled.items() if int(r) in self.sched.running}
        self.live.on_tokens(sampled, time.monotonic())
        self._finished(self.sched.update(sampled, logprobs))
        self.breakdown.lap("http")

    def _maybe_refresh(self) -> bool:
        """The once-a-second refresh (manager timeouts, health, gauges); True if it ran."""
        if time.monotonic() - self._last_refresh <= 1.0:
            return False
        self._last_refresh = time.monotonic()
        self._refresh()
        return True

    def _finished(self, reqs: list[Request]) -> None:
        self.tele.on_requests(reqs)
        self.live.on_finished(reqs)

    def _cancelled(self, reqs: list[Request]) -> None:
        for r in reqs:
            log.info(event("engine request cancelled", req=r.req_id, source=r.source,
                           tokens=len(r.output), reason=r.error or "client gone"))
        if reqs:
            self._finished(reqs)

    def _refresh(self) -> None:
        if self.manager is not None:
            self.manager.tick()
            self.tele.on_eplb(self.manager.stats())
        self.tele.refresh_health(self.cfg.runtime.worker_timeout_seconds)
        q = self.sched.load()
        self.metrics.queue.labels("waiting").set(q["waiting"])
        self.metrics.queue.labels("running").set(q["running"])
        due = self.live.refresh(
            time.monotonic(), running=self.sched.running, waiting=q["waiting"],
            placement=self.active_placement, balancedness=self.tele.balancedness_mean(),
            placement_epoch=int(self.tele.eplb.get("placement_epoch", 0)),
            last_rebalance_at=self.tele.last_commit_at,
            waiting_for_slot=self.sched.waiting_for_slot,
            max_batch_size=self.sched.max_batch_size)
        if due:
            (log.info if due[1] else log.debug)(due[0])

    def request_stop(self, *_args) -> None:
        self.stopping = True
        self.state = "stopping"

    def shutdown_workers(self) -> None:
        """Send the shutdown message (workers leave their loop); never blocks for long."""
        with contextlib.suppress(Exception):
            self.inp.put(ForwardInput.make_shutdown(self.step_no + 1), timeout=2.0)

    # --- elastic EP: the engine's side of a membership change (elastic/recovery.py) ---------
    @property
    def ep_size(self) -> int:
        return self.D

    def resize(self, workers: list[int], placement) -> None:
        """The one operation for a new membership: EP rank ``r`` is now worker ``workers[r]``
        (survivors keep their order; a joiner comes last) with ``placement`` [L, D*S] deployed.
        Everything sized by the ranks follows: input-ring readers (a worker left out is
        retired, a joiner's un-retired), output rings, scheduler (kept requests follow their
        worker), step watch, telemetry, recorder, KV capacity, metrics, the EPLB manager."""
        old, cfg = self.workers, self.cfg
        self.account()            # the last step's deferred bookkeeping, on the old ranks
        keep = [old.index(w) for w in workers if w in old]
        new = [w for w in workers if w not in old]
        if workers != [old[k] for k in keep] + new:
            raise ValueError(f"resize: workers={workers}: the kept ones in their order "
                             f"({old}), then the new ones")
        for w in set(old) - set(workers):
            self.inp.retire_reader(w)
        for w in new:
            self.inp.unretire_reader(w)
        self.outs, self.workers = [self.rings[w] for w in workers], list(workers)
        if keep != list(range(len(old))):
            self.sched.resize(keep)
        for _ in new:
            self.sched.grow()
        self.watch.resize(workers)
        D, was = len(workers), self.D
        for r in range(max(D, was)):
            self.metrics.rank_active.labels(str(r)).set(int(r < D))
            if r >= min(D, was):
                self.metrics.worker_up.labels(str(r)).set(int(r < D))
        self.metrics.ep_size_g.set(D)
        self.D = D
        self.tele.resize(D)
        self.breakdown.resize(D)
        self.recorder = ExpertRecorder(cfg.num_moe_layers, D, cfg.slots_per_rank,
                                       cfg.model.num_experts, cfg.eplb.eplb_record_trace_max_steps)
        self.rank_node = [0] * D
        self.live.resize(D * cfg.runtime.max_batch_size * cfg.model.max_position_embeddings)
        self.placement = placement
        self.use_manager(resized_manager(cfg, D, placement, self.manager))

    def send_regroup(self, pg_generation: int, timeout: float) -> int:
        """One empty step that re-forms the members as ``pg_generation``; returns its number."""
        self.step_no += 1
        self.inp.put(ForwardInput(self.step_no, [RankBatch() for _ in range(self.D)],
                                  regroup=pg_generation), timeout=timeout)
        return self.step_no

    def read_output(self, rank: int, timeout: float):
        """Rank ``rank``'s next output frame (ring errors propagate)."""
        return self.outs[rank].get(timeout=timeout)

    def void_step(self, rank: int) -> tuple[int, int]:
        """The step in flight died with ``rank``: nothing of it is committed
        (``Scheduler.void_step``); returns (requests re-prefilled, requests kept)."""
        self.watch.end()
        back = self.sched.void_step(rank)
        return len(back), len(self.sched.running)

    def abort_eplb_round(self, switched: bool | None) -> bool:
        """Drop an EPLB round in flight (``EplbManager.abort_round``); False: a layer's
        activation only some ranks switched (the run cannot go on)."""
        return self.manager is None or self.manager.abort_round(switched)

    def awaited_token(self) -> int:
        return self.manager.pipe.awaited_token() if self.manager is not None else NO_TOKEN

    def expert_load(self):
        """The run's per-expert token totals [L, E] so far, or None before any."""
        total = self.live.expert_total
        return total if total.sum() > 0 else None

    def idle_step(self) -> None:
        """An empty step (a death while idle meets the dead rank now)."""
        self.step([RankBatch() for _ in range(self.D)])
