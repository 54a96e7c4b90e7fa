"""Elastic EP membership (``--elastic_ep``, issue #23): the one owner, in the engine, of who is
alive and of the process-group generation, and the recovery that follows a death.

Recovery (the launcher respawns the dead worker in place, or with ``--elastic_restart=false``
or its restarts used up leaves it out, and sends the engine a notice saying which)::

    detect   a step fails (a survivor's collective reports peer_lost, the dead rank's ring
             producer is gone, or the launcher's notice arrives while the step waits)
    fence    the step is void: the survivors' outputs of that step are drained and dropped
             (no token of it is committed); the dead rank's requests go back to the head of
             the queue to be re-prefilled from prompt + output on the least-loaded rank (same
             seeds, so the same tokens follow); the survivors' requests keep their KV caches
             and recompute the void step (``Scheduler.void_step``: each cache is cut back to
             its committed length first)
    re-form  the deployed placement is put in the launcher's store for the replacement; once
             it has attached its rings the engine sends ``ForwardInput(regroup=g+1)``: the
             survivors leave generation g and join g+1 with the replacement (same ranks)
    resume   the next step is ordinary; streams continue without a repeated or skipped token

A death the launcher does not replace is a *shrink* (``engine/shrink.py``): the re-form is with
the survivors only, at compact ranks ``0..N-2``, after a re-plan of the experts; the engine's
rank set follows. Ranks are compact; :attr:`Membership.workers` maps each to its worker. A
*rejoin* (mode ``rejoin``) is a shrink now and a grow later: the replacement loads while N-1
ranks serve; its ``join_ready`` is taken at a step boundary (:meth:`Membership.at_boundary`,
``engine/rejoin.py``; a death during its switch abandons the switch and is recovered as
above).

An EPLB round in flight is dropped (``EplbManager.abort_round``: committed layers stay, the
rest is re-planned by a later round). A death the engine cannot recover from stops the run as
without elasticity: no launcher notice (a real error), an EPLB layer activation in flight (some
rank may have switched it), a second death during recovery, or a re-form
that does not finish within ``--elastic_join_timeout_seconds``. Each phase logs one
``EPLB elastic ...`` line with its duration.
"""

from __future__ import annotations

import logging
import time

from xllm_eplb.engine.failures import WAIT_SLICE, WorkerFault
from xllm_eplb.engine.rejoin import grow
from xllm_eplb.engine.shrink import shrink
from xllm_eplb.ipc.errors import IpcError, RingTimeoutError
from xllm_eplb.ipc.messages import ForwardInput
from xllm_eplb.ipc.store import put_members, put_placement
from xllm_eplb.model.batch import RankBatch
from xllm_eplb.obs.logs import event

log = logging.getLogger(__name__)

#: a survivor's answer to the void step is awaited at least this long (seconds): on a loaded
#: machine failing a collective and writing ``peer_lost`` can take longer than a short
#: ``--elastic_silence_seconds``; a survivor that stays silent is a second death (clean stop)
FENCE_MIN_S = 10.0
#: how long a failed step waits for the launcher's death notice (seconds)
NOTICE_WAIT = 3.0


