"""What the engine learns from each step's outputs: recent rank loads (balancedness), MoE
critical path, EPLB progress, worker health. Feeds :class:`~xllm_eplb.obs.metrics.EngineMetrics`
and the ``/eplb/status`` JSON. Step-loop thread writes; HTTP threads read under a lock.
"""

from __future__ import annotations

import collections
import threading
import time

import numpy as np

from xllm_eplb.eplb import counters as counter_format
from xllm_eplb.eplb.balance import balancedness
from xllm_eplb.ipc.records import WorkerHeartbeat
from xllm_eplb.obs.metrics import EngineMetrics

#: steps in the recent load window behind ``balancedness_*``
RECENT_STEPS = 64


class RecentLoad:
    """Sliding sum of per-step rank loads ``[layers, ranks]`` over the last ``steps`` steps."""

    def __init__(self, num_layers: int, ep_size: int, steps: int = RECENT_STEPS):
        self.window: collections.deque = collections.deque(maxlen=steps)
        self.total = np.zeros((num_layers, ep_size), dtype=np.int64)

    def add(self, rank_loads: np.ndarray) -> None:
        if len(self.window) == self.window.maxlen:
            self.total -= self.window[0]
        self.window.append(rank_loads)
        self.total += rank_loads

    @property
    def full(self) -> bool:
        return len(self.window) == self.window.maxlen

    def per_layer(self) -> np.ndarray:
        """Balancedness (mean/max over ranks) of every layer, float64 [layers]."""
        return balancedness(self.total)


def slot_loads(outputs) -> np.ndarray:
    """The step's served rows per physical slot, int [L, D*S] (ranks' slots side by side)."""
    return np.concatenate([counter_format.decode(o.counters) for o in outputs], axis=1)


def rank_loads(counters: list[np.ndarray]) -> np.ndarray:
    """Per-rank prefix-sum counters ``[L, S]`` -> tokens per rank ``[L, D]`` (last column)."""
    return np.stack([counter_format.totals(c) for c in counters], axis=1)


class ServingStats:
    """Seed-style serving numbers (#16): dropped / re-routed rows, expert-utilisation spread per
    step, recent step latencies (P50/P99) and the communication share of worker step time."""

    def __init__(self, steps: int = 1024):
        self.lat: collections.deque = collections.deque(maxlen=steps)
        self.dropped = self.rerouted = self.served = 0
        self.cv_sum, self.cv_steps, self.cv_last = 0.0, 0, 0.0
        self.comm_s = self.step_s = 0.0

    def add(self, outputs, slot_loads: np.ndarray, seconds: float) -> float:
        """One non-warm-up step: ``slot_loads`` [L, D*S] served rows. -> the step's
        utilisation std/mean (mean over layers with load)."""
        self.lat.append(seconds)
        self.dropped += sum(o.timings.dropped for o in outputs)
        self.rerouted += sum(o.timings.rerouted for o in outputs)
        self.served += int(slot_loads.sum())
        self.comm_s += sum(o.timings.comm_s for o in outputs)
        self.step_s += sum(o.timings.step_s for o in outputs)
        mean = slot_loads.mean(axis=1)
        live = mean > 0
        if live.any():
            self.cv_last = float((slot_loads[live].std(axis=1) / mean[live]).mean())
            self.cv_sum += self.cv_last
            self.cv_steps += 1
        return self.cv_last

    @property
    def comm_share(self) -> float:
        """The communication share of the workers' step time so far (per step: no quantiles)."""
        return self.comm_s / self.step_s if self.step_s > 0 else 0.0

    def summary(self) -> dict:
        lat = np.asarray(self.lat, dtype=np.float64)
        asked = self.served + self.dropped
        return {"tokens_dropped": self.dropped, "tokens_rerouted": self.rerouted,
                "drop_rate": self.dropped / asked if asked else 0.0,
                "reroute_rate": self.rerouted / asked if asked else 0.0,
                "expert_utilisation_cv_mean": self.cv_sum / self.cv_steps if self.cv_steps
                else 0.0, "expert_utilisation_cv_last": self.cv_last,
                "step_p50_s": float(np.percentile(lat, 50)) if lat.size else 0.0,
                "step_p99_s": float(np.percentile(lat, 99)) if lat.size else 0.0,
                "comm_share": self.comm_share}


