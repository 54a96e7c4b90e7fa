"""Elastic rejoin in the engine (``--elastic_ep`` with ``--elastic_restart`` and
``--elastic_rejoin``, issue #23 item 8): after a shrink to ``N-1`` ranks the launcher starts a
replacement worker in the background; it loads its model (the initial shard of its worker, read
from the checkpoint) while the ``N-1`` ranks serve, and signals ``join_ready``. At the next step
boundary (no step in flight) :func:`grow` switches to ``N`` ranks, generation g+1::

    re-plan  eplb/join_plan.plan_join: the serving ranks keep their rows (no weight moves on
             them), the joiner appended as compact rank N-1; its row keeps the distinct experts
             it loaded, the other slots get the hottest experts (no expert twice on it)
    go       placement + members of g+1 to the store, then the joiner's go key; the joiner
             claims its input-ring reader at the newest frame and answers (``joined`` key)
    re-form  the joiner's reader reads again; ForwardInput(regroup=g+1) to every rank; the
             joiner reads the few slots its row changed from the checkpoint and runs the
             transfer canary; every member votes in the store (``worker/regroup.py`` ``vote``:
             ``go`` once all arrived, unless the engine decided ``abort`` first); on ``go`` the
             serving ranks leave g and join g+1 (their tables grow, nothing is read), the
             joiner joins
    resize   output rings, scheduler (one more DP rank, empty: the running requests keep their
             ranks and KV caches), step watch, telemetry, recorder, metrics, the EPLB manager
             (rebuilt for N ranks on the new table)

Weights come from the checkpoint, not by P2P from the serving ranks: the joiner has no process
group while it loads (the serving ranks' groups are busy serving), and a checkpoint read is what
the shrink already does for orphans (same source, same checksums, the canary checks both).

A joiner the launcher drops (not ready within ``--elastic_join_timeout_seconds``, or dead
without restarts left) changes nothing: the run keeps serving on N-1. One the launcher starts
again (dead by itself, or dropped for a serving rank's death: ``("join_dropped", who, why,
True)``) stays joining; several joiners grow the run one at a time.

A death during the switch (the joiner's, or a serving rank's) abandons it (:func:`_abandon`):
no step is in flight and no token is committed by it, so the engine goes back to the N-1
ranks: the vote's ``abort`` keeps the serving ranks in g (or, every member having voted
``go``, they answer after g+1's rendezvous, bounded by ``SWITCH_RENDEZVOUS_S``), the joiner's
rank is dropped again (the launcher starts the joiner again while restarts remain), and a
serving rank's death is recovered as any death (``Membership.recover``: a shrink, KV kept).
The joiner alone lost after every member voted ``go`` (the short rendezvous of g+1), a switch
past ``--elastic_join_timeout_seconds``, a serving rank dead next to a joiner the launcher
already counts as joined, or a second death while the ranks re-form is a
:class:`~xllm_eplb.engine.failures.WorkerFault`: the run stops cleanly.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta

from xllm_eplb.engine.failures import NOTICE_WAIT, WAIT_SLICE, WorkerFault
from xllm_eplb.engine.shrink import resize_rest
from xllm_eplb.eplb.join_plan import JoinError, plan_join
from xllm_eplb.ipc.errors import IpcError, RingTimeoutError
from xllm_eplb.ipc.messages import ForwardInput
from xllm_eplb.ipc.store import decide, join_key, joined_key, put_members, put_placement
from xllm_eplb.model.batch import RankBatch
from xllm_eplb.obs.logs import event

log = logging.getLogger(__name__)

#: the store key of the generation counter (shared with the launcher, ``launcher/elastic.py``)
GENERATION_KEY = "generation"


def grow(ms, notice: tuple) -> dict:
    """Switch to one more rank: the joiner of ``notice`` (``("join_ready", who, started_at,
    ready_at, pid)``). Returns the numbers for ``last_join``; raises :class:`WorkerFault`."""
    eng, fw = ms.eng, ms.eng.failures
    _, who, started, ready, pid = notice
    w = int(who[2:])
    D, cfg = eng.D, eng.cfg
    t0, wall0 = time.monotonic(), time.time()
    S = cfg.slots_per_rank
    load = eng.live.expert_total if eng.live.expert_total.sum() > 0 else None
    prefer = ms.initial.reshape(ms.initial.shape[0], -1, S)[:, w, :]
    try:
        plan = plan_join(eng.active_placement, D, cfg.model.num_experts, load, prefer)
    except JoinError as e:
        log.warning(event("EPLB elastic rejoin refused", worker=who, why=str(e)))
        return {}
    if eng.manager is not None:
        eng.manager.abort_round(False)       # rebuilt below; the executors are too
    generation = int(ms.store.add(GENERATION_KEY, 1))
    workers = ms.workers + [w]
    put_placement(ms.store, generation, plan.table)
    put_members(ms.store, generation, workers)
    fw.switching, fw.switch_lost, sent, answers = who, "", False, {}
    try:
        ms.store.set(join_key(w, pid), str(generation).encode())
        _wait_joined(ms, who, joined_key(w, pid))
        eng.inp.unretire_reader(w)
        eng.outs.append(ms.parked.pop(w))
        eng.watch.resize(eng.watch.readers + [w])
        eng.sched.grow()
        eng.step_no += 1
        sent = True
        eng.inp.put(ForwardInput(eng.step_no, [RankBatch() for _ in range(D + 1)],
                                 regroup=generation), timeout=ms.join_timeout)
        deadline = time.monotonic() + ms.join_timeout
        for r in range(D + 1):
            answers[r] = _answer(ms, r, eng.step_no, deadline)
    except SwitchLost as e:
        return _abandon(ms, who, generation, sent, str(e), t0, answers)
    finally:
        fw.switching = ""
    resize_rest(eng, D + 1, plan.table)
    ms.workers = workers
    ms.generation = generation
    m = eng.metrics
    # the joiner read its whole shard from the checkpoint (loading) plus its re-planned slots
    m.experts_reloaded.labels("checkpoint").inc(S * cfg.num_moe_layers + len(plan.reloads))
    m.rank_active.labels(str(D)).set(1)
    m.worker_up.labels(str(D)).set(1)
    m.ep_size_g.set(D + 1)
    m.pg_generation.set(generation)
    done = time.time()
    return {"worker": who, "ep_size": f"{D}->{D + 1}", "generation": generation,
            "start_to_ready_s": round(ready - started, 3),
            "ready_to_switch_s": round(max(0.0, wall0 - ready), 3),
            "pause_s": round(time.monotonic() - t0, 3),
            "start_to_serving_s": round(done - started, 3),
            "experts_checkpoint": len(plan.reloads), "slots_kept": plan.kept}


class SwitchLost(Exception):
    """A death during the switch (a serving rank's, or the joiner's)."""


def _lost(ms, wait: float = 0.0) -> str:
    """Why the switch is lost: a death notice, or the joiner's drop; "" while none (waited
    for up to ``wait`` seconds: a rank's ring closed, the launcher's notice follows)."""
    fw, deadline = ms.eng.failures, time.monotonic() + wait
    while True:
        if fw._poll(min(0.05, max(0.0, deadline - time.monotonic()))) or fw.switch_lost:
            return fw.death or fw.switch_lost
        if time.monotonic() >= deadline:
            return ""


def _wait_joined(ms, who: str, key: str) -> None:
    """The joiner's answer to the go, in ``WAIT_SLICE`` waits: a death meanwhile (the
    launcher's notice) raises :class:`SwitchLost`, ``--elastic_join_timeout_seconds``
    :class:`WorkerFault`."""
    deadline = time.monotonic() + ms.join_timeout
    while True:
        try:
            ms.store.wait([key], timedelta(seconds=WAIT_SLICE))
            return
        except Exception:  # noqa: BLE001 - the store's wait timeout
            if why := _lost(ms):
                raise SwitchLost(why) from None
            if time.monotonic() > deadline:
                raise WorkerFault(f"EPLB elastic: the joiner {who} did not take its input "
                                  "ring within --elastic_join_timeout_seconds="
                                  f"{ms.join_timeout:g}") from None


def _answer(ms, r: int, step: int, deadline: float):
    """Rank ``r``'s answer to the switch's regroup step (stale frames skipped): a death
    meanwhile raises :class:`SwitchLost` (a rank's ring closing waits for the launcher's
    notice first); an error or the deadline :class:`WorkerFault`."""
    eng = ms.eng
    while True:
        left = deadline - time.monotonic()
        try:
            out = eng.outs[r].get(timeout=max(0.0, min(WAIT_SLICE, left)))
        except IpcError as e:
            closed = not isinstance(e, RingTimeoutError)
            if why := _lost(ms, NOTICE_WAIT if closed else 0.0):
                raise SwitchLost(why) from None
            if left > WAIT_SLICE and isinstance(e, RingTimeoutError):
                continue
            raise WorkerFault(f"EPLB elastic: rank {r} did not re-form ({e})") from None
        if out.step != step:
            continue
        if out.error:
            # a serving rank whose rendezvous failed (a member died after the vote) stays up
            if out.peer_lost and (why := _lost(ms, NOTICE_WAIT)):
                raise SwitchLost(why)
            raise WorkerFault(out.error)
        return out


def _abandon(ms, who: str, generation: int, sent: bool, why: str, t0: float,
             answers: dict) -> dict:
    """A death during the switch: no step is in flight and no token was committed, so the
    engine goes back to the ranks before it. Before the regroup step was sent nothing changed
    on any rank. After, the engine decides ``abort`` in the store (``worker/regroup.py``
    ``vote``): unless every member had already voted ``go``, the serving ranks answer
    ``switch abandoned`` and are still in generation g, groups, models and KV caches intact;
    if they had (*committed*), they left g and either formed g+1 or failed its rendezvous
    (``SWITCH_RENDEZVOUS_S``); either way they answer and stay up. The engine's rings, step
    watch and scheduler drop the joiner's rank again; the joiner is left out (the launcher
    drops it and starts it again while restarts remain). Then a serving rank's death is
    recovered as any death (``Membership.recover``: the survivors shrink to generation g+2,
    their requests keep their KV). The joiner alone lost after the commit stops the run
    (a :class:`WorkerFault`). ``answers``: the regroup answers read so far, by rank. Returns
    ``{}`` (no join)."""
    eng, fw, D, w = ms.eng, ms.eng.failures, ms.eng.D, int(who[2:])
    committed, got = False, {}
    if sent:
        committed = decide(ms.store, generation, "abort") != "abort"
        if committed and fw.died is None:      # a serving rank's death follows its joiner's drop
            fw.explain(WorkerFault(why), wait=NOTICE_WAIT)
        if committed and (fw.died is None or fw.died[1] == who):
            # NOTE: the joiner alone lost after every member voted go: the serving ranks left
            # g; re-forming them as they were hung in one measured run, so this stops (as
            # before the vote existed)
            raise WorkerFault(f"EPLB elastic: {why}, after every rank had committed to "
                              f"generation {generation}: the run stops")
        got = _drain(ms, who, eng.step_no, committed, answers)
        eng.inp.retire_reader(w)
        ms.parked[w] = eng.outs.pop()
        eng.watch.resize(eng.watch.readers[:-1])
        eng.sched.resize(list(range(D)))
    ms.switches_abandoned += 1
    eng.metrics.rejoins.labels("abandoned").inc()
    log.warning(event("EPLB elastic rejoin abandoned", worker=who, why=why,
                      generation=ms.generation, abandoned=generation, ep_size=D,
                      regroup_sent=sent, committed=committed,
                      seconds=round(time.monotonic() - t0, 3)))
    if fw.died is not None:
        ms.recover(WorkerFault(fw.death), got)
    return {}


def _drain(ms, who: str, step: int, committed: bool, got: dict) -> dict:
    """Every live serving rank's answer to the regroup step (``switch abandoned``; committed:
    re-formed or a failed rendezvous), by rank; a dead one (the launcher's notice names it) is
    left out. The joiner's is not awaited (dead, or SIGKILLed by the launcher; its ring is
    parked and a stale frame skipped later), unless the launcher did not drop it: a joiner
    alive in g+1 next to a dead serving rank stops the run. ``got``: the answers read before
    (not read again)."""
    eng, fw = ms.eng, ms.eng.failures
    deadline = time.monotonic() + ms.join_timeout
    got = {r: o for r, o in got.items() if r < eng.D}
    for r in range(eng.D):
        while r not in got:
            if fw.died is not None and fw.died[1] == f"ep{ms.workers[r]}":
                break                   # dead: recovered below
            try:
                out = eng.outs[r].get(timeout=WAIT_SLICE)
            except IpcError as e:
                if fw.died is None:
                    fw.explain(e, wait=0.0 if isinstance(e, RingTimeoutError) else NOTICE_WAIT)
                if time.monotonic() < deadline or (fw.died is not None
                                                   and fw.died[1] == f"ep{ms.workers[r]}"):
                    continue
                raise WorkerFault(f"EPLB elastic: rank {r} did not answer the abandoned "
                                  f"switch ({e})") from None
            if out.step != step:
                continue
            if out.error and not out.peer_lost:
                raise WorkerFault(out.error)
            got[r] = out
            break
    if committed and fw.died is not None and fw.died[1] != who and not fw.switch_lost:
        raise WorkerFault(f"EPLB elastic: {fw.death}, after the joiner had joined the generation "
                          "being formed: the run stops")
    return got