class Membership:
    """Generation, ranks alive, recovery counters (``/eplb/status`` ``membership``)."""

    def __init__(self, engine, store):
        self.eng, self.store = engine, store
        rt = engine.cfg.runtime
        self.silence, self.join_timeout = rt.elastic_silence_seconds, rt.elastic_join_timeout_seconds
        self.generation = 1
        self.recoveries = 0
        self.reprefilled = self.kept = 0
        self.last: dict = {}
        #: the worker (``ep<w>``, its rings) of each EP rank; a shrink drops the dead one and
        #: the survivors take compact ranks
        self.workers = list(range(engine.D))
        self.shrinks = 0
        # --- rejoin: the initial table (what a joiner loads), the output rings of workers
        # left out (a joiner takes its worker's), the joiners loading, what the joins did
        self.initial = engine.placement.copy()
        self.parked: dict[int, object] = {}
        self.joining: dict[str, float] = {}      # ep<w> -> wall time of the death
        self.joins = self.joins_dropped = self.switches_abandoned = 0
        self.last_join: dict = {}

    def status(self) -> dict:
        return {"elastic": True, "generation": self.generation, "ep_size": self.eng.D,
                "ranks_active": list(range(self.eng.D)), "workers": list(self.workers),
                "recoveries": self.recoveries, "shrinks": self.shrinks,
                "requests_reprefilled": self.reprefilled, "requests_kept": self.kept,
                "last_recovery": dict(self.last),
                "joins": self.joins, "joining": sorted(self.joining),
                "joins_dropped": self.joins_dropped,
                "switches_abandoned": self.switches_abandoned, "last_join": dict(self.last_join)}

    def when_idle(self) -> None:
        """A death notice while no step runs: an empty step now meets the dead rank (and
        recovers, or stops the run), instead of the next request's."""
        if self.joining:
            self.at_boundary()
        if self.eng.failures._poll(0.0):
            self.eng.step([RankBatch() for _ in range(self.eng.D)])

    def at_boundary(self) -> None:
        """Rejoin, between steps: a dropped joiner is forgotten (N-1 keep serving) unless the
        launcher starts it again; a ready one joins now (``engine/rejoin.py``), one at a time;
        a ``join_ready`` followed by that joiner's drop in the same batch is stale."""
        notices = self.eng.failures.poll_joins()
        for i, n in enumerate(notices):
            if n[0] == "join_dropped":
                if n[1] in self.joining:
                    self.joins_dropped += 1
                    self.eng.metrics.rejoins.labels("dropped").inc()
                    if not (len(n) > 3 and n[3]):
                        del self.joining[n[1]]
                    # NOTE: ``n[3]``: a serving rank's death dropped it and the launcher
                    # starts the worker's joiner again: it stays joining
                continue
            if n[1] not in self.joining or self.eng.failures.death or any(
                    m[0] == "join_dropped" and m[1] == n[1] for m in notices[i + 1:]):
                continue        # a death first: the next step recovers (the launcher drops it)
            got = grow(self, n)
            if not got:
                continue
            self.joining.pop(n[1])
            self.joins += 1
            self.last_join = got
            self.eng.metrics.rejoins.labels("joined").inc()
            self.eng.metrics.rejoin_seconds.observe(got["start_to_serving_s"])
            log.warning(event("EPLB elastic rejoin", **got))

    # --- recovery --------------------------------------------------------------------------
    def recover(self, fault: WorkerFault, got: dict) -> None:
        """Recover from the death behind ``fault`` (``got``: the outputs of the failed step
        read so far, by rank) or raise a :class:`WorkerFault` (the run then stops as without
        elasticity)."""
        eng, fw = self.eng, self.eng.failures
        t0 = time.monotonic()
        fw.explain(fault, wait=NOTICE_WAIT)
        if fw.died is None or len(fw.died) < 5:
            raise fault
        _, who, msg, generation, seen, *mode = fw.died
        shrinking = bool(mode) and mode[0] in ("shrink", "rejoin")
        fw.clear_death()                  # from here on, a death notice is a second death
        if int(who[2:]) not in self.workers:
            raise fault
        rank, step = self.workers.index(int(who[2:])), eng.step_no
        log.warning(event("EPLB elastic detect", rank=rank, worker=who, step=step,
                          generation=generation, mode=mode[0] if mode else "respawn",
                          detect_s=round(time.time() - seen, 3), cause=msg))
        self.mark_down(rank)
        self._fence(rank, step, got)
        if eng.manager is not None and not eng.manager.abort_round(self._switched(rank, got)):
            raise WorkerFault(f"{msg}; an EPLB layer activation was in flight and only some "
                              "ranks switched it: the run stops")
        back = eng.sched.void_step(rank)
        kept = len(eng.sched.running)
        t_fence = time.monotonic()
        log.info(event("EPLB elastic fence", step=step, requests_reprefilled=len(back),
                       requests_kept=kept, seconds=round(t_fence - t0, 3)))
        extra = {}
        if shrinking:
            if mode[0] == "rejoin":      # its worker's output ring waits for the joiner
                self.parked[int(who[2:])] = eng.outs[rank]
            extra = shrink(self, rank, generation)
            self.shrinks += 1
            if mode[0] == "rejoin":
                self.joining[who] = seen
            log.info(event("EPLB elastic re-form", generation=generation, rank=rank,
                           ep_size=eng.D, seconds=round(time.monotonic() - t_fence, 3)))
        else:
            self._reform(rank, generation)
        t_done = time.monotonic()
        self.generation, self.recoveries = generation, self.recoveries + 1
        self.reprefilled += len(back)
        self.kept += kept
        self._metrics(t_done - t0, len(back), respawn=not shrinking)
        self.last = {"rank": rank, "worker": who, "step": step, "generation": generation,
                     "mode": mode[0] if mode else "respawn",
                     "fence_s": round(t_fence - t0, 3), "reform_s": round(t_done - t_fence, 3),
                     "seconds": round(t_done - t0, 3), "requests_reprefilled": len(back),
                     "requests_kept": kept, **extra}
        log.warning(event("EPLB elastic resume", **self.last))

    def _metrics(self, seconds: float, reprefilled: int, respawn: bool) -> None:
        """A replacement re-read its whole shard (every slot of every MoE layer) from the
        checkpoint; nothing moved between replicas (a shrink counts its own reloads)."""
        m, cfg = self.eng.metrics, self.eng.cfg
        m.pg_generation.set(self.generation)
        m.recovery_seconds.observe(seconds)
        m.reprefilled.inc(reprefilled)
        if respawn:
            m.experts_reloaded.labels("checkpoint").inc(cfg.slots_per_rank * cfg.num_moe_layers)

    def mark_down(self, rank: int) -> None:
        self.eng.metrics.rank_active.labels(str(rank)).set(0)

    def _switched(self, dead: int, got: dict) -> bool | None:
        """Did the surviving ranks switch the layer whose activation the void step carried?
        A rank that finished the step did (its executor activates after the forward); one
        that failed did not. True / False when they agree, None when they do not."""
        token = self.eng.manager.pipe.awaited_token()
        done = [o.error is None and o.activation_token == token
                for r, o in got.items() if r != dead]
        return True if all(done) else (False if not any(done) else None)

    def _fence(self, dead: int, step: int, got: dict) -> None:
        """Read the survivors' remaining outputs of the void step (each writes exactly one)
        into ``got``; none of them is committed."""
        eng = self.eng
        for r in range(eng.D):
            if r == dead or r in got:
                continue
            try:
                got[r] = eng.outs[r].get(timeout=max(self.silence, FENCE_MIN_S))
            except (RingTimeoutError, IpcError) as e:
                raise WorkerFault(f"EPLB elastic: rank {r} did not finish step {step} after "
                                  f"rank {dead} died ({e})") from None
        eng.watch.end()

    def _reform(self, dead: int, generation: int) -> None:
        """Placement to the store, wait for the replacement's rings, then the regroup step."""
        eng, fw = self.eng, self.eng.failures
        t0 = time.monotonic()
        put_placement(self.store, generation, eng.active_placement)
        put_members(self.store, generation, self.workers)
        got = fw.next_attached(self.join_timeout)
        if got is None or fw.died is not None:
            raise WorkerFault(f"EPLB elastic: the replacement of rank {dead} did not attach "
                              f"within --elastic_join_timeout_seconds={self.join_timeout:g}"
                              + (f" ({fw.death})" if fw.died is not None else ""))
        eng.step_no += 1
        msg = ForwardInput(eng.step_no, [RankBatch() for _ in range(eng.D)], regroup=generation)
        eng.inp.put(msg, timeout=self.join_timeout)
        for r in range(eng.D):
            self._regroup_answer(r, eng.step_no, time.monotonic() + self.join_timeout)
        eng.metrics.rank_active.labels(str(dead)).set(1)
        log.info(event("EPLB elastic re-form", generation=generation, rank=dead,
                       seconds=round(time.monotonic() - t0, 3)))

    def _regroup_answer(self, r: int, step: int, deadline: float) -> None:
        """Rank ``r``'s answer to the regroup step (a dead predecessor's stale frames are
        skipped); an error, the deadline or a second death (the launcher's notice, checked
        between ``WAIT_SLICE`` waits: the others would wait for the dead one until the
        deadline) raises."""
        fw = self.eng.failures
        while True:
            left = deadline - time.monotonic()
            try:
                out = self.eng.outs[r].get(timeout=max(0.0, min(WAIT_SLICE, left)))
            except RingTimeoutError as e:
                if fw._poll(0.0):
                    raise WorkerFault(f"EPLB elastic: a second death during the recovery: "
                                      f"{fw.death}") from None
                if left > WAIT_SLICE:
                    continue
                raise WorkerFault(f"EPLB elastic: rank {r} did not re-form within "
                                  f"--elastic_join_timeout_seconds={self.join_timeout:g} "
                                  f"({e})") from None
            except IpcError as e:
                raise WorkerFault(f"EPLB elastic: rank {r} did not re-form ({e})") from None
            if out.step != step:
                continue
            if out.error:
                raise WorkerFault(out.error)
            return
