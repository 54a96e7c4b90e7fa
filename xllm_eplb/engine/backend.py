"""The HTTP API's view of the engine (the callables of ``engine/api.ApiBackend``): submit and
cancel (the scheduler's thread-safe queue), ``/health``, ``/metrics``, admission and
``/eplb/status``. It reads the engine's state and writes none of it, so ``Engine`` stays the
step loop."""

from __future__ import annotations

from xllm_eplb.engine.scheduler import Request
from xllm_eplb.engine.telemetry import balance_note
from xllm_eplb.engine.workload import workload_status
from xllm_eplb.eplb.manager_stats import ManagerStats
from xllm_eplb.model.fp8 import quant_info


class EngineApi:
    """The API backend of one :class:`~xllm_eplb.engine.engine.Engine` (``eng``)."""

    def __init__(self, eng):
        self.eng = eng

    def cancel(self, req_id: int, why: str) -> None:
        self.eng.sched.cancel(req_id, why)

    def submit(self, req: Request) -> Request:
        return self.eng.sched.submit(req)

    def health(self) -> tuple[bool, dict]:
        """(serving, info); a step in flight beyond ``--stall_seconds`` is ``stalled`` (503)
        with the ranks it waits on (computed now, from the stored step start); beyond
        ``engine/health.SUSPECT_SECONDS`` (1 s) it is ``degraded`` (200) with them."""
        eng = self.eng
        info = {"status": eng.state, "ep_size": eng.D, "step": eng.step_no,
                "eplb": bool(eng.cfg.eplb.enable_eplb)}    # the manager starts after warm-up
        if eng.state != "serving":
            return False, info
        fenced = eng.membership.health()
        if fenced is not None:          # elastic EP fenced a silent worker, or is recovering
            info.update(fenced)
            return False, info
        waits = eng.watch.verdict(eng.inp, eng.outs)
        if waits is None:
            return True, info
        info.update(status=waits[0], waiting_on=waits[1],
                    step_seconds=round(eng.watch.in_flight_seconds(), 3))
        return waits[0] == "degraded", info     # degraded: still serving (200)

    def render_metrics(self) -> bytes:
        """Prometheus text; heartbeat ages and ``worker_up`` are computed at scrape time."""
        eng = self.eng
        silent = eng.watch.stalled(eng.inp, eng.outs) or []
        eng.tele.refresh_health(eng.cfg.runtime.worker_timeout_seconds, silent=silent)
        eng.breakdown.export(eng.metrics.step_phase)
        return eng.metrics.render()

    def admit(self) -> str | None:
        """None, or why the API refuses new work now (503 overloaded)."""
        eng = self.eng
        cap = eng.cfg.serve.max_waiting_requests
        waiting = eng.sched.load()["waiting"]
        if waiting >= cap:
            return (f"overloaded: {waiting} requests waiting (--max_waiting_requests={cap}); "
                    f"retry later")
        return None

    def status(self) -> dict:
        """/eplb/status: the manager's ``stats()`` (EPLB off: the same keys at their zero
        values, :class:`~xllm_eplb.eplb.manager_stats.ManagerStats`), balance, critical path."""
        eng = self.eng
        policy = eng.cfg.eplb.eplb_policy_kind
        st = (eng.manager.stats() if eng.manager is not None
              else ManagerStats(policy=policy).as_dict())
        out = {"enabled": eng.manager is not None, "ep_size": eng.D,
               "num_layers": eng.cfg.num_moe_layers, "step": eng.step_no, **st,
               "placement": eng.active_placement.tolist(),
               "init_placement": eng.cfg.eplb.eplb_init_placement,
               "record": eng.recorder.status()}
        out.update(eng.tele.balance_summary())
        out["balance_note"] = balance_note(out, eng.cfg.eplb.eplb_plan_on)
        out["cores"] = eng.cores
        out["critical_path"] = eng.tele.critical_path_summary()
        # the policy runner's thread CPU (drain, decode, policy), measured by the manager itself
        out["critical_path"]["manager_thread_cpu_s"] = float(out["policy_cpu_seconds"])
        out["requests"] = eng.sched.load()
        out["batch"] = {"max_batch_size": eng.sched.max_batch_size,
                        "waiting_for_slot": eng.sched.waiting_for_slot}
        out["step_breakdown"] = eng.breakdown.summary()
        out["async_scheduling"] = {"enabled": eng.cfg.runtime.async_scheduling,
                                   "steps_planned_ahead": eng.planned_ahead}
        if eng.manager is not None:
            out["cost_model"] = eng.manager.cost_status()
        out["nnodes"], out["rank_node"] = eng.cfg.runtime.nnodes, list(eng.rank_node)
        out["membership"] = eng.membership.status()
        e = eng.cfg.eplb
        out["capacity"] = {"mode": e.moe_capacity_mode, "factor": e.moe_capacity_factor,
                           "fallback_routing": e.moe_fallback_routing,
                           "replica_routing": e.eplb_replica_routing,
                           **eng.tele.serving_summary()}
        # capacity without fallback drops rows, with fallback re-routes them: both change outputs
        out["outputs_exact"] = e.moe_capacity_mode == "none"
        out["quantization"] = quant_info(eng.cfg.model.model, eng.cfg.model.fp8_dequant_cache)
        out["workload"] = workload_status(eng.cfg.serve)   # bench prints it in its header
        return out