def critical_path(outputs) -> tuple[float, float, int]:
    """(sum over MoE layers of the slowest rank's expert CPU seconds, sum over layers and ranks
    of expert CPU seconds, layers) from the workers' ``timings.expert_cpu_s`` [L_moe]."""
    per = [o.timings.expert_cpu_s for o in outputs]
    if not per or not per[0]:
        return 0.0, 0.0, 0
    if any(len(p) != len(per[0]) for p in per):
        raise ValueError(f"expert_cpu_s lengths differ across ranks: {[len(p) for p in per]}")
    a = np.asarray(per, dtype=np.float64)                   # [D, L_moe]
    return float(a.max(axis=0).sum()), float(a.sum()), a.shape[1]


class Telemetry:
    """Step accounting for one engine."""

    def __init__(self, metrics: EngineMetrics, num_layers: int, ep_size: int,
                 ranks_per_node: int | None = None):
        self.m, self.L, self.D = metrics, num_layers, ep_size
        #: EP ranks per node (multi-node runs; default: one node)
        self.ranks_per_node = ranks_per_node or ep_size
        self.lock = threading.Lock()
        self.recent = RecentLoad(num_layers, ep_size)
        self.initial_balance: np.ndarray | None = None
        self.steps = collections.Counter()
        self.cp = dict(critical_s=0.0, expert_cpu_s=0.0, steps=0, decode_steps=0,
                       decode_critical_s=0.0, decode_expert_cpu_s=0.0, forward_cpu_s=0.0,
                       routed_tokens=0, eplb_engine_s=0.0, eplb_worker_s=0.0,
                       moe_s=0.0, comm_s=0.0, route_s=0.0, moe_cpu_s=0.0,
                       elastic_engine_s=0.0, elastic_idle_s=0.0, elastic_idle_wakes=0)
        self.exec_seen = [0] * ep_size
        self.prep_seen = [0] * ep_size
        self.last_output_at = [0.0] * ep_size
        self.hb: dict[int, WorkerHeartbeat] = {}
        self.eplb: dict = {}
        #: monotonic time of the last committed activation (the stats line's last rebalance)
        self.last_commit_at: float | None = None
        self.serving = ServingStats()

    def resize(self, ep_size: int) -> None:
        """A new membership of ``ep_size`` ranks (elastic shrink or grow, one node): the per-rank
        views start over; the run's totals (critical path, step counts, serving stats, EPLB
        stats, last commit) are kept."""
        with self.lock:
            self.D = self.ranks_per_node = ep_size
            self.recent = RecentLoad(self.L, ep_size)
            self.initial_balance = None
            self.exec_seen, self.prep_seen = [0] * ep_size, [0] * ep_size
            self.last_output_at = [0.0] * ep_size
            self.hb = {}

    # --- per step --------------------------------------------------------------------------
    def on_step(self, kind: str, outputs, seconds: float, eplb_engine_s: float = 0.0) -> None:
        """``kind``: warmup / prefill / decode / mixed / idle; ``eplb_engine_s``: step-loop CPU
        spent in the manager's calls."""
        m = self.m
        m.steps.labels(kind).inc()
        m.step_seconds.observe(seconds)
        now = time.monotonic()
        for o in outputs:
            m.worker_up.labels(str(o.rank)).set(1)
            self.last_output_at[o.rank] = now
            self.hb[o.rank] = o.heartbeat
            self._executor(o)
        if kind == "warmup" or not outputs or outputs[0].counters.size == 0:
            return
        loads = rank_loads([o.counters for o in outputs])
        for r, n in enumerate(loads.sum(axis=0)):
            if n:
                m.rank_tokens.labels(str(r)).inc(int(n))
        crit, total, _ = critical_path(outputs)
        m.moe_critical_path.inc(crit)
        slots = slot_loads(outputs)
        m.tokens_dropped.inc(sum(o.timings.dropped for o in outputs))
        m.tokens_rerouted.inc(sum(o.timings.rerouted for o in outputs))
        for o in outputs:
            m.moe_compute.labels(str(o.rank)).inc(sum(o.timings.expert_cpu_s))
        with self.lock:
            self.recent.add(loads)
            self._count_cp(kind, crit, total)
            self.cp["forward_cpu_s"] += sum(o.timings.cpu_s for o in outputs)
            self.cp["eplb_worker_s"] += sum(o.timings.eplb_s for o in outputs)
            self.cp["eplb_engine_s"] += eplb_engine_s
            for key in ("moe_s", "comm_s", "route_s", "moe_cpu_s"):   # summed over ranks
                self.cp[key] += sum(getattr(o.timings, key) for o in outputs)
            self.cp["routed_tokens"] += int(loads.sum())
            m.util_cv.set(self.serving.add(outputs, slots, seconds))
            m.comm_share.set(self.serving.comm_share)
            per = self.recent.per_layer()
            if self.initial_balance is None and self.recent.full:
                self.initial_balance = per.copy()
        m.set_balance(per)

    def on_elastic(self, seconds: float, idle: bool = False) -> None:
        """``--elastic_ep`` (no fault: its steady-state cost): step-loop CPU in code that runs
        only because of elasticity: the membership check at each step boundary and the
        silent-rank check between output slices (``elastic_engine_s``); ``idle``: one idle
        iteration of the loop, whole, but for the once-a-second refresh (``elastic_idle_s``,
        ``elastic_idle_wakes``: it wakes every ``ELASTIC_IDLE_WAIT`` s, not every
        ``IDLE_WAIT`` s)."""
        with self.lock:
            self.cp["elastic_idle_s" if idle else "elastic_engine_s"] += seconds
            self.cp["elastic_idle_wakes"] += int(idle)

    def _count_cp(self, kind: str, crit: float, total: float) -> None:
        c = self.cp
        c["critical_s"] += crit
        c["expert_cpu_s"] += total
        c["steps"] += 1
        if kind == "decode":
            c["decode_steps"] += 1
            c["decode_critical_s"] += crit
            c["decode_expert_cpu_s"] += total

    def _executor(self, o) -> None:
        """Observe each new prepare and activation of rank ``o.rank`` (its executor stats)."""
        ex, m = o.heartbeat.executor, self.m
        if ex.prepares_ok > self.prep_seen[o.rank]:
            self.prep_seen[o.rank] = ex.prepares_ok
            m.prepare_seconds.observe(ex.last_prepare_ms / 1e3)
        if ex.activations <= self.exec_seen[o.rank]:
            return
        self.exec_seen[o.rank] = ex.activations
        for phase, ms in (("materialize", ex.last_materialize_ms),
                          ("transfer", ex.last_transfer_ms),
                          ("activation", ex.last_activation_ms), ("total", ex.last_total_ms)):
            m.update_seconds.labels(phase).observe(ms / 1e3)
        m.transfer_seconds.observe(ex.last_transfer_ms / 1e3)
        m.inc_to(f"p2p{o.rank}", m.p2p_bytes.labels("sent"), float(ex.p2p_bytes_total))
        node = str(o.rank // self.ranks_per_node)
        m.inc_to(f"xnode{o.rank}", m.p2p_cross_node_bytes.labels(node),
                 float(ex.p2p_cross_node_bytes_total))

    def on_requests(self, finished) -> None:
        m = self.m
        for r in finished:
            m.requests.labels(r.finish_reason or "unknown").inc()
            m.generated.inc(len(r.output))
            m.prompt_tokens.inc(len(r.prompt))
            m.latency.observe(r.finished_at - r.arrival)
            if r.first_token_at:
                m.ttft.observe(r.first_token_at - r.arrival)

    # --- EPLB ------------------------------------------------------------------------------
    def on_eplb(self, st: dict) -> None:
        """Manager ``stats()`` -> counters (the manager keeps cumulative totals)."""
        m = self.m
        m.inc_to("rounds", m.rounds, st.get("rounds", 0))
        for key, label in (("layers_published", "published"), ("layers_committed", "committed"),
                           ("layers_timed_out", "timed_out"), ("layers_regressed", "regressed"),
                           ("layers_rolled_back", "rolled_back")):
            m.inc_to(key, m.layers.labels(label), st.get(key, 0))
        m.inc_to("slots_moved", m.slots_moved, st.get("slots_moved", 0))
        if st.get("placement_epoch", 0) > self.eplb.get("placement_epoch", 0):
            self.last_commit_at = time.monotonic()
        rounds_before = self.eplb.get("rounds", 0)
        if st.get("rounds", 0) > rounds_before:
            m.policy_seconds.observe(float(st.get("last_policy_seconds", 0.0)))
        m.placement_epoch.set(st.get("placement_epoch", 0))
        m.rebalancing.set(1 if st.get("layer_in_flight", -1) not in (-1, None) else 0)
        with self.lock:
            self.eplb = dict(st)

    def refresh_health(self, worker_timeout: float, silent: list[int] = ()) -> None:
        """Heartbeat ages from the components' own timestamps: the manager's ``heartbeat_at``
        (rebalance loop's last pass) and ``manager_heartbeat_at`` (its last step-loop call), in
        the manager's clock (``time.monotonic``); each rank's executor ``heartbeat_ts`` (prepare
        thread) and ``p2p_heartbeat_ts`` (P2P path), in wall-clock seconds, and its output
        ``ts``. A component without a timestamp (EPLB off: no manager, null executor; 0 in a heartbeat) gets no
        gauge. Called at scrape time, so the ages grow while a step hangs; ``silent``: ranks a
        stalled step waits on (their ``worker_up`` drops to 0 until they answer again)."""
        now_m, now_w, m = time.monotonic(), time.time(), self.m
        st = self.eplb
        for r in silent:
            m.worker_up.labels(str(r)).set(0)
        for comp, key in (("rebalance_loop", "heartbeat_at"), ("manager", "manager_heartbeat_at")):
            if st.get(key) is not None:
                m.heartbeat_age.labels(comp, "engine").set(max(0.0, now_m - float(st[key])))
        for r, hb in list(self.hb.items()):
            for comp, ts in (("executor", hb.executor.heartbeat_ts),
                             ("p2p", hb.executor.p2p_heartbeat_ts), ("worker", hb.ts)):
                if ts > 0.0:                                # the null executor reports 0
                    m.heartbeat_age.labels(comp, str(r)).set(max(0.0, now_w - ts))

    # --- status ----------------------------------------------------------------------------
    def balancedness_mean(self) -> float | None:
        """Mean over MoE layers of the recent window's balancedness (None before a step)."""
        with self.lock:
            return float(self.recent.per_layer().mean()) if self.recent.window else None

    def balance_summary(self) -> dict:
        with self.lock:
            per = self.recent.per_layer()
            init = self.initial_balance
            have = bool(self.recent.window)
        out = {"balancedness_mean": float(per.mean()) if have else None,
               "balancedness_min": float(per.min()) if have else None,
               "layers": [{"layer": i, "balancedness": float(b)} for i, b in enumerate(per)]
               if have else [],
               "balancedness_window_steps": len(self.recent.window)}
        if init is not None:
            out.update(initial_balancedness_mean=float(init.mean()),
                       initial_balancedness_min=float(init.min()))
        return out

    def serving_summary(self) -> dict:
        with self.lock:
            return self.serving.summary()

    def critical_path_summary(self) -> dict:
        with self.lock:
            return dict(self.cp)


def balance_note(st: dict, plan_on: str) -> str | None:
    """Why ``balancedness_mean`` is below ``initial_balancedness_mean`` in ``st`` (the
    /eplb/status dict), or None when it is not."""
    now, first = st.get("balancedness_mean"), st.get("initial_balancedness_mean")
    if now is None or first is None or now >= first:
        return None
    why = []
    if not st.get("enabled"):
        why.append("EPLB is off: the placement never changes")
    elif plan_on == "cost":
        why.append("rounds plan on the modelled step critical path (--eplb_plan_on=cost: "
                   "expert seconds, a fixed cost per active slot plus one per row), not on "
                   "token counts: a shorter critical path may count tokens less evenly")
    if st.get("layers_rolled_back"):
        why.append(f"{st['layers_rolled_back']} layer activations were rolled back after being "
                   f"measured slower (cost_model.rollbacks says why)")
    if st.get("enabled") and not st.get("layers_committed"):
        why.append("no layer was committed yet")
    why.append(f"the load moved: the initial figure is the first {RECENT_STEPS} steps' window, "
               f"this one the last {RECENT_STEPS} steps'")
    return f"balancedness {now:.4f} is below the initial {first:.4f}: " + "; ".join(why)
