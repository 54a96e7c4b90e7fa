"""The non-expert weights of a checkpoint, by family, under the short names :mod:`blocks` uses.

``load_params(spec, reader, dtype) -> (top, layers)``: ``top`` = ``embed`` [V, H], ``norm`` [H],
``lm_head`` [V, H] (the embedding when tied); ``layers[i]`` = ``in_norm``, ``post_norm``, the
attention weights, and either a dense MLP (``mlp_w13`` [2I, H], ``mlp_w2`` [H, I]) or the MoE
layer's router (``gate`` [E, H], ``gate_bias`` [E] for the sigmoid routers; DeepSeek's
routers kept fp32 as transformers does) and shared expert (``shared_w13``, ``shared_w2``, qwen2_moe ``shared_gate`` [1, H]).
Routed experts are not read here (see ``loader.expert_weights``).
"""

from __future__ import annotations

import torch

from xllm_eplb.model.loader import CheckpointReader, moe_prefix
from xllm_eplb.model.spec import ModelSpec


def _attn(spec: ModelSpec, get, pre: str) -> dict:
    H, h = spec.hidden_size, spec.num_heads
    out = {}
    if spec.mla is not None:
        m = spec.mla
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        if m.q_lora_rank is None:
            out["q"] = get(pre + "q_proj.weight", (h * qk, H))
        else:
            out["q_a"] = get(pre + "q_a_proj.weight", (m.q_lora_rank, H))
            out["q_a_norm"] = get(pre + "q_a_layernorm.weight", (m.q_lora_rank,))
            out["q_b"] = get(pre + "q_b_proj.weight", (h * qk, m.q_lora_rank))
            if spec.attn_bias:
                out["q_a_bias"] = get(pre + "q_a_proj.bias", (m.q_lora_rank,))
        r = m.kv_lora_rank + m.qk_rope_head_dim
        out["kv_a"] = get(pre + "kv_a_proj_with_mqa.weight", (r, H))
        if spec.attn_bias:
            out["kv_a_bias"] = get(pre + "kv_a_proj_with_mqa.bias", (r,))
        out["kv_a_norm"] = get(pre + "kv_a_layernorm.weight", (m.kv_lora_rank,))
        out["kv_b"] = get(pre + "kv_b_proj.weight",
                          (h * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank))
        out["o"] = get(pre + "o_proj.weight", (H, h * m.v_head_dim))
        if spec.o_bias:
            out["o_bias"] = get(pre + "o_proj.bias", (H,))
        return out
    hd, kv = spec.head_dim, spec.num_kv_heads
    for n, rows in (("q", h * hd), ("k", kv * hd), ("v", kv * hd)):
        out[n] = get(f"{pre}{n}_proj.weight", (rows, H))
        if spec.attn_bias:
            out[n + "_bias"] = get(f"{pre}{n}_proj.bias", (rows,))
    out["o"] = get(pre + "o_proj.weight", (H, h * hd))
    if spec.o_bias:
        out["o_bias"] = get(pre + "o_proj.bias", (H,))
    if spec.sinks:                    # gpt_oss: one sink logit per head
        out["sinks"] = get(pre + "sinks", (h,))
    if spec.qk_norm:                  # per head, or over the whole projection (olmoe)
        qn, kn = (hd, hd) if spec.qk_norm_per_head else (h * hd, kv * hd)
        out["q_norm"] = get(pre + "q_norm.weight", (qn,))
        out["k_norm"] = get(pre + "k_norm.weight", (kn,))
    return out


def _swiglu(get, pre: str, H: int, inter: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = get(pre + "gate_proj.weight", (inter, H))
    u = get(pre + "up_proj.weight", (inter, H))
    return torch.cat([g, u], dim=0), get(pre + "down_proj.weight", (H, inter))


def _ffn(spec: ModelSpec, reader: CheckpointReader, get, i: int, dtype: torch.dtype) -> dict:
    H, E = spec.hidden_size, spec.num_experts
    if i not in spec.moe_layers:
        w13, w2 = _swiglu(get, f"model.layers.{i}.mlp.", H, spec.intermediate_size)
        return {"mlp_w13": w13, "mlp_w2": w2}
    pre = moe_prefix(spec, reader, i)
    out = {}
    if spec.scoring == "sigmoid":
        out["gate"] = reader.get(pre + "gate.weight", (E, H), torch.float32)
        out["gate_bias"] = reader.get(pre + "gate.e_score_correction_bias", (E,), torch.float32)
    elif spec.router_bias:              # gpt_oss: mlp.router.{weight,bias}
        out["gate"] = get(pre + "router.weight", (E, H))
        out["gate_bias"] = get(pre + "router.bias", (E,))
    elif spec.family == "deepseek_v2":   # an fp32 router in transformers (fp64 stays fp64)
        out["gate"] = reader.get(pre + "gate.weight", (E, H),
                                 torch.promote_types(dtype, torch.float32))
    else:
        out["gate"] = get(pre + "gate.weight", (E, H))
    if spec.shared_intermediate_size:
        name = "shared_expert." if spec.family == "qwen2_moe" else "shared_experts."
        out["shared_w13"], out["shared_w2"] = _swiglu(get, pre + name, H,
                                                      spec.shared_intermediate_size)
        if spec.shared_expert_gate:
            out["shared_gate"] = get(pre + "shared_expert_gate.weight", (1, H))
    return out


def load_params(spec: ModelSpec, reader: CheckpointReader, dtype: torch.dtype,
                device: torch.device) -> tuple[dict, list[dict]]:
    """-> (top-level weights, per-decoder-layer weights), all on ``device``."""
    def get(name, shape):
        return reader.get(name, shape, dtype).to(device)

    H, V = spec.hidden_size, spec.vocab_size
    top = {"embed": get("model.embed_tokens.weight", (V, H)), "norm": get("model.norm.weight", (H,))}
    if spec.tie_word_embeddings or not reader.has("lm_head.weight"):
        if not spec.tie_word_embeddings:
            reader.get("lm_head.weight", (V, H), dtype)       # raises: missing lm_head
        top["lm_head"] = top["embed"]
    else:
        top["lm_head"] = get("lm_head.weight", (V, H))
    layers = []
    for i in range(spec.num_layers):
        pre = f"model.layers.{i}."
        d = {"in_norm": get(pre + "input_layernorm.weight", (H,)),
             "post_norm": get(pre + "post_attention_layernorm.weight", (H,))}
        d.update(_attn(spec, get, pre + "self_attn."))
        d.update({k: v.to(device) for k, v in _ffn(spec, reader, get, i, dtype).items()})
        layers.append(d)
    return top, layers
