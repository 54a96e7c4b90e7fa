"""Elastic shrink in the engine (``--elastic_ep``, a dead worker not replaced: issue #23 items
5-6): the survivors re-form generation g+1 with compact ranks ``0..N-2`` and keep serving.

Called by :class:`~xllm_eplb.engine.membership.Membership` after the fence (the step in flight
is void, the dead rank's requests back in the queue, the survivors' requests kept with their KV
caches)::

    re-plan  eplb/shrink_plan.plan_shrink: the survivors' rows in compact order, each orphan
             expert (its only replica died) in the coldest extra replica's slot
    re-form  placement + members of g+1 to the launcher's store; the dead worker's input-ring
             reader retired; ForwardInput(regroup=g+1) to the survivors, which join the smaller
             world, read their orphans from the checkpoint and run the transfer canary
    resize   everything the engine sized by ep_size follows the new rank set: the output rings
             read, the scheduler's DP ranks (each kept request follows its worker to its compact
             rank, the requeued ones are re-prefilled on the least-loaded survivor),
             the step watch, telemetry, recorder, metrics, the EPLB manager (rebuilt for
             N-1 ranks on the new table, see :func:`_manager`)

A shrink the rule refuses (``(N-1) x slots_per_rank >= num_experts``) raises a
:class:`~xllm_eplb.engine.failures.WorkerFault` naming it: the run stops as without elasticity.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from xllm_eplb.config import layout_error
from xllm_eplb.engine.failures import WorkerFault
from xllm_eplb.engine.telemetry import Telemetry
from xllm_eplb.eplb.recorder import ExpertRecorder
from xllm_eplb.eplb.shrink_plan import ShrinkError, plan_shrink
from xllm_eplb.errors import ConfigError
from xllm_eplb.ipc.messages import ForwardInput
from xllm_eplb.ipc.store import put_members, put_placement
from xllm_eplb.model.batch import RankBatch
from xllm_eplb.obs.logs import event

log = logging.getLogger(__name__)


def shrink(ms, rank: int, generation: int) -> dict:
    """Re-plan, re-form and resize without rank ``rank`` (compact rank of the dead worker);
    returns the numbers of the re-plan for ``last_recovery``."""
    eng = ms.eng
    D, cfg = eng.D, eng.cfg
    t0 = time.monotonic()
    load = eng.live.expert_total if eng.live.expert_total.sum() > 0 else None
    try:
        plan = plan_shrink(eng.active_placement, rank, D, cfg.model.num_experts, load)
    except ShrinkError as e:
        raise WorkerFault(f"EPLB elastic: worker ep{ms.workers[rank]} died and {e}: the run "
                          "stops") from None
    t_plan = time.monotonic() - t0
    per = plan.reloads_per_rank()
    log.warning(event("EPLB elastic re-plan", rank=rank, ep_size=f"{D}->{D - 1}",
                      checkpoint=len(plan.reloads), replica=0, kept=plan.kept,
                      per_rank=",".join(map(str, per)), seconds=round(t_plan, 4)))
    workers = [ms.workers[r] for r in plan.survivors]
    put_placement(ms.store, generation, plan.table)
    put_members(ms.store, generation, workers)
    eng.inp.retire_reader(ms.workers[rank])
    eng.step_no += 1
    eng.inp.put(ForwardInput(eng.step_no, [RankBatch() for _ in range(D - 1)],
                             regroup=generation), timeout=ms.join_timeout)
    deadline = time.monotonic() + ms.join_timeout
    for r in plan.survivors:
        ms._regroup_answer(r, eng.step_no, deadline)
    resize(eng, plan.survivors, plan.table)
    ms.workers = workers
    m = eng.metrics
    m.experts_reloaded.labels("checkpoint").inc(len(plan.reloads))
    for r in range(D):             # compact ranks 0..D-2 active, the last one gone
        m.rank_active.labels(str(r)).set(int(r < D - 1))
    m.worker_up.labels(str(D - 1)).set(0)
    m.ep_size_g.set(D - 1)
    return {"ep_size": D - 1, "workers": workers, "plan_s": round(t_plan, 4),
            "experts_checkpoint": len(plan.reloads), "experts_replica": 0,
            "slots_kept": plan.kept, "reloads_per_rank": per}


def resize(eng, keep: list[int], table) -> None:
    """Every ep_size-shaped piece of the engine for the ranks ``keep`` (old compact ranks, in
    new rank order) and the deployed ``table`` [L, (D-1)*S]."""
    eng.outs = [eng.outs[r] for r in keep]
    eng.sched.resize(keep)
    eng.watch.resize([eng.watch.readers[r] for r in keep])
    resize_rest(eng, len(keep), table)


def resize_rest(eng, D: int, table) -> None:
    """What follows the rank count ``D`` once the rings, the scheduler and the step watch do
    (a shrink above, a rejoin in ``engine/rejoin.py``): telemetry, recorder, KV capacity, the
    deployed table, the EPLB manager (rebuilt)."""
    cfg = eng.cfg
    eng.D = D
    old = eng.tele
    eng.tele = Telemetry(eng.metrics, cfg.num_moe_layers, D, ranks_per_node=D)
    for k in ("cp", "steps", "serving", "last_commit_at", "eplb"):
        setattr(eng.tele, k, getattr(old, k))
    eng.recorder = ExpertRecorder(cfg.num_moe_layers, D, cfg.slots_per_rank,
                                  cfg.model.num_experts, cfg.eplb.eplb_record_trace_max_steps)
    eng.rank_node = [0] * D
    eng.live.kv_capacity = max(1, D * cfg.runtime.max_batch_size
                               * cfg.model.max_position_embeddings)
    eng.placement = table
    eng.manager = _manager(eng, D, table)


def _manager(eng, D: int, table):
    """The EPLB manager of the smaller world with the new table deployed (None when EPLB is
    off). ``num_experts`` need not divide by the ranks left: the manager then takes the slots
    per rank as given and the policy plans that layout (``EplbPolicy(..., slots)``); a policy
    that cannot leaves the survivors serving the re-planned table without rebalancing
    (logged)."""
    cfg, old = eng.cfg, eng.manager
    if old is not None:
        old.close()
    if not cfg.eplb.enable_eplb:
        return None
    from xllm_eplb.eplb.manager import EplbManager

    E, S = cfg.model.num_experts, cfg.slots_per_rank
    e = dataclasses.replace(cfg.eplb, ep_size=D, redundant_experts_num=max(0, S - E // D))
    try:
        planner = _planner(e, E, S) if layout_error(E, D, S - E // D) else None
        mgr = EplbManager(e, cfg.num_moe_layers, E, runner="thread", initial=table,
                          expect_timings=True, slots=S, planner=planner)
    except (ConfigError, ValueError) as err:
        log.warning(event("EPLB elastic rebalancing off", ep_size=D, slots_per_rank=S,
                          num_experts=E, why=str(err)))
        eng.metrics.enabled.set(0)
        return None
    if old is not None:
        mgr.inherit_counters(old)
    eng.metrics.enabled.set(1)
    return mgr


def _planner(e, num_experts: int, slots: int):
    """``--eplb_policy_kind`` with its options for ``e.ep_size`` ranks of ``slots`` slots, a
    layout the flag rules cannot express (E % ep_size != 0)."""
    from xllm_eplb.eplb.gate import Planner
    from xllm_eplb.eplb.policy import policy_from_config

    policy = policy_from_config(e, num_experts, slots=slots)
    return Planner(policy, e.eplb_min_peak_load_improvement, e.eplb_plan_on)
