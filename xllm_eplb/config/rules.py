"""The rules on a config: one field's bounds (:func:`check_field`), the device -> backend
rule, the expert layout, the multi-node topology, and :func:`validate` over the whole tree."""

from __future__ import annotations

from typing import Any

from xllm_eplb.config.fields import Config
from xllm_eplb.config.layout import elastic_redundancy_needed, survivors_hold_all
from xllm_eplb.config.schema import FIELDS, FieldSpec, format_value, get_value
from xllm_eplb.errors import ConfigError
from xllm_eplb.faultspec import fault_rules

# --- validation -----------------------------------------------------------------------------

def _bad(name: str, value: Any, rule: str) -> ConfigError:
    return ConfigError(f"--{name}={format_value(value)}: {rule}")


def check_field(spec: FieldSpec, value: Any) -> None:
    """Range / choice check of one typed value; raises :class:`ConfigError` naming the flag."""
    if value is None:
        return
    if spec.choices is not None:
        if value not in spec.choices:
            raise _bad(spec.name, value, "must be " + spec.rule())
        return
    lo, hi = spec.lo, spec.hi
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value != value:  # NaN
            raise _bad(spec.name, value, "must be a number")
        too_low = lo is not None and (value <= lo if spec.lo_open else value < lo)
        too_high = hi is not None and (value >= hi if spec.hi_open else value > hi)
        if too_low or too_high:
            raise _bad(spec.name, value, "must be " + spec.rule())


#: the torch.distributed backend ``auto`` picks per device, and the devices each backend drives
BACKEND_FOR_DEVICE = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
DEVICES_FOR_BACKEND = {"gloo": ("cpu",), "nccl": ("cuda",), "hccl": ("npu",)}


def resolve_backend(device: str, backend: str) -> str:
    """``backend`` with ``auto`` resolved by device (gloo on cpu, nccl on cuda, hccl on npu);
    ConfigError if it cannot drive ``device``. The one home of the device -> backend rule."""
    if device not in BACKEND_FOR_DEVICE:
        raise ConfigError(f"device={device!r} must be one of {sorted(BACKEND_FOR_DEVICE)}")
    if backend == "auto":
        return BACKEND_FOR_DEVICE[device]
    if backend not in DEVICES_FOR_BACKEND:
        raise ConfigError(f"backend={backend!r} must be auto, gloo, nccl or hccl")
    if device not in DEVICES_FOR_BACKEND[backend]:
        raise ConfigError(f"backend={backend} cannot drive device={device} "
                          f"(use backend=auto or {BACKEND_FOR_DEVICE[device]})")
    return backend


def layout_rules(num_experts: int, ep_size: int, redundant: int) -> list[tuple[str, Any, str]]:
    """The slot-layout rules as (flag, value, rule) for every violation: ``ep_size`` >= 1,
    ``num_experts`` divisible by it, 0 <= ``redundant`` <= num_experts - num_experts/ep_size
    (so a rank's ``num_experts/ep_size + redundant`` slots never exceed the experts: at most one
    replica of an expert per rank; one rank holds every expert once and no redundant slot). The
    one validator of these rules (config, placement and the model's preflight call it).

    NOTE: every rank derives its slot layout from these; they must hold on all ranks alike.
    """
    if ep_size is None or ep_size < 1:
        return [("ep_size", ep_size, "must be >= 1")]
    bad: list[tuple[str, Any, str]] = []
    if num_experts % ep_size:
        bad.append(("num_experts", num_experts, f"must be divisible by --ep_size={ep_size}"))
    if redundant < 0:
        bad.append(("redundant_experts_num", redundant, "must be >= 0"))
    elif not bad and redundant > num_experts - num_experts // ep_size:
        bad.append(("redundant_experts_num", redundant,
                    f"must be <= {num_experts - num_experts // ep_size} (num_experts - "
                    f"num_experts/ep_size: at most one replica of an expert per rank)"))
    return bad


