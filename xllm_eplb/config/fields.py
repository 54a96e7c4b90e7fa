"""The config sections: one frozen dataclass per section, every field built by :func:`opt`
(its help, unit, bounds and choices), and :class:`Config`, the tree of them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from xllm_eplb.config.layout import rank_slots

MiB = 1 << 20
GiB = 1 << 30


def opt(default: Any, help: str, *, unit: str = "", lo: float | None = None,
        hi: float | None = None, lo_open: bool = False, hi_open: bool = False,
        choices: tuple | None = None, required: bool = False) -> Any:
    """A config field with its metadata (help, unit, inclusive/exclusive bounds, choices)."""
    meta = dict(help=help, unit=unit, lo=lo, hi=hi, lo_open=lo_open, hi_open=hi_open,
                choices=choices, required=required)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class EplbConfig:
    """xLLM's EPLB options (the same flag names) plus this project's extensions."""

    enable_eplb: bool = opt(True, "dynamic EPLB (on by default; --enable_eplb=false turns it "
                            "off: the initial placement is served as is)")
    ep_size: int = opt(None, "number of EP ranks = worker processes; divides num_experts; 1 = "
                       "one rank holding every expert, EPLB off and no redundant slot (the "
                       "engine's own baseline)", lo=1, required=True)
    redundant_experts_num: int = opt(1, "extra physical slots per EP rank", lo=0)
    eplb_update_interval: float = opt(1000.0, "seconds from the first valid load sample between "
                                      "rebalances (fractions allowed)", unit="s", lo=0)
    eplb_first_round_samples: int = opt(
        256, "the first round runs as soon as the load window holds this many samples (engine "
        "steps with load) or eplb_update_interval elapsed, whichever comes first; the interval "
        "paces the later rounds; 0: the first round waits the interval too (xLLM)",
        unit="samples", lo=0)
    eplb_min_peak_load_improvement: float = opt(
        0.05, "minimum predicted relative drop of the slowest rank's load to publish a layer",
        lo=0, hi=1)
    eplb_policy_kind: str = opt(
        "incremental", "placement policy: incremental (default: moves few slots per round), "
        "balanced (xLLM's full re-plan), greedy, node_aware "
        "(case-insensitive; legacy names flat/deepseek_flat/deepseek_hier/hier/hierarchical map "
        "to balanced; unknown -> greedy with one warning)")
    eplb_plan_on: str = opt(
        "cost", "what rounds plan and gate on: cost (a per-layer model fitted from the workers' "
        "expert timings: fixed seconds per active slot + seconds per row; the policy's rows, "
        "the deployed row and a row packed on the model are searched on the modelled step "
        "critical path (swaps before splits), the lowest wins, and a layer is published only if that path falls by "
        "eplb_min_peak_load_improvement; rounds wait for the fitted model, token counts when "
        "no timings arrive; a layer measured slower after its commit is rolled back) or "
        "tokens (token counts only, as xLLM)", choices=("cost", "tokens"))
    eplb_use_decode_only_load: bool = opt(
        False, "eager path counts only real decode tokens (prefill rows of mixed batches are masked)")
    eplb_prepare_timeout_seconds: float = opt(
        30.0, "all ranks must prepare a layer within this many seconds, else it is skipped and "
        "rolled back", unit="s", lo=0, lo_open=True)
    expert_parallel_degree: int = opt(0, "2 selects the EP-level-2 dispatch/combine path",
                                      choices=(0, 1, 2))
    enable_fused_mc2: int = opt(-1, "fused dispatch mode: -1 auto, 0 plain, 1 fused, "
                                "2 decode-only fused", choices=(-1, 0, 1, 2))
    # --- beyond the seed -------------------------------------------------------------------
    eplb_replica_routing: str = opt(
        "static", "which replica of a replicated expert serves each routed token: static "
        "(xLLM's fixed source-rank rule), spread (each source splits evenly over the replicas), "
        "balanced (per step, the min-max split of the step's exchanged counts; identical on "
        "every rank); replicas hold identical weights, so outputs never change",
        choices=("static", "spread", "balanced"))
    eplb_migration_budget_slots: int = opt(
        0, "incremental policy: max cross-rank slot copies per round over all layers (0 = auto)",
        lo=0)
    eplb_num_nodes: int = opt(1, "node_aware policy: nodes in the EP domain (divides ep_size; "
                              "with --nnodes > 1 the default 1 becomes nnodes)", lo=1)
    eplb_use_estimator: bool = opt(
        False, "feed the policy the EasyBalance estimate (window/decay/trend) instead of the raw "
        "load window; the publication gate always uses the raw window")
    eplb_estimator_window: int = opt(16, "load estimator: sliding window in batches", lo=1)
    eplb_estimator_decay: float = opt(0.85, "load estimator: exponential decay per batch",
                                      lo=0, hi=1, lo_open=True)
    eplb_estimator_trend: bool = opt(False, "load estimator: linear trend extrapolation")
    eplb_p2p_chunk_bytes: int = opt(64 * MiB, "P2P: split tensors larger than this",
                                    unit="bytes", lo=1)
    eplb_p2p_max_inflight_bytes: int = opt(256 * MiB, "P2P: max payload posted per wave",
                                           unit="bytes", lo=1)
    eplb_canary: bool = opt(False, "after each activation check every slot's identity tag "
                            "(always on in tests)")
    eplb_heartbeat_seconds: float = opt(60.0, "period of `EPLB heartbeat` log lines", unit="s",
                                        lo=0, lo_open=True)
    # --- record -> plan -> deploy ---------------------------------------------------------
    eplb_init_placement: str = opt(
        "", "start from this placement (a `xllm-eplb plan --output` JSON) instead of xLLM's "
        "initial layout; checked before start (shape, experts, ep_size, slots, every expert "
        "placed); EPLB off: served as is, EPLB on: rebalancing continues from it")
    eplb_record_trace_max_steps: int = opt(
        4096, "expert-distribution recording (POST /eplb/record/start with trace=true): most "
        "steps kept in the per-step trace (int32 [steps, layers, experts] in memory); the "
        "totals keep counting beyond it", lo=1)
    # --- noise-aware placement (issue 15) ---
    eplb_peak_z: float = opt(
        0.0, "incremental policy: plan for the per-step peak, each expert weighted by its "
        "expected per-step count + this many standard deviations (0 = plan on the mean; needs "
        "eplb_step_tokens)", lo=0)
    eplb_step_tokens: int = opt(
        0, "incremental policy with eplb_peak_z > 0: routed tokens (top-k occurrences) per "
        "forward step over all EP ranks", lo=0)
    # --- capacity and fallback (#16) -----------------------------------------------------
    moe_capacity_mode: str = opt(
        "none", "expert capacity per step and logical expert: none (never drop), static "
        "(ceil(factor x tokens x top_k / experts) each), dynamic (that total shared in "
        "proportion to the step's load, each at least half of it); rows over capacity are "
        "dropped for that expert (or re-routed with moe_fallback_routing)",
        choices=("none", "static", "dynamic"))
    moe_capacity_factor: float = opt(1.25, "expert capacity factor (moe_capacity_mode static / "
                                     "dynamic)", lo=0, lo_open=True)
    moe_fallback_routing: bool = opt(
        False, "a row whose expert is full goes to the token's next choice, then to the "
        "least-loaded expert with room, and is dropped only when all are full; CHANGES "
        "OUTPUTS (explicit opt-in; needs moe_capacity_mode static or dynamic)")


@dataclass(frozen=True)
class ModelConfig:
    """The model the workers run. With ``--model DIR`` its config.json sets the architecture
    fields below; without, a Hugging Face-format checkpoint of family ``model_arch`` is
    generated once from them into ``model_cache_dir`` and served the same way
    (docs/checkpoints.md)."""

    num_layers: int = opt(4, "decoder layers (dense + MoE)", lo=1)
    first_k_dense_replace: int = opt(1, "leading dense layers (MoE layers = num_layers - this)",
                                     lo=0)
    num_experts: int = opt(64, "routed (logical) experts per MoE layer", lo=1)
    num_experts_per_tok: int = opt(4, "top-k experts per token", lo=1)
    n_shared_experts: int = opt(1, "shared experts per MoE layer (0 = none)", lo=0)
    hidden_size: int = opt(64, "model width", lo=1)
    moe_intermediate_size: int = opt(32, "routed expert FFN width", lo=1)
    intermediate_size: int = opt(128, "dense layer FFN width", lo=1)
    num_attention_heads: int = opt(4, "attention heads (divides hidden_size)", lo=1)
    vocab_size: int = opt(512, "vocabulary (>= 261: 256 byte tokens + 4 special tokens + 1 "
                          "merge in the generated tokenizer)", lo=261)
    max_position_embeddings: int = opt(2048, "longest sequence (prompt + output; alias "
                                       "--max-model-len, --context-length); with --model a "
                                       "smaller value caps the checkpoint's, a larger one is "
                                       "refused (2048 reads as not given)", lo=2)
    scoring_func: str = opt("sigmoid", "router scores, reported from the checkpoint (sigmoid: "
                            "deepseek_v3 and glm4_moe, softmax: the other families); a value "
                            "set here is replaced", choices=("softmax", "sigmoid"))
    routing_mode: str = opt("model", "model = real router over token clusters; trace = sample "
                            "top-k from a load trace (benchmarks only)", choices=("model", "trace"))
    routing_trace: str = opt("", "trace-driven routing: path of an SGLang dump / .npy / .npz")
    routing_skew: float = opt(1.0, "generated checkpoint: strength of the token-topic/router "
                              "alignment (0 = none)", lo=0)
    model: str = opt("", "Hugging Face checkpoint folder (config.json + *.safetensors) of a "
                     "deepseek_v3 / deepseek_v2 / glm4_moe / gpt_oss / qwen3_moe / qwen2_moe / "
                     "mixtral / olmoe model; its config.json "
                     "then sets the architecture fields of this section")
    dtype: str = opt("auto", "parameter dtype (auto: the checkpoint's, float32 without one)",
                     choices=("auto", "float32", "float64", "bfloat16", "float16"))
    seed: int = opt(0, "generated checkpoint: weight seed (identical on every rank)", lo=0)
    moe_kernel: str = opt("fused", "matrix products: fused = the project's C++ CPU kernels (one "
                          "call per MoE layer for the routed experts, a batch-invariant linear "
                          "for the dense layers) where they are built and the dtype is "
                          "float32/bfloat16 on the CPU, else torch (one log line says why); "
                          "torch = torch's ops (the reference path)",
                          choices=("fused", "torch"))
    fp8_dequant_cache: bool = opt(False, "FP8 checkpoints: keep a dequantized copy of every "
                                  "expert slot resident (refreshed after each move): no "
                                  "per-step dequantization, 2-4x the fp8 expert memory on top; "
                                  "false = dequantize the step's active experts per step")
    # --- generated default checkpoint (issue 12) ---
    model_arch: str = opt("deepseek_v3", "generated checkpoint (no --model): its family",
                          choices=("deepseek_v3", "qwen3_moe", "qwen2_moe", "mixtral", "olmoe",
                                   "deepseek_v2", "glm4_moe", "gpt_oss"))
    model_cache_dir: str = opt(".cache/checkpoints", "generated checkpoint (no --model): the "
                               "cache folder; one sub-folder per shape, seed and generator "
                               "version, written once (at this default, the environment's "
                               "XLLM_EPLB_MODEL_CACHE_DIR when set: the tests' own folder)")


@dataclass(frozen=True)
class RuntimeConfig:
    """Devices, backends and process groups."""

    device: str = opt("cpu", "worker device", choices=("cpu", "cuda", "npu"))
    backend: str = opt("auto", "torch.distributed backend (auto: gloo/nccl/hccl by device)",
                       choices=("auto", "gloo", "nccl", "hccl"))
    ep_transport: str = opt(
        "auto", "how the EP ranks exchange token rows (dispatch and combine): auto (default: "
        "shm where it applies, else dist), shm (one node, device=cpu, x86-64: through buffers "
        "in the run's shared memory, one round per dispatch and one per combine, no collective "
        "on the hot path; elsewhere the worker logs why and uses dist) or dist "
        "(torch.distributed's all_to_all: gloo/nccl/hccl). With shm, "
        "--worker_cpu_affinity=auto leaves one-core workers unpinned when the engine has no "
        "core of its own (docs/benchmarks.md)",
        choices=("auto", "dist", "shm"))
    ep_shm_buffer_bytes: int = opt(
        1 * MiB, "with the shm transport: data bytes of one rank's send buffer (the segment "
        "holds two per rank, about 2 x ep_size x this); a larger message takes several "
        "rounds", unit="bytes", lo=4096, hi=1 << 30)
    master_addr: str = opt("127.0.0.1", "torch.distributed rendezvous address")
    master_port: int = opt(0, "torch.distributed rendezvous port (0 = pick a free one)",
                           lo=0, hi=65535)
    enable_graph: bool = opt(False, "graph mode: decode batches padded to fixed buckets, "
                             "padding masked out of the load")
    max_batch_size: int = opt(256, "max rows (running requests) per DP rank per step, as "
                              "vLLM's --max-num-seqs; bounded by --kv_cache_bytes (the engine "
                              "logs the rows it uses: `engine batch rows`)", lo=1)
    kv_cache_bytes: int = opt(4 * GiB, "KV cache budget per DP rank: --max_batch_size is "
                              "lowered to the requests whose KV caches fit at the model's full "
                              "length (max_position_embeddings); the cache itself grows with "
                              "use", unit="bytes", lo=1)
    max_prefill_tokens: int = opt(512, "max prefill tokens per DP rank per step", lo=1)
    async_scheduling: bool = opt(True, "plan step n+1 while step n runs (as vLLM's "
                                 "--async-scheduling): its input goes out as soon as step n's "
                                 "outputs are read, a decode row's token is the one its rank "
                                 "just sampled; same tokens; off while an EPLB round is in "
                                 "flight (its commands follow each output) or a membership "
                                 "change waits; false = plan each step after the last one's "
                                 "tokens are committed")
    worker_timeout_seconds: float = opt(60.0, "engine gives up on a worker output after this",
                                        unit="s", lo=0, lo_open=True)
    shm_ring_slots: int = opt(8, "frames per shared-memory ring", lo=2)
    shm_input_frame_bytes: int = opt(1 * MiB, "bytes per input-ring frame", unit="bytes",
                                     lo=1024)
    shm_output_frame_bytes: int = opt(256 * 1024, "bytes per output-ring frame", unit="bytes",
                                      lo=1024)
    run_id: str = opt("", "shared-memory name prefix (default: derived from the port)")
    worker_cpu_affinity: str = opt(
        "auto", "pin each worker to cores of its own and match its torch threads: auto (when "
        "this machine gives serve >= workers cores: cores // workers each, the engine on the "
        "cores left over or else on the workers' cores; fewer cores: not pinned, one log "
        "line), none, or LIST: one comma-separated entry per "
        "local rank, each a core, a range a-b or cores joined by + (e.g. 0,1 or 0-3,4-7); a core "
        "the machine lacks or two ranks on one core is an error")
    # --- multi-node (#14) ---
    nnodes: int = opt(1, "machines in the EP domain (torchrun style): every node runs `serve` "
                      "with the same config and ep_size/nnodes workers; divides ep_size", lo=1)
    node_rank: int = opt(0, "this machine's index in [0, nnodes); node 0 also runs the engine "
                         "and hosts the rendezvous at --master_addr:--master_port", lo=0)
    rendezvous_timeout_seconds: float = opt(
        120.0, "multi-node start-up: every node must join the rendezvous within this",
        unit="s", lo=0, lo_open=True)
    # --- elastic EP (#23) ---
    elastic_ep: bool = opt(True, "fault-tolerant EP (on by default): a worker that dies (or is "
                           "silent for --elastic_silence_seconds) is replaced while the run "
                           "serves: where the other N-1 ranks hold every expert they serve at "
                           "once and the replacement rejoins once loaded (rejoin), else it is "
                           "respawned in place and the service waits (respawn; always with "
                           "--nnodes>1); the dead rank's requests are re-prefilled from prompt "
                           "+ output, the others keep their KV caches; the launcher's console "
                           "says which mode and why. false: a death stops the run")
    elastic_silence_seconds: float = opt(5.0, "with --elastic_ep: a worker that has not read a "
                                         "step's input for this long is SIGKILLed (a hang "
                                         "becomes a death)", unit="s", lo=0, lo_open=True)
    elastic_join_timeout_seconds: float = opt(120.0, "with --elastic_ep: the ranks must re-form "
                                              "(a respawned replacement loaded and joined) "
                                              "within this, else the run stops; a rejoining "
                                              "replacement not ready within this is dropped",
                                              unit="s", lo=0, lo_open=True)
    elastic_max_restarts: int = opt(3, "with --elastic_ep: worker replacements per run; a "
                                    "death after them shrinks the run (a crash loop ends; "
                                    "--nnodes>1: per node, then it stops)",
                                    lo=0)
    elastic_restart: bool = opt(True, "with --elastic_ep: replace a dead worker (up to "
                                "--elastic_max_restarts): the survivors shrink at once and "
                                "serve on N-1 ranks while the replacement loads, then it "
                                "rejoins (--elastic_rejoin); false (or the restarts used up): "
                                "shrink only: the survivors re-form with compact ranks "
                                "0..N-2, re-plan the experts (orphans read from the checkpoint) "
                                "and keep serving on N-1 ranks")
    elastic_rejoin: bool = opt(True, "with --elastic_restart: shrink, then the replacement "
                               "joins at a step boundary once loaded (within "
                               "--elastic_join_timeout_seconds, else it is dropped and N-1 "
                               "ranks keep serving); false, or when the N-1 survivors could "
                               "not hold every expert, or with --nnodes>1: respawn in place, "
                               "the service waits")


@dataclass(frozen=True)
class ServeConfig:
    """HTTP API, metrics, logs and the built-in workload."""

    host: str = opt("127.0.0.1", "HTTP bind address (loopback by default)")
    port: int = opt(8000, "HTTP port for the API, /metrics and /eplb/status", lo=0, hi=65535)
    log_dir: str = opt("logs", "per-process log files go here")
    v: str = opt("info", "log level (debug also prints tracebacks)",
                 choices=("debug", "info", "warning", "error"))
    enable_per_layer_metrics: bool = opt(False, "export per-layer Prometheus series")
    log_stats_interval: float = opt(
        10.0, "seconds between the console stats lines while serving (prompt and generation "
        "tokens/s, running and waiting requests, KV-cache use, balancedness, last rebalance; "
        "as vLLM's); 0 = off", unit="s", lo=0)
    metrics_hot_experts: int = opt(
        4, "per MoE layer, export the recent load and replica count of this many hottest "
        "logical experts (hot_expert_* series: MoE layers x this many; 0 = none)", lo=0)
    enable_expert_metrics: bool = opt(
        False, "also export the recent load and replica count of every logical expert "
        "(expert_* series: MoE layers x num_experts)")
    shutdown_timeout_seconds: float = opt(10.0, "graceful stop before SIGKILL", unit="s", lo=0)
    served_model_name: str = opt("xllm-eplb", "model name of the OpenAI API (/v1/models; a "
                                 "request's 'model' must match it or the alias)")
    served_model_alias: str = opt("", "a second model name the OpenAI API answers to (listed "
                                  "in /v1/models after the first); empty: the --model string "
                                  "as given (vLLM serves a model under that name)")
    tokenizer: str = opt("", "tokenizer folder (tokenizer.json, tokenizer_config.json, "
                         "generation_config.json) or a Hugging Face ORG/NAME in the local "
                         "cache; empty: the model's own")
    chat_template: str = opt("", "chat template for /v1/chat/completions: a Jinja file, or the "
                             "template text itself; empty: the tokenizer's")
    api_key: str = opt("", "when set, /v1/*, /tokenize and /detokenize need the header "
                       "'Authorization: Bearer <key>' (401 otherwise); empty: open")
    stall_seconds: float = opt(10.0, "a step running longer than this is a stall: /health "
                               "answers 503, worker_up of the silent ranks drops to 0 and the "
                               "requests in flight end with an error naming them",
                               unit="s", lo=0, lo_open=True)
    max_waiting_requests: int = opt(1024, "requests waiting for a batch slot beyond which the "
                                    "API answers 503 (overloaded)", lo=1)
    workload: str = opt("none", "built-in request generator", choices=("none", "synthetic"))
    workload_rate: float = opt(8.0, "synthetic workload: requests per second", lo=0,
                               lo_open=True)
    workload_prompt_len: int = opt(32, "synthetic workload: prompt tokens", lo=1)
    workload_output_len: int = opt(64, "synthetic workload: output tokens", lo=1)
    workload_skew: float = opt(1.2, "synthetic workload: Zipf exponent of the topic mix", lo=0)
    workload_drift_seconds: float = opt(60.0, "synthetic workload: topic mix shifts this often "
                                        "(0 = never)", unit="s", lo=0)
    workload_max_requests: int = opt(0, "synthetic workload: stop after this many (0 = forever)",
                                     lo=0)


@dataclass(frozen=True)
class FaultConfig:
    """Fault injection (tests and reliability runs only; off by default, see faultspec.py)."""

    enable_fault_injection: bool = opt(False, "allow --fault_inject (never in production)")
    fault_inject: tuple = opt((), "repeatable: inject one fault KIND:k=v,k=v (kinds "
                              "prepare_delay, prepare_fail, p2p_delay, p2p_fail, crash, "
                              "slow_step, corrupt_output, join_delay; see "
                              "xllm_eplb/faultspec.py)")


@dataclass(frozen=True)
class Config:
    eplb: EplbConfig = field(default_factory=EplbConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    faults: FaultConfig = field(default_factory=FaultConfig)

    @property
    def num_moe_layers(self) -> int:
        return self.model.num_layers - self.model.first_k_dense_replace

    @property
    def slots_per_rank(self) -> int:
        return rank_slots(self.model.num_experts, self.eplb.ep_size,
                          self.eplb.redundant_experts_num)
