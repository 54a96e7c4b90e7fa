"""Per-family ``config.json`` contents and tensor layouts of generated checkpoints.

``hf_config`` returns the dict transformers 5 writes with ``save_pretrained`` for the family (the
same keys and defaults, checked by tests against transformers' config classes; only
``transformers_version`` is left out). ``tensor_shapes`` lists every tensor the family's
``save_pretrained`` writes, under the hub key names (per-expert tensors, not fused), in file
order. ``s`` is a resolved :class:`xllm_eplb.model.checkpoint.CheckpointSpec` (duck-typed here
to keep this module free of imports from ``checkpoint``).
"""

from __future__ import annotations

ARCHITECTURES = {"deepseek_v3": "DeepseekV3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "qwen2_moe": "Qwen2MoeForCausalLM", "mixtral": "MixtralForCausalLM",
                 "olmoe": "OlmoeForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM",
                 "glm4_moe": "Glm4MoeForCausalLM", "gpt_oss": "GptOssForCausalLM"}
MLA_ARCHS = ("deepseek_v3", "deepseek_v2")
GLM_PARTIAL_ROTARY = 0.5           # GLM-4.5's partial_rotary_factor (half of each head rotated)


def _common(arch: str, s, ids: dict) -> dict:
    return {
        "architectures": [ARCHITECTURES[arch]], "model_type": arch,
        "attention_dropout": 0.0, "bos_token_id": ids["bos"], "eos_token_id": ids["eos"],
        "pad_token_id": None, "dtype": s.dtype, "hidden_act": "silu",
        "hidden_size": s.hidden_size, "initializer_range": 0.02,
        "max_position_embeddings": s.max_position_embeddings,
        "num_attention_heads": s.num_heads, "num_experts_per_tok": s.top_k,
        "num_hidden_layers": s.num_layers, "num_key_value_heads": s.num_kv_heads,
        "output_router_logits": False, "rms_norm_eps": s.rms_norm_eps,
        "rope_parameters": {"rope_theta": float(s.rope_theta), "rope_type": "default"},
        "tie_word_embeddings": s.tie_word_embeddings, "use_cache": True,
        "vocab_size": s.vocab_size,
    }


def _deepseek_v3(s) -> dict:
    return {
        "attention_bias": False, "first_k_dense_replace": s.first_k_dense,
        "head_dim": s.qk_rope_head_dim, "intermediate_size": s.intermediate_size,
        "kv_lora_rank": s.kv_lora_rank, "moe_intermediate_size": s.moe_intermediate_size,
        "n_group": s.n_group, "n_routed_experts": s.num_experts,
        "n_shared_experts": s.n_shared_experts, "norm_topk_prob": s.norm_topk_prob,
        "num_nextn_predict_layers": 0, "pretraining_tp": 1, "q_lora_rank": s.q_lora_rank,
        "qk_head_dim": s.qk_nope_head_dim + s.qk_rope_head_dim,
        "qk_nope_head_dim": s.qk_nope_head_dim, "qk_rope_head_dim": s.qk_rope_head_dim,
        "rope_interleave": True, "routed_scaling_factor": float(s.routed_scaling_factor),
        "topk_group": s.topk_group, "v_head_dim": s.v_head_dim,
    }


def _deepseek_v2(s) -> dict:
    return {
        "attention_bias": False, "first_k_dense_replace": s.first_k_dense,
        "head_dim": s.qk_rope_head_dim, "intermediate_size": s.intermediate_size,
        "kv_lora_rank": s.kv_lora_rank, "mlp_bias": False,
        "moe_intermediate_size": s.moe_intermediate_size, "n_group": s.n_group,
        "n_routed_experts": s.num_experts, "n_shared_experts": s.n_shared_experts,
        "norm_topk_prob": False, "pretraining_tp": 1, "q_lora_rank": s.q_lora_rank,
        "qk_head_dim": s.qk_nope_head_dim + s.qk_rope_head_dim,
        "qk_nope_head_dim": s.qk_nope_head_dim, "qk_rope_head_dim": s.qk_rope_head_dim,
        "routed_scaling_factor": float(s.routed_scaling_factor), "topk_group": s.topk_group,
        "topk_method": "group_limited_greedy" if s.n_group > 1 else "greedy",
        "v_head_dim": s.v_head_dim,
    }


