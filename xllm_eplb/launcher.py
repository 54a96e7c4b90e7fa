"""``xllm-eplb serve``: create the run's shared memory, spawn the engine and one worker per EP
rank, show start-up progress and print the ready line (both in ``obs/progress.py``), supervise,
and tear everything down.

Process tree (spawn context)::

    launcher (xllm-eplb:launcher) ── engine (xllm-eplb:engine)  HTTP, scheduler, EPLB manager
                                  └─ worker 0..N-1 (xllm-eplb:ep<r>)  model shard, executor

Stopping: SIGINT/SIGTERM -> the launcher asks the engine to stop (SIGTERM); the engine sends the
shutdown message through the input ring, workers leave their loop; whatever has not exited after
``--shutdown_timeout_seconds`` is killed. If any child dies, the launcher stops the rest and exits
1 naming the process and its exit cause. NOTE: children ignore SIGINT (a terminal ^C reaches the
whole process group; only the launcher decides) and die with the launcher (PR_SET_PDEATHSIG,
plus a parent-pid check), and the launcher always sweeps the run's ``/dev/shm`` objects last.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import queue
import signal
import socket
import sys
import time
from pathlib import Path

from xllm_eplb.child import EventSender
from xllm_eplb.config import Config, node_ranks, ranks_per_node
from xllm_eplb.engine.process import engine_main
from xllm_eplb.ipc.errors import SegmentBusyError
from xllm_eplb.ipc.objects import sweep_dead_runs, sweep_run
from xllm_eplb.ipc.ring import InputRing, OutputRing
from xllm_eplb.ipc.shm import resolve_run_id
from xllm_eplb.ipc.store import host_store
from xllm_eplb.obs.logs import FILE_ONLY, event, run_log_dir, setup_logging
from xllm_eplb.obs.progress import Progress, ready_line
from xllm_eplb.preflight import StartupError, check_port, check_serve
from xllm_eplb.worker import affinity
from xllm_eplb.worker.worker import worker_main

__all__ = ["Launcher", "Progress", "RunShm", "StartupError", "check_port", "ready_line", "serve"]

log = logging.getLogger(__name__)

#: environment of every child (one intra-op thread per rank; 2 cores serve 17 processes)
CHILD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
             "TORCH_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resolve_runtime(cfg: Config, port: int | None = None) -> Config:
    """Fill what the run decides at start: HTTP port (for 0), rendezvous port, run id."""
    if port is None:
        port = check_port(cfg.serve.host, cfg.serve.port)
    mport = cfg.runtime.master_port or free_port()
    rt = dataclasses.replace(cfg.runtime, master_port=mport,
                             run_id=resolve_run_id(cfg.runtime.run_id, port))
    return dataclasses.replace(cfg, runtime=rt, serve=dataclasses.replace(cfg.serve, port=port))


def wall_clock() -> str:
    """``HH:MM:SS.mmm`` local time: when the launcher saw a death or killed a child (the
    console line and the launcher log carry the same stamp)."""
    now = time.time()
    return time.strftime("%H:%M:%S", time.localtime(now)) + f".{int(now % 1 * 1000):03d}"


def describe_exit(code: int | None) -> str:
    """``exit code 3`` / ``killed by SIGKILL`` / ``still running``."""
    if code is None:
        return "still running"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
        return f"killed by signal {-code}"
    return f"exit code {code}"


@contextlib.contextmanager
def _child_env():
    """Environment the spawned interpreter starts with (spawn copies ``os.environ``)."""
    old = {k: os.environ.get(k) for k in CHILD_ENV}
    os.environ.update(CHILD_ENV)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class EventHub:
    """The launcher's end of its children's event channels: one pipe per child (duplex, so the
    launcher can also send a child a notice), read with ``get`` as a queue of
    ``(who, stage, detail)`` tuples. No named semaphore is created (see ``child.py``)."""

    def __init__(self, ctx):
        self.ctx = ctx
        self.readers: dict[str, object] = {}    # who -> launcher end
        self._pending: list = []

    def sender(self, who: str) -> EventSender:
        """A new channel for child ``who``: its end (pass it to the spawned process, then call
        :meth:`spawned`)."""
        mine, theirs = self.ctx.Pipe(duplex=True)
        self.readers[who] = mine
        return EventSender(theirs)

    @staticmethod
    def spawned(sender: EventSender) -> None:
        """Close the launcher's copy of a child's end once the child has started (it holds
        its own): the launcher then sees EOF when the child is gone."""
        sender.close()

    def get(self, timeout: float):
        """The next event; raises ``queue.Empty`` after ``timeout`` seconds without one."""
        if not self._pending:
            live = list(self.readers.values())
            for conn in mpc.wait(live, timeout) if live else ():
                self._read(conn)
        if not self._pending:
            time.sleep(0 if self.readers else min(timeout, 0.05))
            raise queue.Empty
        return self._pending.pop(0)

    def _read(self, conn) -> None:
        try:
            while conn.poll():
                self._pending.append(conn.recv())
        except Exception:  # noqa: BLE001 - EOF, or a child killed mid-write: channel gone
            self.readers = {w: c for w, c in self.readers.items() if c is not conn}
            with contextlib.suppress(OSError):
                conn.close()

    def notify(self, who: str, notice) -> bool:
        """Send child ``who`` a notice (best effort; False when its channel is gone)."""
        conn = self.readers.get(who)
        if conn is None:
            return False
        try:
            conn.send(notice)
            return True
        except OSError:
            return False

    def close(self) -> None:
        for conn in self.readers.values():
            with contextlib.suppress(OSError):
                conn.close()
        self.readers = {}

    def join_thread(self) -> None:
        """Nothing to wait for; kept for the Queue interface."""


class Launcher:
    """Owns the children and the run's shared memory; :meth:`run` returns the exit code."""

    def __init__(self, cfg: Config, *, progress=None):
        self.cfg = cfg
        self.ctx = mp.get_context("spawn")
        self.events = EventHub(self.ctx)
        self.procs: dict[str, mp.Process] = {}
        #: the first ``error`` event detail of each child, in arrival order
        self.errors: dict[str, str] = {}
        self.stop_signal = 0
        self.shm = None
        self.progress = progress
        self.t0 = time.monotonic()
        self.killed_at = ""     # wall_clock() of the last stop's SIGKILLs
        # --- elastic EP (#23): the store outlives any worker; dead workers are replaced
        self.store = None
        self.generation = 1
        self.restarts = 0

    # --- signals ---------------------------------------------------------------------------
    def _on_signal(self, signum, frame) -> None:
        if not self.stop_signal:
            self.stop_signal = signum

    def install_signals(self) -> None:
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)

    # --- start -----------------------------------------------------------------------------
    @functools.cached_property
    def affinity(self) -> affinity.AffinityPlan:
        """This node's ``--worker_cpu_affinity`` plan (decided once, logged in one line)."""
        plan = affinity.plan(self.cfg.runtime.worker_cpu_affinity, ranks_per_node(self.cfg))
        log.info(event("launcher cpu affinity", note=plan.note))
        return plan

    def _cores(self, who: str) -> tuple[int, ...] | None:
        if who == "engine":
            return self.affinity.engine
        if who.startswith("ep"):
            return self.affinity.workers[int(who[2:]) - node_ranks(self.cfg).start]
        return None

    def _spawn(self, who: str, target, *args) -> None:
        """Start child ``who``; an argument that is ``self.events`` becomes the child's own
        :class:`EventSender` (one pipe per child). An EP worker or the engine starts on its
        pinned cores (the worker also gets them as ``cores=``: it sizes its torch threads to
        them)."""
        sender = self.events.sender(who)
        args = tuple(sender if a is self.events else a for a in args)
        cores = self._cores(who)
        kwargs = {"cores": cores} if target is worker_main else {}
        with _child_env(), affinity.pinned(cores):
            p = self.ctx.Process(target=target, name=who, args=args, kwargs=kwargs,
                                 daemon=False)
            p.start()
        self.events.spawned(sender)
        self.procs[who] = p
        log.debug(event("launcher spawn", proc=who, pid=p.pid))

    def start(self) -> None:
        """Shared memory, then the engine (it binds the port first), then the workers."""
        cfg, me = self.cfg, os.getpid()
        self.shm = RunShm.create(cfg)
        if cfg.runtime.elastic_ep:   # hosted here, not by worker 0: any worker may die
            rt = cfg.runtime
            self.store = host_store(rt.master_addr, rt.master_port,
                                    rt.elastic_join_timeout_seconds)
        self._spawn("engine", engine_main, cfg, self.events, me)
        self._wait_stage("engine", "http_bound")
        for r in range(cfg.eplb.ep_size):
            self._spawn(f"ep{r}", worker_main, cfg, r, self.events, me)
        self._wait_stage("engine", "ready")

    def _wait_stage(self, who: str, stage: str) -> None:
        """Pump events until ``who`` reports ``stage``; a dead child or a signal aborts."""
        self._wait_all({(who, stage)})

    def _wait_all(self, want: set) -> None:
        """Pump events until every ``(who, stage)`` of ``want`` arrived (any order); an error
        event, a dead child or a signal aborts."""
        want = set(want)
        while want:
            ev = self._next_event(0.2)
            if ev:
                want.discard((ev[0], ev[1]))
                if ev[1] == "error":
                    raise StartupError(f"{ev[0]} failed during start-up: {ev[2]}")
            dead = self.dead_child()
            if dead:
                raise StartupError(self.death_message(dead, during="start-up"))
            if self.stop_signal:
                raise KeyboardInterrupt

    def _next_event(self, timeout: float):
        try:
            ev = self.events.get(timeout=timeout)
        except Exception:  # noqa: BLE001 - queue.Empty
            return None
        self._report_stage(*ev)
        return ev

    def _report_stage(self, who: str, stage: str, detail: str) -> None:
        if stage == "error" and detail and who not in self.errors:
            self.errors[who] = detail            # named in the death message
        if stage in ("attached", "kill"):
            self._elastic_event(who, stage, detail)
        if self.progress is not None:
            self.progress.update(who, stage)
        log.debug(event("launcher stage", proc=who, stage=stage, detail=detail,
                        t=round(time.monotonic() - self.t0, 2)))

    # --- supervise -------------------------------------------------------------------------
    def dead_child(self) -> str | None:
        for who, p in self.procs.items():
            if p.exitcode is not None:
                return who
            if not p.is_alive():
                p.join(2.0)
                return who
        return None

    def death_message(self, who: str, during: str = "serving") -> str:
        p = self.procs[who]
        name = f"rank {who[2:]}" if who.startswith("ep") else who
        self._drain_events()
        why = f" ({self.errors[who]})" if who in self.errors else ""
        return (f"{name} (pid {p.pid}) died during {during}: {describe_exit(p.exitcode)}{why}; "
                f"see {Path(self.cfg.serve.log_dir) / log_name(who)} (seen at {wall_clock()})")

    def supervise(self) -> int:
        """Block until a signal (-> 0) or a child's death (-> 1; ``--elastic_ep``: a dead
        worker is replaced instead, up to ``--elastic_max_restarts`` times)."""
        sentinels = {p.sentinel: who for who, p in self.procs.items()}
        while not self.stop_signal:
            ready = mpc.wait(list(sentinels), timeout=0.5)
            self._drain_events()
            if ready and self._replace(sentinels[ready[0]]):
                sentinels = {p.sentinel: who for who, p in self.procs.items()}
                continue
            if ready and not self._stopping_together():
                who = self._first_failed(sentinels[ready[0]])
                self.procs[who].join(2.0)  # reap it: the exit cause names the signal
                self._report_death(who)
                return 1
        log.info(event("launcher stop", signal=signal.Signals(self.stop_signal).name))
        return 0

    # --- elastic EP ------------------------------------------------------------------------
    def _replace(self, who: str) -> bool:
        """``--elastic_ep``: respawn dead worker ``who`` in place for the next generation and
        tell the engine (``("died", who, message, generation, seen_at)``); False when this
        death stops the run (elasticity off, the engine, a stop, restarts used up)."""
        rt = self.cfg.runtime
        if (not rt.elastic_ep or not who.startswith("ep") or self.stop_signal
                or self.procs["engine"].exitcode is not None):
            return False
        p = self.procs[who]
        p.join(2.0)
        # NOTE: exit 0 is the engine's shutdown message reaching the worker: a stop, no death
        if p.exitcode in (None, 0) or self.restarts >= rt.elastic_max_restarts:
            return False
        self.restarts += 1
        self.generation += 1
        msg = self.death_message(who)
        seen = time.time()
        log.warning(event("EPLB elastic detect", proc=who, pid=p.pid,
                          cause=describe_exit(p.exitcode), generation=self.generation,
                          restart=self.restarts, message=msg))
        self.events.notify("engine", ("died", who, msg, self.generation, seen))
        self.errors.pop(who, None)
        self._spawn(who, worker_main, self.cfg, int(who[2:]), self.events, os.getpid(),
                    self.generation)
        return True

    def _elastic_event(self, who: str, stage: str, detail: str) -> None:
        """A replacement attached its rings (-> the engine may send the regroup), or the
        engine asks for a silent worker to be SIGKILLed (a hang becomes a death)."""
        if stage == "attached":
            self.events.notify("engine", ("attached", who, int(detail or 0)))
        elif who == "engine" and detail in self.procs and detail.startswith("ep"):
            p = self.procs[detail]
            log.warning(event("EPLB elastic fence silent worker", proc=detail, pid=p.pid,
                              signal="SIGKILL"))
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)

    def _report_death(self, who: str) -> None:
        """One message, said three times alike: the engine's notice (its clients are told
        which rank died), the launcher log and the console's summary line."""
        msg = self.death_message(who)
        if who != "engine":
            self.events.notify("engine", ("died", who, msg))
        # NOTE: the console gets one summary line (the `error:` below), the file both
        log.error(event("launcher child died", proc=who, pid=self.procs[who].pid,
                        cause=describe_exit(self.procs[who].exitcode), message=msg),
                  extra=FILE_ONLY)
        print(f"error: {msg}", file=sys.stderr, flush=True)

    def _first_failed(self, who: str) -> str:
        """The child that caused the failure: one killed by a signal (it could report nothing;
        the survivors' errors are only its consequence), else the first dead one that reported
        an error (a worker's injected crash names its phase; the engine's fault names the
        rank), else ``who``."""
        self._drain_events()
        dead = {w: p.exitcode for w, p in self.procs.items() if p.exitcode is not None}
        killed = [w for w, code in dead.items() if code < 0]
        if killed:
            return who if who in killed else killed[0]
        # NOTE: a worker that exits 0 after the engine's shutdown message (the engine stops on
        # a fault it found, e.g. a bad frame) is no cause: the reporter still in its teardown is.
        return next((w for w in self.errors if w in dead),
                    next(iter(self.errors), who) if dead.get(who) == 0 else who)

    def _stopping_together(self, grace: float = 0.3) -> bool:
        """True when a stop signal reaches the launcher within ``grace`` s of a child's death.

        NOTE: a SIGTERM sent to the whole process group (``timeout``, systemd, a container
        runtime) reaches the children and the launcher at once; that is a requested stop, not a
        failure.
        """
        end = time.monotonic() + grace
        while not self.stop_signal and time.monotonic() < end:
            time.sleep(0.02)
        return bool(self.stop_signal)

    def _drain_events(self) -> None:
        while self._next_event(0) is not None:
            pass

    # --- stop ------------------------------------------------------------------------------
    def stop(self, graceful: bool) -> list[str]:
        """Stop every child; returns the names of those that had to be killed."""
        timeout = self.cfg.serve.shutdown_timeout_seconds if graceful else min(
            3.0, self.cfg.serve.shutdown_timeout_seconds)
        eng = self.procs.get("engine")
        if eng is not None and eng.exitcode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(eng.pid, signal.SIGTERM)   # engine: graceful stop of the whole run
        if not graceful:
            for who, p in self.procs.items():
                if who != "engine" and p.exitcode is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(p.exitcode is None
                                                  for p in self.procs.values()):
            mpc.wait([p.sentinel for p in self.procs.values() if p.exitcode is None], 0.1)
            self._drain_events()   # NOTE: a child flushing its event queue must not block
            for p in self.procs.values():
                p.join(0)
        killed = [who for who, p in self.procs.items() if p.exitcode is None]
        for who in killed:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.procs[who].pid, signal.SIGKILL)
        self.killed_at = wall_clock()
        for p in self.procs.values():
            p.join(5)
        if killed:
            log.warning(event("launcher killed", procs=",".join(killed), after_s=timeout,
                              signal="SIGKILL", at=self.killed_at,
                              why="did not stop within --shutdown_timeout_seconds"),
                        extra=FILE_ONLY)
        return killed

    def cleanup(self) -> None:
        """Close and sweep the run's shared memory; close the event queue and the store."""
        if self.shm is not None:
            self.shm.close()
        self.store = None
        sweep_run(self.cfg.runtime.run_id)
        with contextlib.suppress(Exception):
            self.events.close()
            self.events.join_thread()


