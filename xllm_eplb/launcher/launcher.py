"""The :class:`Launcher`: owns the run's children (the engine, one worker per EP rank) and its
shared memory; spawns them on their pinned cores, pumps their start-up events, supervises (a
dead child stops the run, naming it; ``--elastic_ep``: its
:class:`~xllm_eplb.elastic.supervisor.ElasticSupervisor` replaces it) and stops them.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import signal
import sys
import time
from pathlib import Path

from xllm_eplb.child import spawn_ignoring_sigint
from xllm_eplb.config import Config, node_ranks, ranks_per_node
from xllm_eplb.elastic.notices import WorkerDied
from xllm_eplb.elastic.protocol import next_pg_generation
from xllm_eplb.elastic.supervisor import ElasticSupervisor, replacement_mode
from xllm_eplb.engine.process import engine_main
from xllm_eplb.ipc.objects import sweep_run
from xllm_eplb.ipc.store import host_store
from xllm_eplb.launcher.events import EventHub
from xllm_eplb.launcher.exits import describe_exit, log_name, peer_gone, wall_clock
from xllm_eplb.launcher.rings import RunShm
from xllm_eplb.obs.logs import FILE_ONLY, event
from xllm_eplb.preflight import StartupError
from xllm_eplb.worker import affinity
from xllm_eplb.worker.transport import uses_shm
from xllm_eplb.worker.worker import worker_main

log = logging.getLogger(__name__)

#: environment of every child (one intra-op thread per rank; 2 cores serve 17 processes)
CHILD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
             "TORCH_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
#: how long the launcher waits for the cause of a failure when the exits seen so far are only
#: survivors whose peer went away (seconds; ``_first_failed``)
CAUSE_WAIT = 1.0


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


class Launcher:
    """Owns the children and the run's shared memory; :meth:`run` returns the exit code."""

    #: ``--elastic_ep``: the supervision component (None: a death stops the run)
    elastic: ElasticSupervisor | None = None

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
        plan = affinity.plan(self.cfg.runtime.worker_cpu_affinity, ranks_per_node(self.cfg),
                             shm=uses_shm(self.cfg, self.cfg.eplb.ep_size))
        log.info(event("launcher cpu affinity", note=plan.note))
        return plan

    def _cores(self, who: str) -> tuple[int, ...] | None:
        if who == "engine":
            return self.affinity.engine
        if who.startswith("ep"):
            return self.affinity.workers[int(who[2:]) - node_ranks(self.cfg).start]
        return None

    def _spawn(self, who: str, target, *args, **extra) -> None:
        """Start child ``who``; an argument that is ``self.events`` becomes the child's own
        :class:`EventSender` (one pipe per child). An EP worker or the engine starts on its
        pinned cores (the worker also gets them as ``cores=``: it sizes its torch threads to
        them)."""
        sender = self.events.sender(who)
        args = tuple(sender if a is self.events else a for a in args)
        cores = self._cores(who)
        kwargs = {"cores": cores, **extra} if target is worker_main else {}
        with _child_env(), affinity.pinned(cores), spawn_ignoring_sigint():
            p = self.ctx.Process(target=target, name=who, args=args, kwargs=kwargs,
                                 daemon=False)
            p.start()
        self.events.spawned(sender)
        self.procs[who] = p
        log.debug(event("launcher spawn", proc=who, pid=p.pid))

    def spawn_worker(self, who: str, pg_generation: int = 0, join: bool = False) -> None:
        """Worker ``who`` (``ep<w>``); elastic EP: a replacement joining ``pg_generation``, or
        a rejoin replacement (``join``) that loads first."""
        extra = {"join": True} if join else {}
        self._spawn(who, worker_main, self.cfg, int(who[2:]), self.events, os.getpid(),
                    pg_generation, **extra)

    def _host_store(self):
        """The run's TCPStore at ``--master_addr:--master_port``, hosted by the launcher (not
        by worker 0: any worker may die); membership generation 1 drawn."""
        rt = self.cfg.runtime
        store = host_store(rt.master_addr, rt.master_port, rt.elastic_join_timeout_seconds)
        next_pg_generation(store)
        return store

    def _supervisor(self, **policy) -> ElasticSupervisor:
        """``--elastic_ep``: the supervision component; says which mode a death gets, and why."""
        mode, why = replacement_mode(self.cfg, self.cfg.eplb.ep_size, 0)
        log.info(event("EPLB elastic on", on_worker_death=mode.value, why=why,
                       off="--elastic_ep=false"))
        return ElasticSupervisor(self.cfg, self.store, self, **policy)

    # --- the supervisor's port (``elastic/ports.py`` ``LauncherPort``): the table stays here --
    def engine_gone(self) -> bool:
        return self.procs["engine"].exitcode is not None

    def worker_proc(self, who: str):
        return self.procs.get(who)

    def worker_names(self) -> list[str]:
        return [w for w in self.procs if w.startswith("ep")]

    def retire(self, who: str) -> None:
        """Forget exited worker ``who``: its ``Process`` is closed, which frees its sentinel fd
        (a kept one leaked an fd per kill: a 10-minute chaos soak grew 186 -> 202)."""
        p = self.procs.pop(who)
        with contextlib.suppress(ValueError):       # not reaped yet: the finalizer frees it
            p.close()

    def clear_error(self, who: str) -> None:
        self.errors.pop(who, None)

    def replaced_message(self, who: str, during: str = "serving") -> str:
        return self.death_message(who, during)

    def stop_requested(self) -> bool:
        return bool(self.stop_signal)

    def notify_engine(self, notice) -> bool:
        return self.events.notify("engine", notice)

    def start(self) -> None:
        """Shared memory, then the engine (it binds the port first), then the workers."""
        cfg, me = self.cfg, os.getpid()
        self.shm = RunShm.create(cfg)
        if cfg.runtime.elastic_ep:
            self.store = self._host_store()
            self.elastic = self._supervisor()
        self._spawn("engine", engine_main, cfg, self.events, me)
        self._wait_stage("engine", "http_bound")
        for r in range(cfg.eplb.ep_size):
            if self.stop_signal:          # no more workers once a stop was requested
                raise KeyboardInterrupt
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
            if self.stop_signal:
                raise KeyboardInterrupt
            ev = self._next_event(0.2)
            if ev:
                want.discard((ev[0], ev[1]))
                if ev[1] == "error" and not self._stopping_together(0.1):
                    raise StartupError(f"{ev[0]} failed during start-up: {ev[2]}")
            dead = self.dead_child()
            # NOTE: a signal to the whole group may end a child before the launcher's handler
            # ran: that is the requested stop, not a death
            if dead and not self._stopping_together():
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
        if self.elastic is not None and stage in ("kill", "join_ready", "joined"):
            self.elastic.on_event(who, stage, detail)
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
            if self.elastic is not None and self.elastic.joining:
                self.elastic.check_joiners()
            if ready and self.elastic is not None and self.elastic.replace(sentinels[ready[0]]):
                sentinels = {p.sentinel: who for who, p in self.procs.items()}
                continue
            if ready and not self._stopping_together():
                who = self._first_failed(sentinels[ready[0]])
                self.procs[who].join(2.0)  # reap it: the exit cause names the signal
                self._report_death(who)
                return 1
        log.info(event("launcher stop", signal=signal.Signals(self.stop_signal).name))
        return 0

    def _report_death(self, who: str) -> None:
        """One message, said three times alike: the engine's notice (its clients are told
        which rank died), the launcher log and the console's summary line."""
        msg = self.death_message(who)
        if who.startswith("ep"):
            self.events.notify("engine", WorkerDied(int(who[2:]), msg))
        # NOTE: the console gets one summary line (the `error:` below), the file both
        log.error(event("launcher child died", proc=who, pid=self.procs[who].pid,
                        cause=describe_exit(self.procs[who].exitcode), message=msg),
                  extra=FILE_ONLY)
        print(f"error: {msg}", file=sys.stderr, flush=True)

    def _first_failed(self, who: str) -> str:
        """The child that caused the failure: one killed by a signal (it could report nothing;
        the survivors' errors are only its consequence), else the first dead one that reported
        an error other than a lost peer (a worker's injected crash names its phase; the
        engine's fault names the rank), else ``who``.

        NOTE: when the exits seen so far are all survivors whose collective failed ("Connection
        reset by peer"), the cause may not be reaped yet (two exits ms apart, read in either
        order): wait up to ``CAUSE_WAIT`` s for it.
        """
        deadline = time.monotonic() + CAUSE_WAIT
        while True:
            self._drain_events()
            dead = {w: p.exitcode for w, p in self.procs.items() if p.exitcode is not None}
            killed = [w for w, code in dead.items() if code < 0]
            if killed:
                return who if who in killed else killed[0]
            causes = [w for w in self.errors if w in dead and not peer_gone(self.errors[w])]
            if causes or time.monotonic() >= deadline or len(dead) == len(self.procs):
                break
            time.sleep(0.05)
        if causes:
            return causes[0]
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
        for who in self.elastic.joiners() if self.elastic else []:   # not on the input ring
            with contextlib.suppress(ProcessLookupError, KeyError):
                os.kill(self.procs[who].pid, signal.SIGKILL)
        eng = self.procs.get("engine")
        if eng is not None and eng.exitcode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(eng.pid, signal.SIGTERM)   # engine: graceful stop of the whole run
        if not graceful:
            for who, p in self.procs.items():
                if who != "engine" and p.exitcode is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(p.pid, signal.SIGTERM)
        return self._reap(timeout)

    def stop_startup(self) -> list[str]:
        """Stop a run that is not serving yet (a signal during start-up): every child gets
        SIGTERM at once. A worker has no SIGTERM handler (it dies of it at once, importing or
        loading, without a traceback); the engine leaves its start-up cleanly (``early`` in
        ``engine/process.py``). Whatever is left after ``--shutdown_timeout_seconds`` is
        killed; returns the names of those."""
        for p in self.procs.values():
            if p.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGTERM)
        return self._reap(self.cfg.serve.shutdown_timeout_seconds)

    def _reap(self, timeout: float) -> list[str]:
        """Wait up to ``timeout`` s for every child to exit, then SIGKILL the rest; returns
        the names of the killed ones (logged once, in the launcher log)."""
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