def layout_error(num_experts: int, ep_size: int, redundant: int) -> str | None:
    """The first :func:`layout_rules` violation as ``--flag=value: rule``, or None."""
    bad = layout_rules(num_experts, ep_size, redundant)
    return _bad(*bad[0]).args[0] if bad else None


def _model_rules(cfg: Config) -> list[tuple[str, Any, str]]:
    """Rules on the architecture flags (only without ``--model``: a checkpoint's config.json
    replaces them, and the model's preflight checks those values, naming the file)."""
    m = cfg.model
    bad: list[tuple[str, Any, str]] = []
    if m.num_experts_per_tok > m.num_experts:
        bad.append(("num_experts_per_tok", m.num_experts_per_tok,
                    f"must be <= --num_experts={m.num_experts}"))
    if m.hidden_size % m.num_attention_heads:
        bad.append(("hidden_size", m.hidden_size,
                    f"must be divisible by --num_attention_heads={m.num_attention_heads}"))
    if m.first_k_dense_replace >= m.num_layers:
        bad.append(("first_k_dense_replace", m.first_k_dense_replace,
                    f"must be < --num_layers={m.num_layers} (at least one MoE layer)"))
    return bad


def _cross_rules(cfg: Config) -> list[tuple[str, Any, str]]:
    """Cross-field rules as (flag, value, rule) for every violation, in a fixed order."""
    e, m, r = cfg.eplb, cfg.model, cfg.runtime
    bad: list[tuple[str, Any, str]] = []
    bad += [] if m.model else _model_rules(cfg)
    if m.model and m.seed:
        bad.append(("seed", m.seed, f"seeds only the generated checkpoint's weights; with "
                    f"--model={m.model} the weights are the checkpoint's and sampling takes each "
                    "request's own 'seed' (OpenAI API; omitted: a fresh draw): drop --seed"))
    if m.routing_mode == "trace" and not m.routing_trace:
        bad.append(("routing_trace", m.routing_trace, "required when --routing_mode=trace"))
    if e.eplb_p2p_max_inflight_bytes < e.eplb_p2p_chunk_bytes:
        bad.append(("eplb_p2p_max_inflight_bytes", e.eplb_p2p_max_inflight_bytes,
                    f"must be >= --eplb_p2p_chunk_bytes={e.eplb_p2p_chunk_bytes}"))
    if e.moe_fallback_routing and e.moe_capacity_mode == "none":      # --- capacity (#16) ---
        bad.append(("moe_fallback_routing", True, "needs --moe_capacity_mode=static or "
                                                  "dynamic (nothing is ever full without one)"))
    devices = DEVICES_FOR_BACKEND.get(r.backend, ())
    if r.backend != "auto" and devices and r.device not in devices:
        bad.append(("backend", r.backend, f"needs --device={devices[0]} "
                                          f"(got --device={r.device})"))
    s = cfg.serve
    if s.workload == "synthetic" and not m.model and (
            s.workload_prompt_len + s.workload_output_len > m.max_position_embeddings):
        bad.append(("workload_output_len", s.workload_output_len,
                    f"--workload_prompt_len + --workload_output_len must be <= "
                    f"--max_position_embeddings={m.max_position_embeddings}"))
    f = cfg.faults
    bad += [("fault_inject", text, rule) for text, rule in fault_rules(
        f.fault_inject, f.enable_fault_injection, e.ep_size, cfg.num_moe_layers)]
    if e.ep_size is None:
        return bad
    # NOTE: with --model the experts are config.json's: the model's preflight checks the
    # layout against them (model/validate.py), naming the file
    bad += layout_rules(m.num_experts, e.ep_size, e.redundant_experts_num) if not m.model \
        else layout_rules(e.ep_size, e.ep_size, 0)
    if e.ep_size % e.eplb_num_nodes:
        bad.append(("eplb_num_nodes", e.eplb_num_nodes,
                    f"must divide --ep_size={e.ep_size}"))
    bad += topology_rules(e.ep_size, r.nnodes, r.node_rank, r.master_port)
    if not m.model:     # --model: the checkpoint's sizes decide (model/validate.py)
        bad += elastic_rules(cfg)
    return bad


