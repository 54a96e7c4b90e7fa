"""Checks of the model config that must fail before any process group is created."""

from __future__ import annotations

import numpy as np

from xllm_eplb.config import Config, elastic_rules, layout_error
from xllm_eplb.errors import ConfigError, InputFileError
from xllm_eplb.model.default_checkpoint import spec_for


def validate_model_config(cfg: Config) -> None:
    """Raise ConfigError / InputFileError naming the field, the value and the rule."""
    m, e = cfg.model, cfg.eplb
    err = layout_error(m.num_experts, e.ep_size, e.redundant_experts_num)
    if err:
        where = f"{m.model}/config.json: routed experts " if m.model else ""
        raise ConfigError(where + err)
    for flag, value, rule in elastic_rules(cfg):       # --elastic_ep: survives one loss
        where = f"{m.model}/config.json: routed experts {m.num_experts}: " if m.model else ""
        raise ConfigError(f"{where}--{flag}={value}: {rule}")
    if m.num_experts_per_tok > m.num_experts:
        raise ConfigError(f"num_experts_per_tok={m.num_experts_per_tok} is larger than "
                          f"num_experts={m.num_experts}")
    if m.first_k_dense_replace >= m.num_layers:
        raise ConfigError(f"first_k_dense_replace={m.first_k_dense_replace} leaves no MoE layer "
                          f"(num_layers={m.num_layers}); it must be < num_layers")
    if m.routing_mode == "trace" and not m.routing_trace:
        raise ConfigError("routing_mode=trace needs routing_trace=<path of a load trace>")
    if m.routing_mode == "trace":
        from xllm_eplb.model.routing import load_trace
        load_trace(m.routing_trace)
    if not m.model:
        spec_for(cfg)              # the generated default checkpoint can have these sizes


def validate_phy2log(cfg: Config, phy2log: np.ndarray) -> np.ndarray:
    """A [L_moe, D*S] int64 table whose every layer holds every logical expert."""
    from xllm_eplb.eplb import placement

    S = cfg.slots_per_rank
    want = (cfg.num_moe_layers, cfg.eplb.ep_size * S)
    p = np.asarray(phy2log, dtype=np.int64)
    if p.shape != want:
        raise InputFileError(f"placement: shape {list(p.shape)} does not match the config "
                             f"[num_moe_layers={want[0]}, ep_size*slots={want[1]}]")
    for ml in range(want[0]):
        try:
            placement.validate_phy2log(p[ml], cfg.model.num_experts, cfg.eplb.ep_size,
                                       what=f"placement layer {ml}", allow_rank_duplicates=True)
        except placement.PlacementError as exc:
            raise InputFileError(str(exc)) from None
    return p
