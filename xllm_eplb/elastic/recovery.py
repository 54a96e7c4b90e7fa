"""The engine's side of elastic EP (``--elastic_ep``): one state machine, :class:`EngineRecovery`.

Phases (:class:`Phase`) and the only transitions allowed (:data:`TRANSITIONS`; every change goes
through :meth:`EngineRecovery._to`, which logs it and shows it in ``/health``)::

    serving --death--> detect --> fence --> reform --> resume --> serving
    serving --join_ready--> join --> switch --> serving            (a rejoin grows)
                              \\--------\\--> abandon --> serving | detect   (a death meanwhile)
    any phase but serving --unrecoverable--> stopped  (WorkerFault: the run stops)

One death (respawn: the launcher replaces the worker in place):

1. detect: a step fails (a survivor's ``peer_lost``, a closed ring, or the launcher's
   :class:`~xllm_eplb.elastic.notices.WorkerDied` while waiting); the notice names the worker,
   the new membership generation ``g`` and the mode;
2. fence: the survivors' outputs of the step are read and dropped (no token of it is
   committed), an EPLB round in flight is aborted, ``Engine.void_step`` requeues the dead
   rank's requests for re-prefill and cuts the survivors' KV back to the committed length;
3. reform: members + placement of ``g`` published (``elastic/protocol.py``), the replacement's
   ``attached`` key awaited (``protocol.await_attached``), then the one regroup step and every
   rank's answer; a shrink (mode ``shrink``/``rejoin``) re-plans the experts
   (``membership_plan.plan_shrink``) and calls ``Engine.resize(workers, placement)`` first;
4. resume: the counters and ``last_recovery``; the next step is ordinary.

A rejoin (mode ``rejoin``) is a shrink now and a grow later: at a step boundary a ready joiner
is let in (``membership_plan.plan_join``; go key, joiner's ``joined`` key, ``Engine.resize``
to N, regroup step, the members' vote: ``elastic/protocol.py``). A death during the switch abandons
it (the vote's ``abort``; ``Engine.resize`` back to N-1) and is then recovered as above.
What stops the run instead: a notice that is not an elastic death, an EPLB activation only some
ranks switched, a second death while re-forming, a shrink the redundancy rule refuses, the
joiner alone lost after every member voted go, or ``--elastic_join_timeout_seconds``.

The engine is reached through a typed port, :class:`~xllm_eplb.elastic.ports.EnginePort`
(``elastic/ports.py``: what ``engine/engine.py``'s ``Engine`` offers); the tests drive this
class with a fake one (tests/test_elastic_recovery.py) and check both against the port
(tests/test_elastic_ports.py). The counters and last records are
:class:`~xllm_eplb.elastic.counters.RecoveryCounters`.
"""

from __future__ import annotations

import enum
import logging
import time

from xllm_eplb.elastic import protocol
from xllm_eplb.elastic.counters import RecoveryCounters
from xllm_eplb.elastic.notices import JoinDropped, JoinReady, NoticeBox, SilenceFence, WorkerDied
from xllm_eplb.elastic.ports import EnginePort
from xllm_eplb.elastic.protocol import (
    ELASTIC_IDLE_WAIT,
    FENCE_MIN_S,
    NOTICE_WAIT,
    Mode,
    next_pg_generation,
)
from xllm_eplb.eplb.membership_plan import JoinError, ShrinkError, plan_join, plan_shrink
from xllm_eplb.errors import WorkerFault
from xllm_eplb.ipc.errors import IpcError, RingTimeoutError
from xllm_eplb.obs.logs import event

log = logging.getLogger(__name__)


class Phase(enum.Enum):
    SERVING = "serving"
    DETECT = "detect"
    FENCE = "fence"
    REFORM = "reform"
    RESUME = "resume"
    JOIN = "join"
    SWITCH = "switch"
    ABANDON = "abandon"
    STOPPED = "stopped"