class RunShm:
    """The run's rings, created (and finally unlinked) by the launcher: the input ring
    (engine -> every worker) and one output ring per worker. The engine attaches as producer
    of the input ring and reader of the output rings; workers attach the other ends."""

    def __init__(self, rings: list):
        self.rings = rings

    @classmethod
    def create(cls, cfg: Config, ranks: range | None = None) -> "RunShm":
        """The rings of ``ranks`` (default every EP rank; a node > 0 of a multi-node run: its
        own ranks): an input ring with one reader per rank and one output ring per rank."""
        rt = cfg.runtime
        ranks = range(cfg.eplb.ep_size) if ranks is None else ranks
        rings: list = []
        try:
            rings.append(InputRing.create(rt.run_id, len(ranks), rt.shm_ring_slots,
                                          rt.shm_input_frame_bytes, producer=False))
            for r in ranks:
                # NOTE: output frames carry a body checksum (small frames, ~1 us); the engine
                # reads them strictly, so a corrupt frame fails the step at once.
                rings.append(OutputRing.create(rt.run_id, r, rt.shm_ring_slots,
                                               rt.shm_output_frame_bytes, reader=False,
                                               checksum=True))
        except BaseException as e:
            cls(rings).close()
            if isinstance(e, SegmentBusyError):
                raise StartupError(f"--run_id={rt.run_id}: {e}") from None
            raise
        log.debug(event("launcher shm created", run_id=rt.run_id, rings=len(rings),
                       slots=rt.shm_ring_slots))
        return cls(rings)

    def close(self) -> None:
        for ring in self.rings:
            with contextlib.suppress(Exception):
                ring.close()
        self.rings = []


