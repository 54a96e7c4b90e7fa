"""Tiny seeded Hugging Face MoE checkpoints for the tests, built with transformers (test-only).

``build(family, folder, fused=False, **overrides)`` writes ``config.json`` + safetensors with
``save_pretrained`` (per-expert keys, the hub layout; ``fused=True``: transformers' own fused
3-D ``gate_up_proj`` / ``down_proj``). Weights are re-drawn N(0, 1/fan_in) with norms 1 +- 0.1
and a random DeepSeek score-correction bias, so routing is far from uniform. ``hf_model(folder)``
loads the oracle (fp32, eager attention and experts). transformers is imported once per process.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

FAMILIES = ("deepseek_v3", "qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v2",
            "glm4_moe", "gpt_oss")
#: the families the serve-level and every-dispatch-mode tests run (the dispatch paths do not
#: depend on the family; the later families share these servers' code and are checked
#: against transformers in test_hf_parity, EP1/2/4 with live moves and replica routing)
SERVED_FAMILIES = FAMILIES[:4]
#: families whose EP parity runs with per-step replica routing on (``balanced``)
REPLICA_ROUTED = ("olmoe", "deepseek_v2", "glm4_moe", "gpt_oss")
COMMON = dict(vocab_size=512, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
              max_position_embeddings=256, tie_word_embeddings=False)
TINY = {
    "deepseek_v3": dict(q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
                        v_head_dim=12, n_routed_experts=16, n_shared_experts=1,
                        num_experts_per_tok=4, n_group=4, topk_group=2, first_k_dense_replace=1,
                        moe_intermediate_size=32, intermediate_size=96, norm_topk_prob=True,
                        routed_scaling_factor=2.5, num_key_value_heads=4),
    "qwen3_moe": dict(num_key_value_heads=2, head_dim=24, num_experts=16, num_experts_per_tok=4,
                      moe_intermediate_size=32, intermediate_size=96, decoder_sparse_step=1,
                      mlp_only_layers=[1], norm_topk_prob=True),
    "qwen2_moe": dict(num_key_value_heads=2, num_experts=16, num_experts_per_tok=4,
                      moe_intermediate_size=32, intermediate_size=96,
                      shared_expert_intermediate_size=48, mlp_only_layers=[0],
                      norm_topk_prob=False),
    "mixtral": dict(num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
                    intermediate_size=32),
    "olmoe": dict(num_key_value_heads=2, num_experts=16, num_experts_per_tok=4,
                  intermediate_size=32, clip_qkv=1.5, eos_token_id=2),
    "deepseek_v2": dict(q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=16,
                        qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=16,
                        n_shared_experts=2, num_experts_per_tok=4, n_group=4, topk_group=2,
                        topk_method="group_limited_greedy", first_k_dense_replace=1,
                        moe_intermediate_size=32, intermediate_size=96,
                        routed_scaling_factor=1.5),
    "glm4_moe": dict(num_key_value_heads=2, head_dim=24, n_routed_experts=16,
                     n_shared_experts=1, num_experts_per_tok=4, n_group=4, topk_group=2,
                     first_k_dense_replace=1, moe_intermediate_size=32, intermediate_size=96,
                     use_qk_norm=True, attention_bias=True, routed_scaling_factor=2.5),
    # a window of 6 and a SwiGLU limit of 0.6: both bite within the tests' 41 positions and
    # tiny activations; YaRN (factor 4 over 64 original positions), sinks, biases everywhere
    "gpt_oss": dict(num_key_value_heads=2, head_dim=16, num_local_experts=8,
                    num_experts_per_tok=2, intermediate_size=32, sliding_window=6,
                    swiglu_limit=0.6,
                    rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                                     "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                     "original_max_position_embeddings": 64}),
}


def _transformers():
    import transformers

    return transformers


def hf_config(family: str, **overrides):
    tf = _transformers()
    cls = {"deepseek_v3": tf.DeepseekV3Config, "qwen3_moe": tf.Qwen3MoeConfig,
           "qwen2_moe": tf.Qwen2MoeConfig, "mixtral": tf.MixtralConfig,
           "olmoe": tf.OlmoeConfig, "deepseek_v2": tf.DeepseekV2Config,
           "glm4_moe": tf.Glm4MoeConfig, "gpt_oss": tf.GptOssConfig}[family]
    return cls(**{**COMMON, **TINY[family], **overrides})


@torch.no_grad()
def _redraw(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()) + sorted(model.named_buffers()):
        if not p.is_floating_point():
            continue
        if "correction_bias" in name:
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        elif name.endswith("sinks"):            # logits of the order of the scores'
            p.copy_(torch.randn(p.shape, generator=g))
        elif "norm" in name and p.dim() == 1:
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
        elif "inv_freq" in name:
            continue
        elif p.dim() >= 2:
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
        else:
            p.copy_(0.1 * torch.randn(p.shape, generator=g))


def build(family: str, folder: str | Path, *, fused: bool = False, seed: int = 0,
          dtype: torch.dtype = torch.float32, **overrides) -> Path:
    tf = _transformers()
    torch.manual_seed(seed)
    cfg = hf_config(family, **overrides)
    model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager",
                                                experts_implementation="eager")
    _redraw(model, seed)
    model = model.to(dtype)
    folder = Path(folder)
    model.save_pretrained(folder, save_original_format=not fused)
    return folder


def hf_model(folder: str | Path):
    tf = _transformers()
    m = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                attn_implementation="eager",
                                                experts_implementation="eager")
    return m.eval()