def _glm4_moe(s) -> dict:
    return {
        "attention_bias": True, "first_k_dense_replace": s.first_k_dense,
        "head_dim": _head_dim(s), "intermediate_size": s.intermediate_size,
        "moe_intermediate_size": s.moe_intermediate_size, "n_group": s.n_group,
        "n_routed_experts": s.num_experts, "n_shared_experts": s.n_shared_experts,
        "norm_topk_prob": s.norm_topk_prob, "num_nextn_predict_layers": 0,
        "rope_parameters": {"partial_rotary_factor": GLM_PARTIAL_ROTARY,
                            "rope_theta": float(s.rope_theta), "rope_type": "default"},
        "routed_scaling_factor": float(s.routed_scaling_factor), "topk_group": s.topk_group,
        "use_qk_norm": False,
    }


def _gpt_oss(s) -> dict:
    """transformers' GptOssConfig defaults (YaRN factor 32, as gpt-oss's 131072 over 4096
    positions: here over max_position_embeddings / 32; window 128, alternating sliding / full
    layers, SwiGLU alpha 1.702 and limit 7)."""
    return {
        "attention_bias": True, "head_dim": _head_dim(s),
        "intermediate_size": s.moe_intermediate_size,
        "layer_types": ["sliding_attention" if (i + 1) % 2 else "full_attention"
                        for i in range(s.num_layers)],
        "num_local_experts": s.num_experts, "router_aux_loss_coef": 0.001,
        "rope_parameters": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                            "original_max_position_embeddings":
                            max(1, s.max_position_embeddings // 32),
                            "rope_theta": float(s.rope_theta), "rope_type": "yarn",
                            "truncate": False},
        "sliding_window": 128, "swiglu_alpha": 1.702, "swiglu_limit": 7.0,
    }


def _olmoe(s) -> dict:
    return {"attention_bias": False, "clip_qkv": None, "intermediate_size": s.moe_intermediate_size,
            "norm_topk_prob": s.norm_topk_prob, "num_experts": s.num_experts,
            "router_aux_loss_coef": 0.01}


def _qwen_common(s) -> dict:
    return {
        "decoder_sparse_step": 1, "intermediate_size": s.intermediate_size,
        "mlp_only_layers": list(range(s.first_k_dense)),
        "moe_intermediate_size": s.moe_intermediate_size, "norm_topk_prob": s.norm_topk_prob,
        "router_aux_loss_coef": 0.001, "use_sliding_window": False,
    }


def _qwen3_moe(s) -> dict:
    return dict(_qwen_common(s), attention_bias=False, head_dim=_head_dim(s),
                num_local_experts=s.num_experts, sliding_window=None)


def _qwen2_moe(s) -> dict:
    return dict(_qwen_common(s), layer_types=["full_attention"] * s.num_layers,
                max_window_layers=28, num_experts=s.num_experts, qkv_bias=True,
                shared_expert_intermediate_size=s.moe_intermediate_size * s.n_shared_experts,
                sliding_window=0)


def _mixtral(s) -> dict:
    return {"head_dim": None, "intermediate_size": s.moe_intermediate_size,
            "num_local_experts": s.num_experts, "router_aux_loss_coef": 0.001,
            "router_jitter_noise": 0.0, "sliding_window": None}


_FAMILY = {"deepseek_v3": _deepseek_v3, "qwen3_moe": _qwen3_moe, "qwen2_moe": _qwen2_moe,
           "mixtral": _mixtral, "olmoe": _olmoe, "deepseek_v2": _deepseek_v2,
           "glm4_moe": _glm4_moe, "gpt_oss": _gpt_oss}


def hf_config(arch: str, s, ids: dict) -> dict:
    """``config.json`` of the family; ``ids``: ``bos``/``eos`` token ids."""
    return dict(sorted({**_common(arch, s, ids), **_FAMILY[arch](s)}.items()))


def generation_config(ids: dict) -> dict:
    """``generation_config.json``: greedy by default, stops on EOS or the chat turn end."""
    return {"bos_token_id": ids["bos"], "eos_token_id": [ids["eos"], ids["im_end"]]}


# --- tensor layouts ---------------------------------------------------------------------------

def _head_dim(s) -> int:
    return s.head_dim or s.hidden_size // s.num_heads