def log_name(who: str) -> str:
    """Log file of a process: ``engine.log``, ``rank3.log``, ``launcher.log``."""
    return f"rank{who[2:]}.log" if who.startswith("ep") else f"{who}.log"


def _killed(killed: list[str], code: int, cfg: Config, at: str = "") -> int:
    """A stop that had to SIGKILL a child is a failure (exit 1) naming it (``at``: when, the
    same stamp as the launcher log's ``launcher killed`` line)."""
    if not killed:
        return code
    names = ", ".join(f"rank {w[2:]}" if w.startswith("ep") else w for w in killed)
    print(f"error: {names} did not stop within --shutdown_timeout_seconds="
          f"{cfg.serve.shutdown_timeout_seconds:g} and was killed (SIGKILL)"
          + (f" at {at}" if at else ""), file=sys.stderr, flush=True)
    return code or 1


def launcher_process(cfg: Config, title: str, tag: str = "") -> Config:
    """This process as a launcher: the run's own log folder ``<--log_dir>/<time>[-<tag>]/``
    (``<--log_dir>/latest`` points at it; every process of the run logs there: the returned
    config carries it), its log file there (StartupError naming the flag when it cannot be
    written) and its process title."""
    try:
        run_dir = run_log_dir(cfg.serve.log_dir, tag)
        setup_logging("launcher", cfg.serve.v, str(run_dir / "launcher.log"))
    except OSError as e:
        raise StartupError(f"--log_dir={cfg.serve.log_dir}: cannot create or write the log "
                           f"folder ({e})") from None
    with contextlib.suppress(Exception):
        import setproctitle

        setproctitle.setproctitle(title)
    return dataclasses.replace(cfg, serve=dataclasses.replace(cfg.serve, log_dir=str(run_dir)))


