"""One step's rows flattened into the tensors the decoder's layers read.

:func:`step_inputs` checks every row against the KV cache (its ``start_pos`` is the cached
length, its positions fit ``max_position_embeddings``), reserves the rows' cache slots and
returns :class:`StepInputs`. In graph mode a pure-decode (or empty) batch is padded to its
decode bucket (:func:`step.graph_bucket`); padding and filler rows are routed and dispatched
but never counted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from xllm_eplb.config import Config
from xllm_eplb.model.attention import AttnBatch, KVCache
from xllm_eplb.model.batch import RankBatch
from xllm_eplb.model.step import graph_bucket


@dataclass
class StepInputs:
    """``toks``/``pos`` int64 [T] (T = real + padding rows), ``keys`` int64 [T, 3] (req_id,
    position, token id: trace routing), ``counted`` bool [T] (rows counted in the expert load),
    ``spans`` [(first row, n)] per request, ``n_real`` real rows, ``ab`` the attention layout
    of the real rows (None for an empty batch)."""

    toks: torch.Tensor
    pos: torch.Tensor
    keys: torch.Tensor
    counted: torch.Tensor
    spans: list[tuple[int, int]]
    n_real: int
    ab: AttnBatch | None


def _padding(cfg: Config, batch: RankBatch, n_real: int) -> int:
    """Graph-mode padding rows of a batch of ``n_real`` real rows."""
    if cfg.runtime.enable_graph and (batch.is_empty or batch.is_pure_decode):
        return graph_bucket(n_real, cfg.runtime.max_batch_size) - n_real
    return 0


def dispatched_rows(cfg: Config, batches: list[RankBatch]) -> list[int]:
    """Rows every rank dispatches in a step (real + graph-mode padding; ``StepInputs.toks``'
    length on that rank), from the step's batches of every rank."""
    out = []
    for b in batches:
        n = sum(len(r.token_ids) for r in b.rows)
        out.append(n + _padding(cfg, b, n))
    return out


def step_inputs(cfg: Config, kv: KVCache, batch: RankBatch, device: torch.device) -> StepInputs:
    """The step's inputs (see the module docstring); reserves the rows' KV-cache slots."""
    toks, pos, keys, counted, spans = [], [], [], [], []
    decode_only = cfg.eplb.eplb_use_decode_only_load
    max_pos = cfg.model.max_position_embeddings
    for r in batch.rows:
        n = len(r.token_ids)
        if n == 0:
            raise ValueError(f"request {r.req_id}: empty token_ids")
        have = kv.length(r.req_id)
        if r.start_pos != have:
            raise ValueError(f"request {r.req_id}: start_pos={r.start_pos} but the KV cache "
                             f"holds {have} positions")
        if r.start_pos + n > max_pos:
            raise ValueError(f"request {r.req_id}: {r.start_pos + n} positions exceed "
                             f"max_position_embeddings={max_pos}")
        spans.append((len(toks), n))
        toks += r.token_ids
        pos += range(r.start_pos, r.start_pos + n)
        keys += [(r.req_id, r.start_pos + j, t) for j, t in enumerate(r.token_ids)]
        counted += [not (decode_only and r.is_prefill)] * n
    n_real = len(toks)
    slots = kv.reserve([r.req_id for r in batch.rows],
                       [r.start_pos + len(r.token_ids) for r in batch.rows])
    ab = AttnBatch(spans, [r.start_pos for r in batch.rows], slots, device) \
        if batch.rows else None
    n_pad = _padding(cfg, batch, n_real)
    if n_pad:
        toks += [0] * n_pad
        pos += [0] * n_pad
        keys += [(-1, j, 0) for j in range(n_pad)]
        counted += [False] * n_pad
    return StepInputs(torch.tensor(toks, dtype=torch.int64, device=device),
                      torch.tensor(pos, dtype=torch.int64, device=device),
                      torch.tensor(keys, dtype=torch.int64, device=device).reshape(-1, 3),
                      torch.tensor(counted, dtype=torch.bool, device=device), spans, n_real, ab)
