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
    re-form  the joiner's reader reads again; ForwardInput(regroup=g+1) to every rank: the
             serving ranks leave g and join g+1 (their tables grow, nothing is read); the
             joiner joins, reads the few slots its row changed from the checkpoint and runs
             the transfer canary
    resize   output rings, scheduler (one more DP rank, empty: the running requests keep their
             ranks and KV caches), step watch, telemetry, recorder, metrics, the EPLB manager
             (rebuilt for N ranks on the new table)

Weights come from the checkpoint, not by P2P from the serving ranks: the joiner has no process
group while it loads (the serving ranks' groups are busy serving), and a checkpoint read is what
the shrink already does for orphans (same source, same checksums, the canary checks both).

A joiner the launcher drops (not ready within ``--elastic_join_timeout_seconds``, or dead
without restarts left) changes nothing: the run keeps serving on N-1. One the launcher starts
again (dead by itself, or dropped for a serving rank's death: ``("join_dropped", who, why,
True)``) stays joining; several joiners grow the run one at a time. A joiner lost during the
switch, or a switch past that timeout, is a :class:`~xllm_eplb.engine.failures.WorkerFault`:
the run stops cleanly (the serving ranks are mid-re-form).
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta

from xllm_eplb.engine.failures import WAIT_SLICE, WorkerFault
from xllm_eplb.engine.shrink import resize_rest
from xllm_eplb.eplb.join_plan import JoinError, plan_join
from xllm_eplb.ipc.messages import ForwardInput
from xllm_eplb.ipc.store import join_key, joined_key, put_members, put_placement
from xllm_eplb.model.batch import RankBatch
from xllm_eplb.obs.logs import event

log = logging.getLogger("xllm_eplb.engine.engine")

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
    fw.switching = who
    try:
        ms.store.set(join_key(w, pid), str(generation).encode())
        _wait_joined(ms, who, joined_key(w, pid))
        eng.inp.unretire_reader(w)
        eng.outs.append(ms.parked.pop(w))
        eng.watch.resize(eng.watch.readers + [w])
        eng.sched.grow()
        eng.step_no += 1
        eng.inp.put(ForwardInput(eng.step_no, [RankBatch() for _ in range(D + 1)],
                                 regroup=generation), timeout=ms.join_timeout)
        deadline = time.monotonic() + ms.join_timeout
        for r in range(D + 1):
            ms._regroup_answer(r, eng.step_no, deadline)
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


def _wait_joined(ms, who: str, key: str) -> None:
    """The joiner's answer to the go, in ``WAIT_SLICE`` waits: its death meanwhile (the
    launcher's notice) or ``--elastic_join_timeout_seconds`` raise."""
    fw, deadline = ms.eng.failures, time.monotonic() + ms.join_timeout
    while True:
        try:
            ms.store.wait([key], timedelta(seconds=WAIT_SLICE))
            return
        except Exception:  # noqa: BLE001 - the store's wait timeout
            if fw._poll(0.0):
                raise WorkerFault(f"EPLB elastic: {fw.death}") from None
            if time.monotonic() > deadline:
                raise WorkerFault(f"EPLB elastic: the joiner {who} did not take its input "
                                  "ring within --elastic_join_timeout_seconds="
                                  f"{ms.join_timeout:g}") from None
