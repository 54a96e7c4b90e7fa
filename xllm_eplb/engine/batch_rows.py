"""The rows a DP rank runs per step: ``--max_batch_size`` bounded by the KV cache.

``--max_batch_size`` (vLLM's ``--max-num-seqs``, default 256) is what a user asks for; a rank
can only hold as many requests as their KV caches fit at the model's full length. The rule:

    rows = min(max_batch_size, kv_cache_bytes // (max_position_embeddings x kv_bytes_per_token))

with ``kv_bytes_per_token`` = layers x cached heads x (key dim + value dim) x dtype bytes (the
worker's ``KVCache`` layout; MLA caches the decompressed heads). The engine applies it once at
start-up and logs it in one line (``engine batch rows``); the scheduler, the KV-usage gauge and
the workload's backlog use the bounded value. The bound depends only on the config and the
checkpoint, so every node of a multi-node run computes the same one.
"""

from __future__ import annotations

import dataclasses

from xllm_eplb.config import Config

_DTYPE_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2, "auto": 4}


def kv_bytes_per_token(cfg: Config) -> int:
    """Bytes one cached position takes over all layers of one request."""
    m = cfg.model
    if m.model:
        from xllm_eplb.model.blocks import kv_dims
        from xllm_eplb.model.spec import parse_spec

        spec = parse_spec(m.model)
        heads, kd, vd = kv_dims(spec)
        layers = spec.num_layers
    else:                       # no checkpoint resolved (unit tests): plain multi-head K and V
        heads, kd, vd, layers = 1, m.hidden_size, m.hidden_size, m.num_layers
    return layers * heads * (kd + vd) * _DTYPE_BYTES.get(m.dtype, 4)


def batch_rows(cfg: Config) -> tuple[int, str]:
    """(rows per DP rank, one line saying how they were decided)."""
    rt, L = cfg.runtime, cfg.model.max_position_embeddings
    per_req = L * kv_bytes_per_token(cfg)
    fit = max(1, rt.kv_cache_bytes // per_req)
    rows = min(rt.max_batch_size, fit)
    why = (f"max_batch_size={rt.max_batch_size}" if rows == rt.max_batch_size else
           f"bounded by the KV cache: --kv_cache_bytes={rt.kv_cache_bytes} holds {fit} requests "
           f"of max_position_embeddings={L} at {per_req} bytes each "
           f"(--max_batch_size={rt.max_batch_size} asked)")
    return rows, why


def with_batch_rows(cfg: Config) -> tuple[Config, str]:
    """``cfg`` with ``runtime.max_batch_size`` = :func:`batch_rows`, and the line to log."""
    rows, why = batch_rows(cfg)
    return dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime,
                                                                max_batch_size=rows)), why