P = Phase
#: the only phase changes :meth:`EngineRecovery._to` allows
TRANSITIONS = {
    P.SERVING: {P.DETECT, P.JOIN},
    P.DETECT: {P.FENCE, P.STOPPED},
    P.FENCE: {P.REFORM, P.STOPPED},
    P.REFORM: {P.RESUME, P.STOPPED},
    P.RESUME: {P.SERVING},
    P.JOIN: {P.SWITCH, P.ABANDON, P.SERVING, P.STOPPED},
    P.SWITCH: {P.SERVING, P.ABANDON, P.STOPPED},
    P.ABANDON: {P.SERVING, P.DETECT, P.STOPPED},
    P.STOPPED: set(),
}


class SwitchLost(Exception):
    """A death during a rejoin's switch (a serving rank's, or the joiner's)."""


class EngineRecovery:
    """Membership (members, membership generation), the recovery state machine and its
    counters (``/eplb/status`` ``membership``). ``engine``: the port above; ``box``: the
    launcher's notices; ``store``: the run's store client; ``metrics``: ``EngineMetrics``;
    ``on_cpu(seconds)``: elasticity's steady-state CPU (``Telemetry.on_elastic``);
    ``kill(worker)``: asks the launcher to SIGKILL a silent worker."""

    def __init__(self, engine: EnginePort, box: NoticeBox, store, *, num_experts: int,
                 slots: int, num_layers: int, silence_s: float, join_timeout_s: float, metrics,
                 on_cpu=None, kill=None):
        self.eng, self.box, self.store, self.m = engine, box, store, metrics
        self.E, self.S, self.L = num_experts, slots, num_layers
        self.silence, self.join_timeout = silence_s, join_timeout_s
        self.on_cpu = on_cpu or (lambda seconds, idle=False: None)
        self.fence = SilenceFence(silence_s, kill)
        self.phase, self.phase_since, self.visited = P.SERVING, time.monotonic(), []
        self.pg_generation = 1
        #: the worker of each EP rank (compact ranks; a shrink drops the dead one)
        self.workers = list(range(engine.ep_size))
        self.initial = engine.active_placement.copy()     # what a joiner loads
        self.joining: dict[int, float] = {}     # worker -> wall time of its death
        self.counts = RecoveryCounters()

    # --- the one transition function --------------------------------------------------------
    def _to(self, phase: Phase, **why) -> None:
        if phase not in TRANSITIONS[self.phase]:
            raise RuntimeError(f"elastic recovery: no transition {self.phase.value} -> "
                               f"{phase.value}")
        log.debug(event("EPLB elastic phase", frm=self.phase.value, to=phase.value, **why))
        self.phase, self.phase_since = phase, time.monotonic()
        self.visited.append(phase)

    def _stop(self, fault: BaseException):
        """Unrecoverable: the run stops as without elasticity."""
        if self.phase is not P.STOPPED:
            self._to(P.STOPPED, why=str(fault)[:200])
        raise fault

    def health(self) -> dict | None:
        """None while serving normally; else what ``/health`` shows (a fence or recovery)."""
        if self.phase is P.SERVING and not self.fence.active:
            return None
        fence = self.phase is P.SERVING
        # NOTE: the fence is no transition of the state machine: its clock starts at the fence,
        # not at the last transition (it read 14 s less than a second into the fence)
        since = self.fence.at if fence else self.phase_since
        return {"status": "recovering", "phase": "fence" if fence else self.phase.value,
                "phase_seconds": round(time.monotonic() - since, 3)}

    def status(self) -> dict:
        D = self.eng.ep_size
        return {"elastic": True, "pg_generation": self.pg_generation,
                "generation": self.pg_generation,      # deprecated alias (one release)
                "phase": self.phase.value, "ep_size": D, "ranks_active": list(range(D)),
                "workers": list(self.workers),
                "joining": sorted(f"ep{w}" for w in self.joining), **self.counts.status()}

    # --- between slices, at boundaries, idle (the loop's points: engine/membership.py) -------
    idle_wait = ELASTIC_IDLE_WAIT

    def quiet(self) -> bool:
        """May the next step be planned while one runs (``--async_scheduling``)? Not while a
        joiner is on its way (it joins at a boundary) or a fence waits to be lifted."""
        return not self.fence.active and not self.joining

    def idle_cpu(self, seconds: float) -> None:
        """An idle pass's thread CPU (it wakes every ``ELASTIC_IDLE_WAIT`` s for elasticity)."""
        self.on_cpu(seconds, idle=True)

    def between_slices(self, step: int, silent_for: float, unread) -> None:
        """While a step waits: workers that have not read its input for
        ``--elastic_silence_seconds`` (``unread()``) are SIGKILLed by the launcher, once per
        step (a hang becomes a death, recovered as one); the check's CPU is accounted."""
        c0 = time.thread_time()
        self.fence.check(step, silent_for, unread)
        self.on_cpu(time.thread_time() - c0)

    def at_boundary(self) -> None:
        """Between steps: a dropped joiner is forgotten (N-1 keep serving) unless the launcher
        starts it again; a ready one joins now, one at a time; a ``JoinReady`` followed by that
        joiner's drop in the same batch is stale. Its CPU is accounted."""
        c0 = time.thread_time()
        self.fence.passed(self.eng.step_no)
        if self.joining:
            self._boundary_joins()
        self.on_cpu(time.thread_time() - c0)

    def when_idle(self) -> None:
        """No step runs: a join may switch now, and a death notice meets the dead rank through
        an empty step (which recovers, or stops the run) instead of the next request's."""
        if self.joining:
            self._boundary_joins()
        if self.box.poll(0.0):
            self.eng.idle_step()

    def _boundary_joins(self) -> None:
        self.box.drain()
        notices = self.box.take_joins()
        for i, n in enumerate(notices):
            if isinstance(n, JoinDropped):
                if n.worker in self.joining:
                    self.counts.join_dropped()
                    self.m.rejoins.labels("dropped").inc()
                    if not n.restart:    # restart: the launcher starts it again, still joining
                        del self.joining[n.worker]
                continue
            if n.worker not in self.joining or self.box.died is not None or any(
                    isinstance(m, JoinDropped) and m.worker == n.worker
                    for m in notices[i + 1:]):
                continue        # a death first: the next step recovers (the launcher drops it)
            got = self.join(n)
            if not got:
                continue
            self.joining.pop(n.worker)
            self.counts.joined(got)
            self.m.rejoins.labels("joined").inc()
            self.m.rejoin_seconds.observe(got["start_to_serving_s"])
            log.warning(event("EPLB elastic rejoin", **got))

    # --- a death: detect -> fence -> reform -> resume ---------------------------------------
    def recover(self, fault: WorkerFault, got: dict) -> None:
        """Recover from the death behind ``fault`` (``got``: the failed step's outputs read so
        far, by rank) or raise a :class:`WorkerFault` (the run stops)."""
        eng, box = self.eng, self.box
        t0 = time.monotonic()
        self._to(P.DETECT)
        box.wait_death(0.0 if eng.stopping else NOTICE_WAIT)    # a stop: no recovery
        d = box.died
        if not isinstance(d, WorkerDied) or not d.mode:
            self._stop(fault)
        mode = Mode(d.mode)
        box.clear_death()                  # from here on, a death notice is a second death
        if d.worker not in self.workers:
            self._stop(fault)
        rank, step, g = self.workers.index(d.worker), eng.step_no, d.pg_generation
        log.warning(event("EPLB elastic detect", rank=rank, worker=f"ep{d.worker}", step=step,
                          pg_generation=g, mode=mode.value,
                          detect_s=round(time.time() - d.seen_at, 3), cause=d.message))
        self.m.rank_active.labels(str(rank)).set(0)
        self._to(P.FENCE)
        self._fence(rank, step, got)
        if not eng.abort_eplb_round(self._switched(rank, got)):
            self._stop(WorkerFault(f"{d.message}; an EPLB layer activation was in flight and "
                                   "only some ranks switched it: the run stops"))
        back, kept = eng.void_step(rank)
        t_fence = time.monotonic()
        log.info(event("EPLB elastic fence", step=step, requests_reprefilled=back,
                       requests_kept=kept, seconds=round(t_fence - t0, 3)))
        self._to(P.REFORM)
        extra = {}
        if mode in (Mode.SHRINK, Mode.REJOIN):
            extra = self._shrink(rank, g)
            if mode is Mode.REJOIN:
                self.joining[d.worker] = d.seen_at
        else:
            self._respawn(rank, g)
        log.info(event("EPLB elastic re-form", pg_generation=g, rank=rank,
                       ep_size=eng.ep_size, seconds=round(time.monotonic() - t_fence, 3)))
        self._to(P.RESUME)
        t_done = time.monotonic()
        self.pg_generation = g
        self.m.pg_generation.set(g)
        self.m.recovery_seconds.observe(t_done - t0)
        self.m.reprefilled.inc(back)
        last = {"rank": rank, "worker": f"ep{d.worker}", "step": step,
                "pg_generation": g, "mode": mode.value,
                "fence_s": round(t_fence - t0, 3), "reform_s": round(t_done - t_fence, 3),
                "seconds": round(t_done - t0, 3), "requests_reprefilled": back,
                "requests_kept": kept, **extra}
        self.counts.recovered(last, shrink=mode is not Mode.RESPAWN)
        log.warning(event("EPLB elastic resume", **last))
        self._to(P.SERVING)

    def _switched(self, dead: int, got: dict) -> bool | None:
        """Did the surviving ranks switch the layer whose activation the void step carried?
        A rank that finished the step did (its executor activates after the forward); one
        that failed did not. True / False when they agree, None when they do not."""
        token = self.eng.awaited_token()
        done = [o.error is None and o.activation_token == token
                for r, o in got.items() if r != dead]
        return True if all(done) else (False if not any(done) else None)

    def _fence(self, dead: int, step: int, got: dict) -> None:
        """Read the survivors' remaining outputs of the void step (each writes exactly one)
        into ``got``; none of them is committed."""
        for r in range(self.eng.ep_size):
            if r == dead or r in got:
                continue
            try:
                got[r] = self.eng.read_output(r, max(self.silence, FENCE_MIN_S))
            except (RingTimeoutError, IpcError) as e:
                self._stop(WorkerFault(f"EPLB elastic: rank {r} did not finish step {step} "
                                       f"after rank {dead} died ({e})"))

    def _second_death(self, closed: bool) -> None:
        if self.box.poll(0.0):
            raise WorkerFault(f"EPLB elastic: a second death during the recovery: "
                              f"{self.box.death}")

    def _reform_all(self, g: int) -> None:
        """The regroup step of ``g`` and every rank's answer (a second death stops)."""
        step = self.eng.send_regroup(g, self.join_timeout)
        deadline = time.monotonic() + self.join_timeout
        for r in range(self.eng.ep_size):
            protocol.await_answer(self.eng, r, step, deadline, self._second_death)

    def _respawn(self, dead: int, g: int) -> None:
        """Same members, same placement; the replacement attaches, then the regroup."""
        protocol.publish(self.store, g, self.workers, self.eng.active_placement)

        def second_death() -> None:
            if self.box.poll(0.0):
                raise WorkerFault(f"EPLB elastic: the replacement of rank {dead} did not "
                                  f"attach: a second death ({self.box.death})")
        try:
            protocol.await_attached(self.store, self.workers[dead], g, self.join_timeout,
                                    second_death)
            self._reform_all(g)
        except WorkerFault as e:
            self._stop(e)
        self.m.rank_active.labels(str(dead)).set(1)
        self.m.experts_reloaded.labels("checkpoint").inc(self.S * self.L)

    def _shrink(self, rank: int, g: int) -> dict:
        """Re-plan without compact rank ``rank`` (each orphan expert into the coldest extra
        replica's slot), resize the engine, re-form the survivors at ranks ``0..N-2``."""
        eng, D = self.eng, self.eng.ep_size
        t0 = time.monotonic()
        try:
            plan = plan_shrink(eng.active_placement, rank, D, self.E, eng.expert_load())
        except ShrinkError as e:
            self._stop(WorkerFault(f"EPLB elastic: worker ep{self.workers[rank]} died and {e}: "
                                   "the run stops"))
        t_plan = time.monotonic() - t0
        per = plan.reloads_per_rank()
        log.warning(event("EPLB elastic re-plan", rank=rank, ep_size=f"{D}->{D - 1}",
                          checkpoint=len(plan.reloads), replica=0, kept=plan.kept,
                          per_rank=",".join(map(str, per)), seconds=round(t_plan, 4)))
        workers = [self.workers[r] for r in plan.survivors]
        protocol.publish(self.store, g, workers, plan.table)
        eng.resize(workers, plan.table)
        self.workers = workers
        try:
            self._reform_all(g)
        except WorkerFault as e:
            self._stop(e)
        self.m.experts_reloaded.labels("checkpoint").inc(len(plan.reloads))
        return {"ep_size": D - 1, "workers": workers, "plan_s": round(t_plan, 4),
                "experts_checkpoint": len(plan.reloads), "experts_replica": 0,
                "slots_kept": plan.kept, "reloads_per_rank": per}

    # --- a rejoin: join -> switch -> serving | abandon --------------------------------------
    def join(self, n: JoinReady) -> dict:
        """Switch to one more rank, the joiner of ``n``. Returns the numbers for
        ``last_join`` ({} when refused or abandoned); raises :class:`WorkerFault`."""
        eng, w, D = self.eng, n.worker, self.eng.ep_size
        t0, wall0 = time.monotonic(), time.time()
        self._to(P.JOIN, worker=w)
        prefer = self.initial.reshape(self.initial.shape[0], -1, self.S)[:, w, :]
        try:
            plan = plan_join(eng.active_placement, D, self.E, eng.expert_load(), prefer)
        except JoinError as e:
            log.warning(event("EPLB elastic rejoin refused", worker=f"ep{w}", why=str(e)))
            self._to(P.SERVING)
            return {}
        eng.abort_eplb_round(False)       # rebuilt by the resize; the executors are too
        g = next_pg_generation(self.store)
        before = (list(self.workers), eng.active_placement.copy())
        workers = self.workers + [w]
        protocol.publish(self.store, g, workers, plan.table)
        self.box.watch_joiner(w)
        sent, answers = False, {}
        try:
            protocol.send_go(self.store, w, n.pid, g)
            protocol.await_joined(self.store, w, n.pid, self.join_timeout, self._lost_check)
            eng.resize(workers, plan.table)
            self._to(P.SWITCH)
            step, sent = eng.send_regroup(g, self.join_timeout), True
            deadline = time.monotonic() + self.join_timeout
            for r in range(D + 1):
                answers[r] = protocol.await_answer(
                    eng, r, step, deadline, self._switch_silence, on_error=self._switch_error)
        except SwitchLost as e:
            if len(e.args) > 1:
                answers[e.args[1].rank] = e.args[1]
            return self._abandon(w, g, sent, str(e.args[0]), t0, answers, before)
        except WorkerFault as e:
            self._stop(e)
        finally:
            self.box.watch_joiner(None)
        self.workers, self.pg_generation = workers, g
        # the joiner read its whole shard from the checkpoint (loading) plus its re-planned slots
        self.m.experts_reloaded.labels("checkpoint").inc(self.S * self.L
                                                         + len(plan.reloads))
        self.m.pg_generation.set(g)
        self._to(P.SERVING)
        done = time.time()
        return {"worker": f"ep{w}", "ep_size": f"{D}->{D + 1}", "pg_generation": g,
                "start_to_ready_s": round(n.ready_at - n.started_at, 3),
                "ready_to_switch_s": round(max(0.0, wall0 - n.ready_at), 3),
                "pause_s": round(time.monotonic() - t0, 3),
                "start_to_serving_s": round(done - n.started_at, 3),
                "experts_checkpoint": len(plan.reloads), "slots_kept": plan.kept}

    def _lost(self, wait: float = 0.0) -> str:
        """Why the switch is lost: a death notice, or the joiner's drop; "" while none (waited
        for up to ``wait`` seconds: a rank's ring closed, the launcher's notice follows)."""
        deadline = time.monotonic() + wait
        while True:
            if self.box.poll(min(0.05, max(0.0, deadline - time.monotonic()))) \
                    or self.box.joiner_lost:
                return self.box.death or self.box.joiner_lost
            if time.monotonic() >= deadline:
                return ""

    def _switch_silence(self, closed: bool) -> None:
        if why := self._lost(NOTICE_WAIT if closed else 0.0):
            raise SwitchLost(why)

    def _switch_error(self, out):
        # a serving rank whose rendezvous failed (a member died after the vote) stays up
        if out.peer_lost and (why := self._lost(NOTICE_WAIT)):
            raise SwitchLost(why, out)          # the rank's one answer: kept for the drain
        raise WorkerFault(out.error)

    def _lost_check(self) -> None:
        """While the joiner answers the go: a death meanwhile raises :class:`SwitchLost`."""
        if why := self._lost():
            raise SwitchLost(why)

    def _abandon(self, w: int, g: int, sent: bool, why: str, t0: float, answers: dict,
                 before: tuple) -> dict:
        """A death during the switch: no step is in flight and no token was committed, so the
        engine goes back to the ranks before it. Before the regroup step was sent nothing
        changed on any rank. After, the engine decides ``abort`` in the store: unless every
        member had already voted ``go``, the serving ranks answer ``switch abandoned`` and are
        still in generation g; if they had (*committed*), they left g and either formed g+1 or
        failed its rendezvous; either way they answer and stay up. The engine resizes back to
        the ranks before; the joiner is left out (the launcher starts it again while restarts
        remain). A serving rank's death is then recovered as any death. The joiner alone lost
        after the commit stops the run."""
        self._to(P.ABANDON, why=why[:200])
        box, committed, got = self.box, False, {}
        if sent:
            committed = protocol.abort(self.store, g)
            if committed and box.died is None:   # a serving rank's death follows the drop
                box.wait_death(NOTICE_WAIT)
            if committed and (box.died is None or box.died.worker == w):
                # NOTE: the joiner alone lost after every member voted go: the serving ranks
                # left g; re-forming them as they were hung in one measured run, so this stops
                self._stop(WorkerFault(f"EPLB elastic: {why}, after every rank had committed to "
                                       f"generation {g}: the run stops"))
            try:
                got = self._drain(w, self.eng.step_no, committed, answers)
            except WorkerFault as e:
                self._stop(e)
            self.eng.resize(*before)
        self.counts.switch_abandoned()
        self.m.rejoins.labels("abandoned").inc()
        log.warning(event("EPLB elastic rejoin abandoned", worker=f"ep{w}", why=why,
                          pg_generation=self.pg_generation, abandoned=g,
                          ep_size=self.eng.ep_size, regroup_sent=sent, committed=committed,
                          seconds=round(time.monotonic() - t0, 3)))
        if box.died is not None:
            self.recover(WorkerFault(box.death), got)
        else:
            self._to(P.SERVING)
        return {}

    def _drain(self, w: int, step: int, committed: bool, got: dict) -> dict:
        """Every live serving rank's answer to the abandoned regroup step, by rank; a dead one
        (the launcher's notice names it) is left out, and so is the joiner's (dead, or
        SIGKILLed by the launcher). ``got``: the answers read before. A joiner alive in g+1
        next to a dead serving rank stops the run."""
        box, D = self.box, len(self.workers)
        deadline = time.monotonic() + self.join_timeout
        got = {r: o for r, o in got.items() if r < D}

        def dead(r: int) -> bool:
            return isinstance(box.died, WorkerDied) and box.died.worker == self.workers[r]

        def silence(r: int, closed: bool):
            if box.died is None:
                box.wait_death(NOTICE_WAIT if closed else 0.0)
            return protocol.SKIP if dead(r) else None

        def error(out):
            if not out.peer_lost:
                raise WorkerFault(out.error)
            return out

        for r in range(D):
            if r in got or dead(r):
                continue
            out = protocol.await_answer(self.eng, r, step, deadline,
                                       lambda closed, r=r: silence(r, closed), patient=True,
                                       on_error=error)
            if out is not None:
                got[r] = out
        if committed and box.died is not None and box.died.worker != w and not box.joiner_lost:
            raise WorkerFault(f"EPLB elastic: {box.death}, after the joiner had joined the "
                              "generation being formed: the run stops")
        return got