def elastic_rules(cfg: Config) -> list[tuple[str, Any, str]]:
    """``--elastic_ep`` (on by default; the mode a death gets is the launcher's choice,
    ``elastic/supervisor.replacement_mode``): only what no mode can serve is refused. With
    ``--nnodes`` > 1 a dead worker can only be respawned in place (``--elastic_restart=true``);
    a shrink-only run (``--elastic_restart=false``) needs the other N-1 ranks' slots to hold
    every expert, ``(N-1) x slots_per_rank >= num_experts``."""
    e, m, r = cfg.eplb, cfg.model, cfg.runtime
    if not r.elastic_ep or e.ep_size is None or r.elastic_restart:
        return []
    if r.nnodes > 1:     # across nodes a dead worker is respawned in place (node/launcher.py)
        return [("elastic_restart", False, f"must be true: with --elastic_ep and --nnodes="
                 f"{r.nnodes} a dead worker can only be respawned in place (no shrink across "
                 "nodes)")]
    if e.ep_size > 1 and not survivors_hold_all(e.ep_size, cfg.slots_per_rank, m.num_experts):
        need = elastic_redundancy_needed(m.num_experts, e.ep_size)
        return [("redundant_experts_num", e.redundant_experts_num,
                 f"with --elastic_restart=false (a dead worker is left out) the other "
                 f"--ep_size-1={e.ep_size - 1} ranks must hold every expert: (ep_size-1) x "
                 f"slots_per_rank >= num_experts={m.num_experts} needs "
                 f"--redundant_experts_num >= {need} (or --elastic_restart=true: a respawn, "
                 "or --elastic_ep=false: a death stops the run)")]
    return []


def topology_rules(ep_size: int, nnodes: int, node_rank: int,
                   master_port: int) -> list[tuple[str, Any, str]]:
    """Multi-node rules as (flag, value, rule): ``nnodes`` divides ``ep_size`` (one block of
    ``ep_size/nnodes`` EP ranks per node), ``node_rank`` < ``nnodes``, and with more than one
    node an explicit ``master_port`` (every node must find the rendezvous)."""
    bad: list[tuple[str, Any, str]] = []
    if ep_size % nnodes:
        bad.append(("nnodes", nnodes, f"must divide --ep_size={ep_size} (ep_size/nnodes "
                                      f"workers per node)"))
    if node_rank >= nnodes:
        bad.append(("node_rank", node_rank, f"must be < --nnodes={nnodes}"))
    if nnodes > 1 and master_port == 0:
        bad.append(("master_port", master_port, "must be set (the same on every node) when "
                                                "--nnodes > 1"))
    return bad


def ranks_per_node(cfg: Config) -> int:
    """EP ranks (= worker processes) on each node: ``ep_size / nnodes``."""
    return cfg.eplb.ep_size // cfg.runtime.nnodes


def node_ranks(cfg: Config, node: int | None = None) -> range:
    """Global EP ranks of ``node`` (default: this node): ``node*k .. node*k + k - 1``.

    NOTE: every node derives the same blocks from the same config (checked at rendezvous)."""
    k = ranks_per_node(cfg)
    n = cfg.runtime.node_rank if node is None else node
    return range(n * k, n * k + k)


def node_of_rank(cfg: Config, rank: int) -> int:
    """The node that runs EP rank ``rank``."""
    return rank // ranks_per_node(cfg)


def validate(cfg: Config, *, require_ep_size: bool = True) -> Config:
    """Check every field and cross-field rule; return ``cfg`` or raise :class:`ConfigError`.

    The first violation is raised, its message naming flag, value and rule, e.g.
    ``--eplb_min_peak_load_improvement=1.5: must be in [0, 1]``.
    """
    for name, spec in FIELDS.items():
        value = get_value(cfg, name)
        if value is None and spec.required and require_ep_size:
            raise ConfigError(f"--{name} is required ({spec.help})")
        check_field(spec, value)
    bad = _cross_rules(cfg)
    if bad:
        raise _bad(*bad[0])
    return cfg
