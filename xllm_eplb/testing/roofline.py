"""The arithmetic the benchmark scripts share with the tests, on a generated checkpoint: the
compute-sized checkpoints (``COMPUTE``, ``HF_COMPUTE``, ``FAMILY_COMPUTE``: keyword sizes of
``model.checkpoint.make_checkpoint``), the weight bytes by role and the decode-step lower bound
(``scripts/bench_roofline.py``), the active parameters of a decode token
(``scripts/bench_families.py``). No process, no timing: the scripts measure the machine."""

from __future__ import annotations

import re
from pathlib import Path

#: issue 32's compute-sized checkpoint (~490 MiB of fp32 weights)
COMPUTE = dict(hidden_size=768, num_layers=4, first_k_dense=0, num_experts=32, top_k=4,
               moe_intermediate_size=384, vocab_size=4096, num_heads=12)
#: ``scripts/bench_hf.py``'s ``compute`` (deepseek_v3, MLA)
HF_COMPUTE = dict(hidden_size=1024, num_layers=4, num_experts=16, top_k=2,
                  moe_intermediate_size=512, intermediate_size=2048, num_heads=16,
                  q_lora_rank=384, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32,
                  v_head_dim=64)
#: issue 40's families at ``compute``'s sizes (deepseek_v2: MLA ranks of ``hf_compute``'s
#: proportions), for a per-parameter comparison with qwen3_moe's ``compute``
FAMILY_COMPUTE = {
    "olmoe": dict(COMPUTE),
    "glm4_moe": dict(COMPUTE, n_shared_experts=1),
    "deepseek_v2": dict(COMPUTE, n_shared_experts=1, q_lora_rank=288, kv_lora_rank=192,
                        qk_nope_head_dim=48, qk_rope_head_dim=16, v_head_dim=48),
}


def weight_bytes(model_dir: Path) -> dict:
    """Bytes of the checkpoint by role: ``experts`` per layer (all experts), ``embed``,
    ``dense`` (everything else read every step: attention, norms, dense and shared MLPs,
    router, LM head)."""
    from safetensors import safe_open

    size = {"F32": 4, "BF16": 2, "F16": 2, "F64": 8, "F8_E4M3": 1, "I64": 8, "I32": 4}
    out = {"experts": {}, "embed": 0, "dense": 0, "dense_params": 0, "expert_params": 0}
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        for k in f.keys():
            sl = f.get_slice(k)
            n = 1
            for d in sl.get_shape():
                n *= d
            b = n * size.get(sl.get_dtype(), 4)
            m = re.search(r"layers\.(\d+)\.mlp\.experts\.", k)
            if m:
                out["experts"][int(m.group(1))] = out["experts"].get(int(m.group(1)), 0) + b
                out["expert_params"] += n
            elif "embed_tokens" in k:
                out["embed"] += b
            else:
                out["dense"] += b
                out["dense_params"] += n
    return out


def roofline(model_dir: Path, batch: int, prompt_len: int, new: int, touched: float,
             mach: dict) -> dict:
    """Lower bound of prefill + ``new - 1`` decode steps of ``batch`` rows; ``touched``: mean
    distinct experts per MoE layer in a decode step."""
    from xllm_eplb.flags import config_from_dict
    from xllm_eplb.model import blocks
    from xllm_eplb.model.resolve import resolve_config
    from xllm_eplb.model.spec import parse_spec

    spec = parse_spec(str(model_dir))
    cfg = resolve_config(config_from_dict({"model": {"model": str(model_dir)},
                                           "eplb": {"ep_size": 1}}), spec)
    E, k = cfg.model.num_experts, cfg.model.num_experts_per_tok
    w = weight_bytes(model_dir)
    L_moe = len(w["experts"])
    per_expert = sum(w["experts"].values()) / max(1, L_moe) / E          # bytes, one layer
    heads, kd, vd = blocks.kv_dims(spec)
    itemsize = 4
    kv_per_pos = spec.num_layers * heads * (kd + vd) * itemsize        # bytes per cached token
    flops_tok = 2 * (w["dense_params"] + L_moe * k * w["expert_params"] / max(1, L_moe * E))
    attn_flops_pos = 2 * spec.num_layers * spec.num_heads * (kd + vd)   # per token per position
    bw = mach["read_bytes_per_s"]

    def step(rows_tok: int, ctx: int, experts: float, rate: float) -> float:
        nbytes = w["dense"] + L_moe * experts * per_expert + batch * ctx * kv_per_pos
        flops = rows_tok * flops_tok + rows_tok * ctx * attn_flops_pos
        return max(nbytes / bw, flops / rate)

    # prefill: large GEMMs (the 1024^3 rate); decode: the batch's own expert shape
    pre = step(batch * prompt_len, prompt_len, min(E, batch * prompt_len * k),
               mach["gemm_1024_flops"])
    dec = [step(batch, prompt_len + t + 1, touched, mach["gemm_batch_flops"])
           for t in range(new - 1)]
    total = pre + sum(dec)
    return {"weights_bytes": w["dense"] + w["embed"] + sum(w["experts"].values()),
            "dense_bytes": w["dense"], "expert_bytes_per_layer_expert": per_expert,
            "experts_touched_per_layer": touched, "num_experts": E, "moe_layers": L_moe,
            "decode_step_s": sum(dec) / max(1, len(dec)), "prefill_s": pre, "total_s": total,
            "tokens_per_s": batch * new / total}


def active_params(model) -> int:
    """Weights a decode token reads, embedding excluded (see the module docstring)."""
    s, reader = model.spec, model.reader
    n = 0
    for name, (_, _, shape) in reader.meta.items():
        if name == "model.embed_tokens.weight" or ".experts." in name:
            continue
        k = 1
        for d in shape:
            k *= d
        n += k
    per_expert = 3 * s.hidden_size * s.moe_intermediate_size
    if s.expert_bias:
        per_expert += 2 * s.moe_intermediate_size + s.hidden_size
    return n + len(s.moe_layers) * s.top_k * per_expert


def reference_decoder(path: Path):
    """``Decoder.reference`` of the checkpoint at ``path`` (one process, every expert local,
    float32): what ``scripts/bench_families.py`` times and :func:`active_params` reads."""
    from xllm_eplb.config import Config, EplbConfig, ModelConfig
    from xllm_eplb.model.decoder import Decoder

    cfg = Config(eplb=EplbConfig(ep_size=1, redundant_experts_num=0),
                 model=ModelConfig(model=str(path), dtype="float32"))
    return Decoder.reference(cfg)