def serve(cfg: Config, digest: str = "") -> int:
    """Run until a signal or a failure; returns the process exit code."""
    # NOTE: imported here, not at the top: the checkpoint resolver pulls in torch/safetensors
    from xllm_eplb.model.default_checkpoint import with_default_checkpoint
    from xllm_eplb.model.resolve import resolve_config

    cfg = resolve_config(cfg)  # --model: the checkpoint's architecture fields, before any use
    port = check_serve(cfg)    # every check before anything starts (no --model: the sizes)
    # no --model: generate the default checkpoint once, here, before anything is spawned
    cfg = resolve_runtime(resolve_config(with_default_checkpoint(cfg)), port)
    cfg = launcher_process(cfg, "xllm-eplb:launcher", tag=cfg.runtime.run_id)
    log.info(event("launcher config", run_id=cfg.runtime.run_id, port=cfg.serve.port,
                   master_port=cfg.runtime.master_port) + (" " + digest if digest else ""))
    sweep_dead_at_start()
    progress = Progress(cfg.eplb.ep_size, sys.stderr.isatty())
    return run_launcher(Launcher(cfg, progress=progress), progress, lambda: ready_line(cfg))


def console_notes(cfg: Config, plan: affinity.AffinityPlan) -> list[str]:
    """Lines printed under the ready line that say why a user's request may be slow: the
    synthetic workload sharing the engine, or more processes than cores."""
    out = []
    s = cfg.serve
    if s.workload != "none":
        out.append(f"note: the built-in {s.workload} workload is on ({s.workload_rate:g} req/s "
                   f"of demo traffic share the engine with your requests; --workload=none "
                   f"turns it off)")
    procs, cores = ranks_per_node(cfg) + 1, len(affinity.available_cpus())
    if not plan.pinned and procs > cores:
        out.append(f"note: {procs - 1} workers + the engine share {cores} cores: every step "
                   f"waits for all of them, so a token takes several times longer than on a "
                   f"machine with a core per worker (--ep-size {max(2, cores - 1)} or more cores "
                   f"make requests faster)")
    return out


