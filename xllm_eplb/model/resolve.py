"""Fill the architecture fields of ``cfg.model`` from the checkpoint's config.json.

The manager, aggregator, placement and engine read ``cfg.model.num_experts``,
``cfg.num_moe_layers`` (= ``num_layers - first_k_dense_replace``), ``vocab_size``,
``max_position_embeddings`` ...; with ``--model PATH`` those come from the checkpoint, never
from flags. ``first_k_dense_replace`` reports the number of dense layers (for qwen's
``decoder_sparse_step`` / ``mlp_only_layers`` they need not lead; the model keeps the real
indices in ``ModelSpec.moe_layers``). ``dtype=auto`` becomes the checkpoint's dtype.
"""

from __future__ import annotations

from dataclasses import replace

from xllm_eplb.config import Config
from xllm_eplb.config.fields import ModelConfig
from xllm_eplb.errors import ConfigError
from xllm_eplb.model.spec import ModelSpec, parse_spec


def arch_fields(spec: ModelSpec) -> dict:
    """The ``ModelConfig`` fields a checkpoint determines."""
    inter = spec.moe_intermediate_size
    n_shared = -(-spec.shared_intermediate_size // inter) if spec.shared_intermediate_size else 0
    return dict(num_layers=spec.num_layers, first_k_dense_replace=spec.first_dense,
                num_experts=spec.num_experts, num_experts_per_tok=spec.top_k,
                n_shared_experts=n_shared, hidden_size=spec.hidden_size,
                moe_intermediate_size=inter, intermediate_size=spec.intermediate_size,
                num_attention_heads=spec.num_heads, vocab_size=spec.vocab_size,
                max_position_embeddings=spec.max_position_embeddings,
                scoring_func=spec.scoring)


def context_cap(m: ModelConfig, spec: ModelSpec) -> int:
    """The served context with ``--model``: the checkpoint's ``max_position_embeddings``, or
    less when ``--max-model-len`` / ``--context-length`` (``--max_position_embeddings``) asks
    for less (vLLM's meaning: cap the context); more is a ConfigError. NOTE: the field's
    default (2048) reads as not given."""
    asked, have = m.max_position_embeddings, spec.max_position_embeddings
    if asked == ModelConfig().max_position_embeddings:
        return have
    if asked > have:
        raise ConfigError(f"--max_position_embeddings={asked} (--max-model-len, "
                          f"--context-length): must be <= the checkpoint's "
                          f"max_position_embeddings={have} ({m.model}/config.json)")
    return asked


def resolve_config(cfg: Config, spec: ModelSpec | None = None) -> Config:
    """``cfg`` with the checkpoint's architecture (unchanged without ``--model``); the context
    capped by :func:`context_cap`."""
    m = cfg.model
    if not m.model:
        return cfg if m.dtype != "auto" else replace(cfg, model=replace(m, dtype="float32"))
    spec = spec or parse_spec(m.model)
    dtype = spec.dtype if m.dtype == "auto" else m.dtype
    arch = arch_fields(spec) | {"max_position_embeddings": context_cap(m, spec)}
    return replace(cfg, model=replace(m, dtype=dtype, **arch))