def _mla(s) -> dict[str, tuple[int, ...]]:
    H, nh = s.hidden_size, s.num_heads
    qk = s.qk_nope_head_dim + s.qk_rope_head_dim
    return {"q_a_proj.weight": (s.q_lora_rank, H), "q_a_layernorm.weight": (s.q_lora_rank,),
            "q_b_proj.weight": (nh * qk, s.q_lora_rank),
            "kv_a_proj_with_mqa.weight": (s.kv_lora_rank + s.qk_rope_head_dim, H),
            "kv_a_layernorm.weight": (s.kv_lora_rank,),
            "kv_b_proj.weight": (nh * (s.qk_nope_head_dim + s.v_head_dim), s.kv_lora_rank),
            "o_proj.weight": (H, nh * s.v_head_dim)}


def _gqa(arch: str, s) -> dict[str, tuple[int, ...]]:
    H, hd = s.hidden_size, _head_dim(s)
    q, kv = s.num_heads * hd, s.num_kv_heads * hd
    out = {"q_proj.weight": (q, H), "k_proj.weight": (kv, H), "v_proj.weight": (kv, H),
           "o_proj.weight": (H, q)}
    if arch in ("qwen2_moe", "glm4_moe"):
        out.update({"q_proj.bias": (q,), "k_proj.bias": (kv,), "v_proj.bias": (kv,)})
    if arch == "qwen3_moe":
        out.update({"q_norm.weight": (hd,), "k_norm.weight": (hd,)})
    if arch == "olmoe":                       # one norm over the whole q (k) projection
        out.update({"q_norm.weight": (q,), "k_norm.weight": (kv,)})
    if arch == "gpt_oss":
        out.update({"q_proj.bias": (q,), "k_proj.bias": (kv,), "v_proj.bias": (kv,),
                    "o_proj.bias": (H,), "sinks": (s.num_heads,)})
    return out


def _mlp(prefix: str, H: int, inter: int) -> dict[str, tuple[int, ...]]:
    return {f"{prefix}gate_proj.weight": (inter, H), f"{prefix}up_proj.weight": (inter, H),
            f"{prefix}down_proj.weight": (H, inter)}


def _moe(arch: str, s) -> dict[str, tuple[int, ...]]:
    H, E, inter = s.hidden_size, s.num_experts, s.moe_intermediate_size
    if arch == "mixtral":
        out = {"block_sparse_moe.gate.weight": (E, H)}
        for e in range(E):
            p = f"block_sparse_moe.experts.{e}."
            out.update({p + "w1.weight": (inter, H), p + "w2.weight": (H, inter),
                        p + "w3.weight": (inter, H)})
        return out
    if arch == "gpt_oss":                     # fused on disk, x @ W layout, gate/up interleaved
        return {"mlp.router.weight": (E, H), "mlp.router.bias": (E,),
                "mlp.experts.gate_up_proj": (E, H, 2 * inter),
                "mlp.experts.gate_up_proj_bias": (E, 2 * inter),
                "mlp.experts.down_proj": (E, inter, H), "mlp.experts.down_proj_bias": (E, H)}
    out = {"mlp.gate.weight": (E, H)}
    if arch in ("deepseek_v3", "glm4_moe"):
        out["mlp.gate.e_score_correction_bias"] = (E,)
    for e in range(E):
        out.update(_mlp(f"mlp.experts.{e}.", H, inter))
    if arch in ("deepseek_v3", "deepseek_v2", "glm4_moe"):
        out.update(_mlp("mlp.shared_experts.", H, inter * s.n_shared_experts))
    if arch == "qwen2_moe":
        out.update(_mlp("mlp.shared_expert.", H, inter * s.n_shared_experts))
        out["mlp.shared_expert_gate.weight"] = (1, H)
    return out


def tensor_shapes(arch: str, s) -> dict[str, tuple[int, ...]]:
    """Every tensor key of the checkpoint -> its shape, in a stable order."""
    H, V = s.hidden_size, s.vocab_size
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, H)}
    attn = _mla(s) if arch in MLA_ARCHS else _gqa(arch, s)
    for i in range(s.num_layers):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,)})
        out.update({p + "self_attn." + k: v for k, v in attn.items()})
        dense = _mlp("mlp.", H, s.intermediate_size) if i < s.first_k_dense else _moe(arch, s)
        out.update({p + k: v for k, v in dense.items()})
    out["model.norm.weight"] = (H,)
    if not s.tie_word_embeddings:
        out["lm_head.weight"] = (V, H)
    return out