def sweep_dead_at_start() -> None:
    """Remove the shm objects of dead runs on this machine (a node whose processes were all
    SIGKILLed), with one line saying so; live runs are never touched (``ipc/objects.py``)."""
    removed = sweep_dead_runs()
    if removed:
        log.info(event("shm swept dead runs", runs=",".join(sorted(removed)),
                       objects=sum(removed.values())))


def run_launcher(launcher: Launcher, progress: Progress, ready, start=None) -> int:
    """Start ``launcher`` (``start()``, default ``launcher.start``), print ``ready()``,
    supervise until a signal or a failure, stop and clean up: the exit code (single node and
    every node of a multi-node run)."""
    launcher.install_signals()
    cfg, code = launcher.cfg, 1
    try:
        try:
            (start or launcher.start)()
        finally:
            progress.close()
        print(ready(), flush=True)
        for line in console_notes(cfg, launcher.affinity):
            print(line, flush=True)
        code = launcher.supervise()
        killed = launcher.stop(graceful=(code == 0))
        code = _killed(killed, code, cfg, launcher.killed_at)
    except KeyboardInterrupt:
        code = 0 if launcher.stop_signal else 130
        killed = launcher.stop(graceful=True)
        code = _killed(killed, code, cfg, launcher.killed_at)
    except BaseException:
        launcher.stop(graceful=False)
        raise
    finally:
        launcher.cleanup()
    return code
