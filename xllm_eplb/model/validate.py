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
    if err and m.model:
        raise ConfigError(_from_config_json(m.model, m.num_experts, err))
    if err:
        raise ConfigError(err)
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
    s = cfg.serve
    if m.model and s.workload == "synthetic" and (s.workload_prompt_len + s.workload_output_len
                                                  > m.max_position_embeddings):
        raise ConfigError(f"--workload_prompt_len + --workload_output_len = "
                          f"{s.workload_prompt_len + s.workload_output_len}: must be <= "
                          f"max_position_embeddings={m.max_position_embeddings} of "
                          f"{m.model}/config.json")
    if not m.model:
        spec_for(cfg)              # the generated default checkpoint can have these sizes


_EXPERT_KEYS = ("n_routed_experts", "num_local_experts", "num_experts")


def _from_config_json(folder: str, num_experts: int, err: str) -> str:
    """A layout error about a checkpoint's experts, naming its config.json and the key the
    expert count came from (``--num_experts`` does not apply with ``--model``)."""
    import json
    from pathlib import Path

    path = Path(folder) / "config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        raw = {}
    key = next((k for k in _EXPERT_KEYS if raw.get(k) is not None), "num_experts")
    flag = f"--num_experts={num_experts}"
    if err.startswith(flag):
        return f"{path}: {key}={num_experts} (routed experts per MoE layer){err[len(flag):]}"
    return f"{err} ({key}={num_experts} in {path})"


def validate_phy2log(cfg: Config, phy2log: np.ndarray) -> np.ndarray:
    """A [L_moe, D*S] int64 table whose every layer holds every logical expert."""
    from xllm_eplb.eplb import placement

    S = cfg.slots_per_rank
    want = (cfg.num_moe_layers, cfg.eplb.ep_size * S)
    p = np.asarray(phy2log, dtype=np.int64)
    if p.shape != want:
        raise InputFileError(f"placement: shape {list(p.shape)} does not match the config "
                             f"[num_moe_layers={want[0]}, ep_size*slots={want[1]}]")
    placement.validate_table(p, cfg.model.num_experts, cfg.eplb.ep_size, "placement layer {}",
                             InputFileError, per_rank_cap=S)
    return p
