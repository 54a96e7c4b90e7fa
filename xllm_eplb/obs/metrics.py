"""Every Prometheus metric of xllm-eplb, in one ``CollectorRegistry`` owned by the engine.

Workers export nothing themselves: their counters, timings and heartbeats travel in each
``ForwardOutput`` and the engine records them here. Names start with ``xllm_eplb_``, use base
units (seconds, bytes, ratio) and counters end in ``_total``. Per-layer series exist only with
``--enable_per_layer_metrics`` (cardinality: layers x ...).
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

PREFIX = "xllm_eplb_"
_FAST = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_SLOW = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_LATENCY = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_TOKEN = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
          1.0, 2.5, 5.0)
_COUNT = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
#: heartbeat components of the control plane and of each worker (the `EPLB heartbeat` log
#: lines name the same components, docs/serving.md)
HEARTBEAT_COMPONENTS = ("rebalance_loop", "manager", "executor", "p2p")
#: label values of ``steps_total{kind}`` and ``requests_total{result}``
STEP_KINDS = ("warmup", "prefill", "decode", "mixed", "idle")
REQUEST_RESULTS = ("stop", "length", "cancelled", "error")



class _Aliased:
    """A gauge and its deprecated old name (kept one release), always set together."""

    def __init__(self, gauge, old):
        self.gauge, self.old = gauge, old

    def set(self, value) -> None:
        self.gauge.set(value)
        self.old.set(value)

class EngineMetrics:
    """The engine's metric families. ``ep_size`` ranks, ``num_layers`` MoE layers."""

    def __init__(self, ep_size: int, num_layers: int, *, per_layer: bool = False,
                 version: str = "", backend: str = "", policy: str = "",
                 hot_experts: int = 0, all_experts: bool = False):
        self.registry = CollectorRegistry(auto_describe=True)
        self.ep_size, self.num_layers, self.per_layer = ep_size, num_layers, per_layer
        self._last: dict[str, float] = {}
        self._define_info(version, backend, policy)
        self._define_balance()
        self._define_rebalance()
        self._define_transfer()
        self._define_serving()
        self._define_live()
        self._define_experts(hot_experts, all_experts)
        self._define_health()
        self._define_elastic()

    # --- definitions ---------------------------------------------------------------------
    def _g(self, name, doc, labels=()):
        return Gauge(PREFIX + name, doc, labels, registry=self.registry)

    def _c(self, name, doc, labels=()):
        return Counter(PREFIX + name, doc, labels, registry=self.registry)

    def _h(self, name, doc, buckets, labels=()):
        return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=self.registry)

    def _define_info(self, version, backend, policy):
        self.build_info = self._g("build_info", "build metadata (value 1)",
                                  ("version", "backend", "policy"))
        self.build_info.labels(version, backend, policy).set(1)
        self.ep_size_g = self._g("ep_size", "EP ranks (= worker processes)")
        self.ep_size_g.set(self.ep_size)
        self.enabled = self._g("eplb_enabled", "1 when dynamic EPLB is on")

    def _define_balance(self):
        self.balancedness = self._g(
            "balancedness_ratio", "per MoE layer mean/max rank load over the recent load "
            "window, then min or mean over layers", ("stat",))
        self.peak_over_ideal = self._g("peak_over_ideal_ratio", "max over layers of slowest "
                                       "rank load / mean rank load (recent window)")
        self.rank_tokens = self._c("rank_tokens", "routed token-expert pairs computed by the "
                                   "rank's physical slots (MoE layers summed)", ("rank",))
        self.layer_balancedness = (self._g("layer_balancedness_ratio", "mean/max rank load "
                                           "of one MoE layer (recent window)", ("layer",))
                                   if self.per_layer else None)
        self.moe_critical_path = self._c(
            "moe_critical_path_seconds", "sum over MoE layers of the slowest rank's expert "
            "compute CPU time")
        self.moe_compute = self._c("moe_compute_seconds", "expert compute CPU time per rank",
                                   ("rank",))

    def _define_rebalance(self):
        self.rounds = self._c("rebalance_rounds", "policy rounds completed")
        self.layers = self._c("rebalance_layers", "layers by outcome: published (passed the "
                              "gate), committed (activated on all ranks), timed_out (rolled "
                              "back), regressed (measured slower after the commit), "
                              "rolled_back (restored after a regression)", ("result",))
        self.policy_seconds = self._h("policy_duration_seconds", "one policy round (all "
                                      "layers), background thread", _SLOW)
        self.rebalancing = self._g("rebalancing", "1 while a layer is being prepared or "
                                   "activated")
        self.placement_epoch = _Aliased(
            self._g("placement_epoch", "EPLB placement epoch: layer activations committed so "
                    "far"),
            self._g("placement_generation", "DEPRECATED (removed next release): "
                    "xllm_eplb_placement_epoch"))
        self.slots_moved = self._c("slots_moved", "physical slots whose expert changed")

    def _define_transfer(self):
        self.update_seconds = self._h(
            "update_expert_weight_seconds", "worker-side weight switch per layer and rank",
            _FAST, ("phase",))
        self.transfer_seconds = self._h("transfer_duration_seconds", "P2P transfer of one "
                                        "layer on one rank, start to wait done", _FAST)
        self.prepare_seconds = self._h("prepare_duration_seconds", "worker background "
                                       "prepare of one layer", _FAST)
        self.p2p_bytes = self._c("p2p_bytes", "expert-weight bytes moved by P2P",
                                 ("direction",))
        # --- multi-node (#14) ---
        self.p2p_cross_node_bytes = self._c(
            "p2p_cross_node_bytes", "expert-weight bytes a node received from ranks on other "
            "nodes (single node: 0)", ("node",))

    def _define_serving(self):
        self.steps = self._c("steps", "forward steps by kind", ("kind",))
        self.step_seconds = self._h("step_duration_seconds", "engine step: write input to "
                                    "last output", _FAST)
        self.step_phase = self._c("step_phase_seconds", "engine step-loop wall seconds by "
                                  "phase: the slowest rank's forward phases, ring, eplb_hooks, "
                                  "schedule, telemetry, http, idle (/eplb/status "
                                  "step_breakdown)", ("phase",))
        self.requests = self._c("requests", "finished requests", ("result",))
        self.generated = self._c("generated_tokens", "output tokens")
        self.prompt_tokens = self._c("prompt_tokens", "prefilled prompt tokens")
        self.latency = self._h("request_latency_seconds", "arrival to last token", _LATENCY)
        self.ttft = self._h("time_to_first_token_seconds", "arrival to first token", _LATENCY)
        self.queue = self._g("requests_in_queue", "requests by state", ("state",))
        # --- capacity and fallback (#16) ---
        self.tokens_dropped = self._c("moe_tokens_dropped", "routed rows (top-k occurrences) "
                                      "dropped by expert capacity")
        self.tokens_rerouted = self._c("moe_tokens_rerouted", "routed rows the capacity "
                                       "fallback sent to another expert")
        self.util_cv = self._g("expert_utilisation_cv", "last step: standard deviation over "
                               "physical slots of their load, over the mean (mean over layers)")
        self.comm_share = self._g("comm_share", "recent steps: worker seconds blocked on "
                                  "communication over worker step seconds")

    def _define_live(self):
        """vLLM-style serving metrics (#27): per-token latencies, queueing, step shape, KV."""
        self.tpot = self._h("time_per_output_token_seconds", "per finished request: (last "
                            "token - first token) / (output tokens - 1)", _TOKEN)
        self.itl = self._h("inter_token_latency_seconds", "gap between two consecutive output "
                           "tokens of one request (engine side)", _TOKEN)
        self.queue_time = self._h("request_queue_time_seconds", "arrival to the first "
                                  "scheduled prefill", _LATENCY)
        self.batch_size = self._h("batch_size", "rows (requests) per forward step, all ranks",
                                  _COUNT)
        self.step_tokens = self._h("tokens_per_step", "tokens per forward step, all ranks "
                                   "(prefill tokens + one per decode row)", _COUNT)
        self.kv_usage = self._g("kv_cache_usage_ratio", "tokens held in the running requests' "
                                "KV caches / (ep_size x max_batch_size x "
                                "max_position_embeddings), the most the scheduler can hold")
        self.kv_tokens = self._g("kv_cache_tokens", "tokens held in the running requests' KV "
                                 "caches, all ranks")

    def _define_experts(self, hot: int, every: bool):
        """Per-layer expert view with bounded cardinality: the ``hot`` hottest logical experts
        of each MoE layer by recent load (labels ``layer``, ``hot`` = 0..hot-1: layers x hot
        series whatever experts are hot), and, opt-in, every expert (layers x experts)."""
        self.hot_experts, self.all_experts = hot, every
        self.hot_load = self.hot_id = self.hot_replicas = None
        self.expert_load = self.expert_replicas = None
        if hot > 0:
            lab = ("layer", "hot")
            self.hot_load = self._g("hot_expert_load_ratio", "recent load of the hot-th "
                                    "hottest logical expert of the layer / the layer's mean "
                                    "expert load", lab)
            self.hot_id = self._g("hot_expert_id", "logical expert id of the hot-th hottest "
                                  "expert of the layer", lab)
            self.hot_replicas = self._g("hot_expert_replicas", "physical replicas (slots) of "
                                        "the hot-th hottest expert of the layer", lab)
        if every:
            lab = ("layer", "expert")
            self.expert_load = self._g("expert_load_ratio", "recent load of the logical expert "
                                       "/ the layer's mean expert load", lab)
            self.expert_replicas = self._g("expert_replicas", "physical replicas (slots) of "
                                           "the logical expert", lab)

    def set_experts(self, load, replicas) -> None:
        """``load`` float [layers, experts] recent token-expert picks per logical expert,
        ``replicas`` int [layers, experts] slots holding it: the expert gauges."""
        for layer in range(len(load)):
            row, reps = load[layer], replicas[layer]
            mean = float(row.mean()) if len(row) else 0.0
            ratio = row / mean if mean > 0 else row * 0.0
            lay = str(layer)
            if self.hot_load is not None:
                order = sorted(range(len(row)), key=lambda e: (-row[e], e))[:self.hot_experts]
                for k, e in enumerate(order):
                    self.hot_load.labels(lay, str(k)).set(float(ratio[e]))
                    self.hot_id.labels(lay, str(k)).set(e)
                    self.hot_replicas.labels(lay, str(k)).set(int(reps[e]))
            if self.expert_load is not None:
                for e in range(len(row)):
                    self.expert_load.labels(lay, str(e)).set(float(ratio[e]))
                    self.expert_replicas.labels(lay, str(e)).set(int(reps[e]))

    def _define_health(self):
        self.worker_up = self._g("worker_up", "1 while the rank answers forward steps",
                                 ("rank",))
        self.rank_node = self._g("rank_node", "the node (machine) that runs each EP rank",
                                 ("rank",))
        self.heartbeat_age = self._g(
            "heartbeat_age_seconds", "seconds since the component last reported progress "
            "(rank=engine for engine-side components)", ("component", "rank"))
        self.ring_full = self._c("ring_full", "writes that found the ring full and had to "
                                 "wait (back-pressure)", ("ring",))
        self.ring_occupancy = self._g("ring_occupancy_ratio", "frames in use / ring slots",
                                      ("ring",))
        for r in range(self.ep_size):
            self.worker_up.labels(str(r)).set(0)
        self._zero_series()

    def _define_elastic(self):
        """``--elastic_ep`` (#23): membership and recoveries (elastic/recovery.py)."""
        self.rank_active = self._g("rank_active", "1 while the EP rank is a member of the "
                                   "current process-group generation", ("rank",))
        self.pg_generation = _Aliased(
            self._g("pg_generation", "membership (process-group) generation: 1 at start, +1 "
                    "per elastic re-formation (respawn, shrink, rejoin)"),
            self._g("generation", "DEPRECATED (removed next release): xllm_eplb_pg_generation"))
        self.recovery_seconds = self._h("recovery_seconds", "elastic recovery: death detected "
                                        "-> ranks re-formed", (0.1, 0.25, 0.5, 1, 2, 3, 5, 10,
                                                              30, 60))
        self.reprefilled = self._c("requests_reprefilled", "requests of a dead rank re-prefilled "
                                   "from prompt + output (the survivors' keep their KV cache)")
        self.experts_reloaded = self._c("experts_reloaded", "expert slots loaded again after a "
                                        "rank died, by source", ("source",))
        self.rejoins = self._c("rejoins", "elastic rejoins: replacement workers that joined "
                               "or were dropped (not ready in time, or dead while loading), and "
                               "switches abandoned (a death during the switch)",
                               ("outcome",))
        self.rejoin_seconds = self._h("rejoin_seconds", "elastic rejoin: joiner start -> "
                                      "serving", (1, 2, 5, 10, 20, 30, 60, 120))
        self.pg_generation.set(1)
        for r in range(self.ep_size):
            self.rank_active.labels(str(r)).set(1)
        for source in ("replica", "checkpoint"):
            self.experts_reloaded.labels(source)
        for outcome in ("joined", "dropped", "abandoned"):
            self.rejoins.labels(outcome)

    def _zero_series(self) -> None:
        """Create every labelled series whose label values are known up front, so a counter
        that is still 0 is exported as 0 (dashboards show 0, not "No data")."""
        for ring in ("input", "output"):
            self.ring_full.labels(ring)
        self.ring_occupancy.labels("output")
        for kind in STEP_KINDS:
            self.steps.labels(kind)
        for result in REQUEST_RESULTS:
            self.requests.labels(result)
        for result in ("published", "committed", "timed_out", "regressed", "rolled_back"):
            self.layers.labels(result)
        self.p2p_bytes.labels("sent")
        for phase in ("materialize", "transfer", "activation", "total"):
            self.update_seconds.labels(phase)
        for state in ("waiting", "running"):
            self.queue.labels(state)
        for r in range(self.ep_size):
            self.rank_tokens.labels(str(r))
            self.moe_compute.labels(str(r))

    # --- updates -------------------------------------------------------------------------
    def inc_to(self, key: str, counter, total: float) -> None:
        """Advance ``counter`` to the cumulative value ``total`` (sources keep totals)."""
        delta = float(total) - self._last.get(key, 0.0)
        if delta > 0:
            counter.inc(delta)
            self._last[key] = float(total)

    def set_balance(self, per_layer) -> None:
        """``per_layer``: balancedness [layers] of the recent window (from ``eplb/balance``)."""
        if len(per_layer) == 0:
            return
        self.balancedness.labels("min").set(float(min(per_layer)))
        self.balancedness.labels("mean").set(float(sum(per_layer) / len(per_layer)))
        self.peak_over_ideal.set(float(max(1.0 / max(b, 1e-12) for b in per_layer)))
        if self.layer_balancedness is not None:
            for layer, b in enumerate(per_layer):
                self.layer_balancedness.labels(str(layer)).set(float(b))

    def render(self) -> bytes:
        """Prometheus text exposition of the registry."""
        return generate_latest(self.registry)


def metric_names(registry: CollectorRegistry) -> set[str]:
    """Every sample name the registry can expose (``_total``, ``_bucket``... included) and
    every family name: what a dashboard expression may reference."""
    names: set[str] = set()
    for fam in registry.collect():
        names.add(fam.name)
        if fam.type == "counter":
            names.update({fam.name + "_total", fam.name + "_created"})
        if fam.type == "histogram":
            names.update(fam.name + s for s in ("_bucket", "_sum", "_count", "_created"))
        names.update(s.name for s in fam.samples)
    return names
