"""Worker main loop: one process per EP rank (= one DP rank).

Start-up: attach the input ring (reader ``rank``) and this rank's output ring, join
torch.distributed (EP group + EPLB group), build the model shard and the EPLB executor, report
each stage to the launcher. Loop, one iteration per engine step::

    msg = input_ring.get()                       # ForwardInput (every rank reads every step)
    executor.before_forward(msg.eplb_info)       # start P2P of update_layer_id, queue prepare
    result = model.forward_step(msg.batches[rank], warmup=msg.warmup,
                                pure_decode=msg.pure_decode)   # the engine's step flag
    executor.after_forward()                     # wait P2P, activate in place
    output_ring.put(ForwardOutput(...))          # counters, tokens, sampled, timings

NOTE: every rank must run every step (empty batch included) in the same order: the MoE
all-to-all and the EPLB P2P plan are collectives. A rank that fails reports the error in its
output and exits non-zero; the launcher then stops the run. With ``--elastic_ep`` a failed step
is reported as ``peer_lost`` and the worker stays up for the engine's regroup message; its
elastic component (``worker/membership.py`` ``WorkerMembership``) holds the membership: a
replacement (``pg_generation`` > 1) joins that generation at start; a *joiner* (``join=True``,
``--elastic_rejoin``) loads its model first while the others serve, signals ``join_ready`` and
joins the generation the engine names (``WorkerMembership.start_joiner``). After
an elastic *shrink* the worker serves at its compact ``ep_rank`` (``rank`` stays its identity:
rings, log, process name): it reads ``msg.batches[ep_rank]`` and answers as ``ep_rank``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from xllm_eplb.child import child_exit, child_setup, parent_alive, send_event
from xllm_eplb.config import Config, node_ranks
from xllm_eplb.eplb.info import NO_LAYER, NO_TOKEN
from xllm_eplb.ipc.errors import RingTimeoutError
from xllm_eplb.ipc.messages import ForwardOutput
from xllm_eplb.ipc.records import StepTimings, WorkerHeartbeat
from xllm_eplb.ipc.ring import InputRing, OutputRing
from xllm_eplb.model.decoder import build_model
from xllm_eplb.model.step_inputs import dispatched_rows
from xllm_eplb.obs.logs import FILE_ONLY, console_handler, event, setup_logging
from xllm_eplb.obs.step_timer import StepTimer
from xllm_eplb.worker import affinity, comm
from xllm_eplb.worker.executor import make_executor
from xllm_eplb.worker.faults import make_faults
from xllm_eplb.worker.membership import WorkerMembership
from xllm_eplb.worker.transport import close_ep_transport, open_ep_transport

log = logging.getLogger(__name__)

POLL_SECONDS = 1.0
ATTACH_TIMEOUT = 60.0
#: exit code of an injected ``crash`` (``--fault_inject=crash:...``)
INJECTED_CRASH_EXIT = 86


def _setup_logs(cfg: Config, rank: int) -> None:
    """Per-rank file ``rank<r>.log``; warnings and errors also reach the console."""
    path = Path(cfg.serve.log_dir) / f"rank{rank}.log"
    setup_logging(f"ep{rank}", cfg.serve.v, str(path), stream=None)
    # one line per warning/error on the console; tracebacks stay in rank<r>.log
    logging.getLogger().addHandler(console_handler(f"ep{rank}", logging.WARNING,
                                                   tracebacks=False))


#: the model phases of the decoder's ``timer`` (``obs/step_timer.py``)
MODEL_PHASES = ("attention", "router", "experts", "dispatch", "sampling")


def step_phases(timed: dict, model_timings: dict, step_s: float) -> dict[str, float]:
    """The forward's seconds by phase: what the timer recorded (the executor's
    ``eplb_hooks``, the decoder's model phases), ``other`` = the rest of ``step_s``. A decoder
    without a timer: ``experts`` / ``dispatch`` / ``moe_other`` from its MoE timings instead."""
    ph = dict(timed)
    if not any(p in ph for p in MODEL_PHASES):
        t = model_timings
        experts = float(sum(t.get("expert_cpu_s", ())))
        dispatch = float(t.get("comm_wait_s", 0.0))
        ph.update(experts=experts, dispatch=dispatch,
                  moe_other=max(0.0, float(t.get("moe_s", 0.0)) - experts - dispatch))
    ph["other"] = ph.get("other", 0.0) + max(0.0, step_s - sum(ph.values()))
    return ph


def step_timings(model_timings: dict, *, step_s: float, cpu_s: float,
                 eplb_s: float, **loop) -> StepTimings:
    """The worker's seconds plus the model's per-MoE-layer expert CPU list
    (``StepResult.timings["expert_cpu_s"]`` [L_moe], required) and its MoE wall clock, comm
    wait (the count exchange included) and replica-routing solve seconds (0 where the model does not report them)
    -> ``ForwardOutput.timings``; ``loop``: the breakdown fields (``phases``, ``wait_s``,
    ``ring_s``)."""
    t = model_timings
    return StepTimings(step_s=step_s, cpu_s=cpu_s, eplb_s=eplb_s, **loop,
                       expert_cpu_s=[float(s) for s in t["expert_cpu_s"]],
                       moe_s=float(t.get("moe_s", 0.0)), comm_s=float(t.get("comm_wait_s", 0.0)),
                       route_s=float(t.get("route_solve_s", 0.0)),
                       moe_cpu_s=float(t.get("moe_cpu_s", 0.0)),
                       dropped=int(t.get("dropped", 0)), rerouted=int(t.get("rerouted", 0)),
                       a2a_rounds=int(t.get("a2a_rounds", 0)))


class Worker:
    """One EP rank's resources: rings, process groups, model shard, executor."""

    def __init__(self, cfg: Config, rank: int, events, parent_pid: int, pg_generation: int = 0,
                 join: bool = False, threads: int = 1):
        self.cfg, self.rank, self.events, self.parent_pid = cfg, rank, events, parent_pid
        #: this worker's EP rank and world size in the current generation: ``rank`` and
        #: ``--ep_size`` until an elastic shrink compacts the survivors (``rank`` stays the
        #: worker's identity: its rings, its log, its process name)
        self.ep_rank, self.ep_size = rank, cfg.eplb.ep_size
        self.elastic = cfg.runtime.elastic_ep
        #: the elastic component: store client, membership generation, joiner or not
        self.membership = WorkerMembership(cfg, rank, events, parent_pid, pg_generation, join)
        self.inp = self.out = self.model = self.executor = None
        self.device = None
        self.faults = make_faults(cfg, rank, self._crash)
        self.threads = threads           # torch intra-op threads (= pinned cores, worker_main)
        #: the step-time breakdown: the executor hooks and (``model.time_phases``) the model phases
        self.timer = StepTimer()
        self._wait_s = self._ring_s = 0.0     # the loop's seconds since the last output
        #: req_id -> the token this rank last sampled for it (a planned-ahead decode row's
        #: token, ``RankBatch.fill_pending``); dropped with the request's KV cache
        self.last_tokens: dict[int, int] = {}

    def _crash(self, detail: str) -> None:
        """An injected crash: tell the launcher why, then leave at once (no clean-up)."""
        log.error(event("worker crash", rank=self.rank, detail=detail))
        send_event(self.events, f"ep{self.rank}", "error", f"rank {self.rank}: {detail}")
        logging.shutdown()
        child_exit(INJECTED_CRASH_EXIT, self.events)

    def start(self) -> None:
        torch.set_num_threads(self.threads)
        ms = self.membership
        if ms.joining:
            return ms.start_joiner(self)
        rid, who = self.cfg.runtime.run_id, f"ep{self.rank}"
        # NOTE: a node's input ring has one reader per rank from the node's first rank on
        # (node 0: every rank, the bridges read the remote ones); single node: index = rank
        first = node_ranks(self.cfg).start
        self.inp = InputRing.attach(rid, reader_index=self.rank - first, timeout=ATTACH_TIMEOUT,
                                    skip=ms.replacement)
        self.out = OutputRing.attach(rid, self.rank, timeout=ATTACH_TIMEOUT)
        if ms.replacement:        # the engine may send the regroup step now
            ms.connect(max(120.0, self.cfg.runtime.worker_timeout_seconds))
            ms.announce_attached()
        ep_group, eplb_group = self._init_dist()
        send_event(self.events, who, "dist_init")
        self._build(ep_group, eplb_group)
        send_event(self.events, who, "model")

    def _init_dist(self):
        # NOTE: rendezvous waits for all ranks; 17 processes start slowly on 2 cores.
        timeout = max(120.0, self.cfg.runtime.worker_timeout_seconds)
        if self.elastic:     # the launcher's store, this generation's prefix
            g = self.membership.join_world(timeout)
        else:
            g = comm.init_groups(self.cfg, self.rank, self.cfg.eplb.ep_size, timeout_s=timeout)
        self.device = g.device
        return g.ep_group, g.eplb_group

    def _build(self, ep_group, eplb_group) -> None:
        # a replacement builds the shard of the placement the engine deploys now
        self.model = build_model(self.cfg, self.rank, ep_group, device=self.device,
                                 phy2log=self.membership.start_placement())
        self._open_transport(self.membership.pg_generation)
        self.executor = make_executor(self.model, eplb_group, self.cfg, faults=self.faults)

    def _open_transport(self, generation: int) -> None:
        """The generation's dispatch transport (``--ep_transport``; None: the EP group)."""
        self.model.attach_transport(open_ep_transport(self.cfg, self.cfg.runtime.run_id,
                                                      generation, self.ep_rank, self.ep_size))

    def _close_transport(self) -> None:
        if self.model is not None:
            a2a = self.model.detach_transport()
            with contextlib.suppress(Exception):
                close_ep_transport(a2a)

    # --- loop ------------------------------------------------------------------------------
    def next_input(self):
        """Block for the next ForwardInput; None when the launcher is gone."""
        while True:
            try:
                return self.inp.get(timeout=POLL_SECONDS)
            except RingTimeoutError:
                if not parent_alive(self.parent_pid):
                    log.error(event("worker parent gone", rank=self.rank))
                    return None

    def run(self) -> int:
        send_event(self.events, f"ep{self.rank}", "ready")
        log.info(event("worker ready", rank=self.rank, pid=os.getpid()))
        self.model.time_phases(self.timer)   # the decoder times its phases (default: NULL)
        while True:
            t0 = time.perf_counter()
            msg = self.next_input()
            t1 = time.perf_counter()
            if msg is None:
                return 1
            if msg.shutdown:
                log.info(event("worker shutdown", rank=self.rank, step=msg.step))
                return 0
            codec = self.inp.take_codec_seconds()      # the input's decode, inside the wait
            self._wait_s += max(0.0, t1 - t0 - codec)
            self._ring_s += codec
            out = self.regroup(msg) if msg.regroup else self.step(msg)
            t2 = time.perf_counter()
            self.out.put(out, timeout=self.cfg.runtime.worker_timeout_seconds,
                         bad_checksum=self.faults.corrupt(msg.step))
            self._ring_s += time.perf_counter() - t2    # shipped with the next output
            if out.error and not out.peer_lost:
                send_event(self.events, f"ep{self.rank}", "error", out.error)
                return 1

    def step(self, msg):
        """One forward; exceptions become ``ForwardOutput.error`` (the run then stops)."""
        try:
            return self._forward(msg)
        except Exception as e:  # noqa: BLE001 - reported to the engine, then exit
            # NOTE: after one rank crashes every survivor fails its collective: file only
            log.exception(event("worker step failed", rank=self.rank, step=msg.step),
                          extra=FILE_ONLY)
            error = f"rank {self.rank}: {type(e).__name__}: {e}"
        # NOTE: outside the ``except``: the traceback holds the failed step's gloo work
        peer_lost = self.membership.step_failed(self)
        return ForwardOutput(step=msg.step, rank=self.ep_rank, peer_lost=peer_lost, error=error)

    def regroup(self, msg):
        """``--elastic_ep``: re-form as generation ``msg.regroup`` (``worker/membership.py``)."""
        return self.membership.regroup(msg, self)

    # --- what the elastic component asks of the worker (``membership.WorkerHost``) ----------
    def release_groups(self) -> None:
        """Close the executor and the dispatch transport and drop the model's EP group (the
        groups are left next; a group's sockets close only when nothing holds it)."""
        if self.executor is not None:
            with contextlib.suppress(Exception):
                self.executor.close()
        self.executor = None
        self.model.leave_group()
        self._close_transport()     # a peer in this step's round fails at once

    def load_alone(self) -> None:
        """A joiner: the output ring, then this worker's initial shard with no process group
        (read from the checkpoint while the others serve)."""
        self.out = OutputRing.attach(self.cfg.runtime.run_id, self.rank, timeout=ATTACH_TIMEOUT)
        self.device = comm.device_for_rank(self.cfg.runtime.device, self.rank)
        self.model = build_model(self.cfg, self.rank, None, device=self.device, joining=True)
        send_event(self.events, f"ep{self.rank}", "model")
        self.faults.join()

    def attach_input(self) -> None:
        """A joiner let in: read the input ring from its newest frame."""
        self.inp = InputRing.attach(self.cfg.runtime.run_id,
                                    reader_index=self.rank - node_ranks(self.cfg).start,
                                    timeout=ATTACH_TIMEOUT, skip=True)

    def adopt(self, groups, pg_generation: int, ep_rank: int, ep_size: int, table) -> None:
        """Serve in ``pg_generation`` on ``groups``: the model's EP group, a re-shard when
        ``table`` is given (a shrink), a new executor on the EPLB group, fresh transport
        buffers."""
        self.model.join_group(groups.ep_group)
        if table is not None:
            self.reshard(ep_rank, ep_size, table)
        self.executor = make_executor(self.model, groups.eplb_group, self.cfg, faults=self.faults)
        self._open_transport(pg_generation)

    def heartbeat(self) -> WorkerHeartbeat:
        return WorkerHeartbeat(time.time(), self.executor.stats())

    def reshard(self, ep_rank: int, ep_size: int, table) -> None:
        """Elastic shrink: compact rank, the new table, orphans read from the checkpoint; the
        transfer canary must pass (else the re-form fails and the run stops)."""
        got = self.model.reshard(ep_rank, ep_size, table)
        bad = self.model.canary()
        if bad:
            raise RuntimeError(bad)
        self.ep_rank, self.ep_size = ep_rank, ep_size
        log.info(event("EPLB elastic resharded", rank=self.rank, ep_rank=ep_rank,
                       ep_size=ep_size, checkpoint=got["checkpoint"], kept=got["kept"],
                       canary="ok", seconds=round(got["seconds"], 3)))

    def _forward(self, msg):
        batch, info = msg.batches[self.ep_rank], msg.eplb_info
        c0, t0 = time.thread_time(), time.perf_counter()
        for r in batch.release:
            self.last_tokens.pop(r, None)
        batch.fill_pending(self.last_tokens)      # --async_scheduling: rows planned ahead
        self.faults.step(msg.step)
        self.executor.before_forward(info)
        c1, t1 = time.thread_time(), time.perf_counter()
        res = self.model.forward_step(batch, warmup=msg.warmup, pure_decode=msg.pure_decode,
                                      peer_rows=dispatched_rows(self.model.cfg, msg.batches))
        c2, t2 = time.thread_time(), time.perf_counter()
        if not msg.warmup:
            self.last_tokens.update(res.sampled)
        self.executor.after_forward()
        ready = self.executor.consume_ready_token()
        c3 = time.thread_time()
        self.timer.add("eplb_hooks", (t1 - t0) + (time.perf_counter() - t2))
        act = info.activation_token if info.update_layer_id != NO_LAYER else NO_TOKEN
        step_s = time.perf_counter() - t0
        # eplb_s: main-thread CPU of the executor hooks (the EPLB cost of this step)
        timings = step_timings(res.timings, step_s=step_s, cpu_s=c3 - c0,
                               eplb_s=(c1 - c0) + (c3 - c2),
                               phases=step_phases(self.timer.take(), res.timings, step_s),
                               wait_s=self._wait_s, ring_s=self._ring_s)
        self._wait_s = self._ring_s = 0.0
        return ForwardOutput(step=msg.step, rank=self.ep_rank, counters=res.counters,
                             prepared_token=ready,
                             activation_token=act, sampled=res.sampled, logprobs=res.logprobs,
                             timings=timings,
                             heartbeat=WorkerHeartbeat(time.time(), self.executor.stats()),
                             error=None)

    def close(self) -> None:
        """Executor thread, process groups, rings: each closed once, errors ignored."""
        t = [time.perf_counter()]
        if self.executor is not None:
            with contextlib.suppress(Exception):
                self.executor.close()
        self._close_transport()
        t.append(time.perf_counter())
        with contextlib.suppress(Exception):
            if dist.is_initialized():
                dist.destroy_process_group()
        t.append(time.perf_counter())
        for ring in (self.inp, self.out):
            if ring is not None:
                with contextlib.suppress(Exception):
                    ring.close()
        t.append(time.perf_counter())
        log.info(event("worker closed", rank=self.rank, executor_s=round(t[1] - t[0], 3),
                       dist_s=round(t[2] - t[1], 3), rings_s=round(t[3] - t[2], 3)))


def worker_main(cfg: Config, rank: int, events, parent_pid: int, pg_generation: int = 0,
                cores: tuple[int, ...] | None = None, join: bool = False) -> None:
    """Process entry point (spawned by the launcher; ``pg_generation`` > 1: an elastic
    replacement; ``join``: a rejoining one); ``cores``: this rank's pinned cores
    (``--worker_cpu_affinity``; None: not pinned, one torch thread)."""
    threads = affinity.apply(cores)
    child_setup(f"xllm-eplb:ep{rank}", parent_pid)
    _setup_logs(cfg, rank)
    send_event(events, f"ep{rank}", "spawned")
    w = Worker(cfg, rank, events, parent_pid, pg_generation, join, threads)
    code = 1
    try:
        w.start()
        code = w.run()
    except Exception as e:  # noqa: BLE001 - logged, reported, exit non-zero
        log.exception(event("worker failed", rank=rank))
        send_event(events, f"ep{rank}", "error", f"{type(e).__name__}: {e}")
    finally:
        w.close()
        logging.shutdown()
    child_exit(code, events)
