"""The launcher's side of elastic EP (``--elastic_ep``): :class:`ElasticSupervisor`, a component
the launcher owns. On a worker's death it decides how the worker is replaced (up to
``--elastic_max_restarts``; the mode travels in the engine's
:class:`~xllm_eplb.elastic.notices.WorkerDied`), see :func:`replacement_mode`:

    rejoin   the N-1 survivors can hold every expert (the redundancy rule): they shrink at once
             (``elastic/recovery.py``); a replacement starts in the background, loads and
             signals ``join_ready``; the engine grows back at a step boundary. One not ready
             within ``--elastic_join_timeout_seconds`` is SIGKILLed and dropped: N-1 keep serving
    respawn  the rule fails for N-1, or ``--elastic_rejoin=false``, or several nodes: the worker
             is respawned in place (only at full size); the service waits for it
    shrink   ``--elastic_restart=false``, or the restarts used up: it is left out

A serving rank's death while joiners load drops them (SIGKILL); in rejoin mode each dropped
joiner is started again once reaped, a restart apiece while restarts remain. A joiner that dies
by itself is started again too; one dropped for the timeout is not. The supervisor also
SIGKILLs a worker the engine (or, on node n, its relay) found silent
(``--elastic_silence_seconds``): a hang becomes a death.

Per worker the supervisor knows one state (:class:`WorkerState`), changed only by
:meth:`ElasticSupervisor._to` along :data:`WORKER_TRANSITIONS`::

    serving --respawn--> serving          serving --left out--> retired --rejoin--> joining
    joining --join_ready--> ready --joined--> serving
    joining | ready --timeout, a serving death--> dropped --reaped--> retired
    joining | ready --died--> retired     (then joining again while restarts remain)

The launcher owns the process table: the supervisor reads a worker's process and asks for every
change through :class:`~xllm_eplb.elastic.ports.LauncherPort` (``spawn_worker``, ``retire``,
``clear_error``, ``notify_engine``, ...). Explicit parameters say what differs per launcher:
``respawn_only`` and ``remote_ranks`` (a node of a multi-node run: respawn in place or stop; the
other nodes' ranks all serve) and ``node`` (logged).
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import signal
import time

from xllm_eplb.config import elastic_redundancy_needed, survivors_hold_all
from xllm_eplb.elastic.notices import JoinDropped, JoinReady, WorkerDied
from xllm_eplb.elastic.ports import LauncherPort
from xllm_eplb.elastic.protocol import Mode, next_pg_generation
from xllm_eplb.obs.logs import event

log = logging.getLogger(__name__)


class WorkerState(enum.Enum):
    SERVING = "serving"
    RETIRED = "retired"      # exited and forgotten (left out, or a joiner gone)
    JOINING = "joining"      # a rejoin replacement loading
    READY = "ready"          # loaded (``join_ready``), waiting for the engine's switch
    DROPPED = "dropped"      # SIGKILLed by the supervisor, not reaped yet


W = WorkerState
#: the only worker-state changes :meth:`ElasticSupervisor._to` allows
WORKER_TRANSITIONS = {
    W.SERVING: {W.SERVING, W.RETIRED},
    W.RETIRED: {W.JOINING},
    W.JOINING: {W.READY, W.DROPPED, W.RETIRED},
    W.READY: {W.SERVING, W.DROPPED, W.RETIRED},
    W.DROPPED: {W.RETIRED},
}


def rule_holds(cfg, size: int) -> bool:
    """Can ``size`` - 1 ranks hold every expert (the shrink / rejoin redundancy rule)?"""
    return survivors_hold_all(size, cfg.slots_per_rank, cfg.model.num_experts)


def replacement_mode(cfg, serving: int, restarts: int) -> tuple[Mode, str]:
    """How a serving worker's death is handled now, and why: ``rejoin``, ``respawn`` or
    ``shrink`` (``stop``: the run stops, a respawn being impossible across nodes)."""
    rt, N = cfg.runtime, cfg.eplb.ep_size
    if not (rt.elastic_restart and restarts < rt.elastic_max_restarts):
        why = ("--elastic_restart=false" if not rt.elastic_restart
               else f"--elastic_max_restarts={rt.elastic_max_restarts} used up")
        if rt.nnodes > 1:
            return Mode.STOP, f"{why}; a shrink would cross nodes"
        return Mode.SHRINK, f"{why}: the survivors go on without it"
    if rt.nnodes > 1:
        return Mode.RESPAWN, f"--nnodes={rt.nnodes}: a rank set cannot change across nodes"
    if rt.elastic_rejoin and rule_holds(cfg, serving):
        return Mode.REJOIN, (f"the other {serving - 1} ranks hold every expert: they serve while "
                          "a replacement loads")
    if serving != N:
        return Mode.SHRINK, "a shrunk world cannot respawn in place"
    if not rt.elastic_rejoin:
        return Mode.RESPAWN, "--elastic_rejoin=false"
    if N == 1:
        return Mode.RESPAWN, "--ep_size=1: no other rank serves meanwhile"
    return Mode.RESPAWN, (f"{N - 1} ranks x {cfg.slots_per_rank} slots cannot hold "
                       f"{cfg.model.num_experts} experts (rejoin needs "
                       f"--redundant_experts_num >= "
                       f"{elastic_redundancy_needed(cfg.model.num_experts, N)}): the service waits for "
                       "the replacement")


class ElasticSupervisor:
    """The launcher's ``--elastic_ep`` part: replacement, joiners, fencing (see above)."""

    def __init__(self, cfg, store, launcher: LauncherPort, *, respawn_only: bool = False,
                 remote_ranks: int = 0, node: int | None = None):
        self.cfg, self.store, self.launcher = cfg, store, launcher
        self.respawn_only, self.remote_ranks = respawn_only, remote_ranks
        self.where = {"node": node} if node is not None else {}     # logged on every line
        self.pg_generation = 1
        self.restarts = 0
        self.joining: dict[str, dict] = {}         # rejoin: replacements loading / switching
        self.dropped: set[str] = set()             # joiners SIGKILLed, not yet reaped
        self.rejoin_after: dict[str, str] = {}     # dropped joiners to start again: why
        self.states: dict[str, WorkerState] = {}   # a worker not listed is serving
        self.illegal = 0                           # transitions outside the table (logged)

    def _to(self, who: str, state: WorkerState) -> None:
        """The one change of a worker's state; one outside :data:`WORKER_TRANSITIONS` is
        logged (the launcher keeps supervising) and counted."""
        was = self.states.get(who, W.SERVING)
        if state not in WORKER_TRANSITIONS[was]:
            self.illegal += 1
            log.error(event("EPLB elastic worker state", proc=who, frm=was.value,
                            to=state.value, legal="no"))
        self.states[who] = state

    def serving(self) -> int:
        """EP ranks serving now (joiners not counted; the other nodes' all serve)."""
        return self.remote_ranks + sum(1 for w in self.launcher.worker_names()
                                       if w not in self.joining and w not in self.dropped)

    def joiners(self) -> list[str]:
        """Workers not on the input ring (killed outright at a stop)."""
        return list(self.joining) + list(self.dropped)

    def replace(self, who: str) -> bool:
        """Replace dead worker ``who``. Tells the engine :class:`WorkerDied`; False when this
        death stops the run (not a worker, a stop, the engine gone, a clean exit, or a node of
        a multi-node run out of restarts)."""
        rt = self.cfg.runtime
        la = self.launcher
        if not who.startswith("ep") or la.stop_requested() or la.engine_gone():
            return False
        if self.respawn_only and self.restarts >= rt.elastic_max_restarts:
            return False
        p = la.worker_proc(who)
        p.join(2.0)
        if who in self.joining or who in self.dropped:
            return self._joiner_gone(who)
        # NOTE: exit 0 is the engine's shutdown message reaching the worker: a stop, no death
        if p.exitcode in (None, 0):
            return False
        size = self.serving()
        mode, why = replacement_mode(self.cfg, size, self.restarts)
        if mode is Mode.STOP:
            return False
        self.restarts += mode is not Mode.SHRINK
        # the joiners loading are dropped; in rejoin mode each is started again once reaped
        self._drop_joiners(f"serving worker {who} died", restart=mode is Mode.REJOIN)
        self.pg_generation = next_pg_generation(self.store)
        msg = la.replaced_message(who)
        seen = time.time()
        log.warning(event("EPLB elastic detect", proc=who, pid=p.pid, **self.where,
                          exitcode=p.exitcode, mode=mode.value, why=why,
                          pg_generation=self.pg_generation, restart=self.restarts,
                          message=msg))
        la.notify_engine(WorkerDied(int(who[2:]), msg, self.pg_generation, seen, mode))
        la.clear_error(who)
        if mode is Mode.RESPAWN:
            self._to(who, W.SERVING)
            la.spawn_worker(who, self.pg_generation, False)
            return True
        self._retire(who)                       # the survivors go on without it
        if mode is Mode.REJOIN:  # the replacement loads in the background, then joins
            self._start_joiner(who)
            log.warning(event("EPLB elastic rejoin start", proc=who,
                              pid=la.worker_proc(who).pid, ep_size=f"{size - 1}->{size}",
                              timeout_s=rt.elastic_join_timeout_seconds))
        return True

    def _retire(self, who: str) -> None:
        """Forget exited worker ``who`` (the launcher closes its ``Process``)."""
        self.launcher.retire(who)
        self._to(who, W.RETIRED)

    def _joiner_gone(self, who: str) -> bool:
        """A joiner exited: dropped (reaped here; one dropped for a serving rank's death in
        rejoin mode starts again), or it died (another starts, restarts permitting; the engine
        keeps waiting for ``join_ready``; one that died after it is dropped by the engine
        first). Without restarts left the engine is told ``JoinDropped``: N-1 keep serving."""
        info = self.joining.pop(who, None)
        msg = "" if who in self.dropped else self.launcher.replaced_message(who,
                                                                            during="its rejoin")
        self._retire(who)
        if who in self.dropped:
            self.dropped.discard(who)
            why = self.rejoin_after.pop(who, None)
            if why is not None:
                self._restart_dropped(who, why)
            return True
        rt = self.cfg.runtime
        if (info is not None and rt.elastic_restart
                and self.restarts < rt.elastic_max_restarts):
            if info["ready"]:    # the engine has its join_ready: it drops it, keeps waiting
                self.launcher.notify_engine(JoinDropped(int(who[2:]), msg, True))
            self.restarts += 1
            self._start_joiner(who)
            log.warning(event("EPLB elastic rejoin restart", proc=who, why=msg,
                              pid=self.launcher.worker_proc(who).pid, restart=self.restarts))
            return True
        self.launcher.notify_engine(JoinDropped(int(who[2:]), msg))
        log.warning(event("EPLB elastic rejoin dropped", proc=who, why=msg,
                          serving=self.serving()))
        return True

    def _start_joiner(self, who: str) -> None:
        self._to(who, W.JOINING)
        self.launcher.spawn_worker(who, 0, True)
        self.joining[who] = {"t0": time.monotonic(), "wall": time.time(), "ready": False}

    def _restart_dropped(self, who: str, why: str) -> None:
        """Start a new joiner for ``who``, reaped after :meth:`_drop_joiners` dropped it for a
        serving rank's death (its restart was counted then; the engine kept it joining)."""
        if self.launcher.stop_requested() or self.launcher.engine_gone():
            return
        if not rule_holds(self.cfg, self.serving() + 1):   # the engine's shrink stops the run
            self.launcher.notify_engine(JoinDropped(int(who[2:]), why))
            return
        self._start_joiner(who)
        log.warning(event("EPLB elastic rejoin restart", proc=who,
                          why=f"dropped: {why}", pid=self.launcher.worker_proc(who).pid,
                          restart=self.restarts, serving=self.serving()))

    def _kill(self, who: str) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.launcher.worker_proc(who).pid, signal.SIGKILL)

    def _drop_joiners(self, why: str, restart: bool = False) -> None:
        """SIGKILL every joiner (a serving rank died); the engine is told. ``restart``: each
        is started again once reaped, while restarts remain (counted here)."""
        rt = self.cfg.runtime
        for who in list(self.joining):
            info = self.joining.pop(who)
            self.dropped.add(who)
            self._to(who, W.DROPPED)
            again = restart and self.restarts < rt.elastic_max_restarts
            if again:
                self.restarts += 1
                self.rejoin_after[who] = why
            self._kill(who)
            self.launcher.notify_engine(JoinDropped(int(who[2:]), why, again))
            log.warning(event("EPLB elastic rejoin dropped", proc=who, why=why,
                              after_s=round(time.monotonic() - info["t0"], 3),
                              serving=self.serving() - 1,      # the dead one not yet retired
                              restart="yes" if again else "no"))

    def check_joiners(self) -> None:
        """A joiner not ready within ``--elastic_join_timeout_seconds`` is dropped."""
        limit = self.cfg.runtime.elastic_join_timeout_seconds
        late = [w for w, i in self.joining.items()
                if not i["ready"] and time.monotonic() - i["t0"] > limit]
        for who in late:
            info = self.joining.pop(who)
            self.dropped.add(who)
            self._to(who, W.DROPPED)
            self._kill(who)
            self.launcher.notify_engine(JoinDropped(int(who[2:]), "timeout"))
            log.warning(event("EPLB elastic rejoin dropped", proc=who,
                              why=f"not ready within --elastic_join_timeout_seconds={limit:g}",
                              after_s=round(time.monotonic() - info["t0"], 3),
                              serving=self.serving(), pg_generation="unchanged"))

    def on_event(self, who: str, stage: str, detail: str) -> None:
        """A joiner is loaded (``join_ready``) or joined; or the engine (node n: its relay)
        asks for a silent worker to be SIGKILLed (a hang becomes a death). (A replacement's
        ``attached`` goes to the engine through the store: ``elastic/protocol.py``.)"""
        if stage == "join_ready" and who in self.joining:
            info = self.joining[who]
            ready_at, pid = detail.split(",")
            if int(pid) != self.launcher.worker_proc(who).pid:   # a dropped predecessor's late event
                return
            info["ready"] = True
            self._to(who, W.READY)
            self.launcher.notify_engine(JoinReady(int(who[2:]), info["wall"], float(ready_at),
                                                   int(pid)))
        elif stage == "joined":
            if self.joining.pop(who, None) is not None:
                self._to(who, W.SERVING)
        elif stage == "kill" and detail.startswith("ep"):
            p = self.launcher.worker_proc(detail)
            if p is None or p.exitcode is not None:
                return
            log.warning(event("EPLB elastic fence silent worker", proc=detail, pid=p.pid,
                              **self.where, signal="SIGKILL"))
            self._kill(detail)
