"""Greedy generation on the engine's model (single process or one EP rank) and on transformers,
for the family parity tests. Logits are compared relative to the oracle's max |logit|."""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from xllm_eplb.config import Config, EplbConfig, ModelConfig
from xllm_eplb.model.batch import RankBatch, SeqRow

PROMPTS = [[5, 17, 300, 42, 8, 9, 100, 77, 23], [7, 3], [11, 12, 13, 14, 15],
           [250, 251, 252, 253, 254, 255, 256]]
N_NEW = 32
REL_TOL = 1e-5


def cfg_for(path, ep_size: int = 4, *, dequant_cache: bool = False, **eplb) -> Config:
    return Config(eplb=EplbConfig(ep_size=ep_size, enable_eplb=True, eplb_canary=True, **eplb),
                  model=ModelConfig(model=str(path), dtype="float32",
                                    fp8_dequant_cache=dequant_cache))


@contextlib.contextmanager
def one_thread():
    """Tiny models on a shared 2-core machine: intra-op threads only contend (measured 5-10x
    slower with 2 threads under load)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def hf_generate(folder, prompts=PROMPTS, n=N_NEW):
    """-> (tokens [P][n], logits [P] float64 [n, V]) from transformers.generate (greedy), one
    prompt at a time (no padding in the oracle)."""
    import hf_util

    with one_thread():
        return _hf_generate(hf_util.hf_model(folder), prompts, n)


def _hf_generate(hf, prompts, n):
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    toks, logits = [], []
    with torch.no_grad():
        for p in prompts:
            out = hf.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, output_logits=True, return_dict_in_generate=True)
            toks.append(out.sequences[0, len(p):].tolist())
            logits.append(torch.stack([x[0] for x in out.logits]).double().numpy())
    return toks, logits


def generate(model, rows: list[tuple[int, list[int]]], n=N_NEW, *, pure_flags=True,
             between=None, n_steps=None):
    """Greedy generation of ``rows`` [(req_id, prompt)] on one model (one rank).
    ``between(step)`` runs before each step > 0 (live placement changes). Every rank must run
    the same number of steps (``n_steps``, default n). -> {req_id: (tokens, logits [n, V])}."""
    out = {rid: ([], []) for rid, _ in rows}
    last = {rid: p for rid, p in rows}
    pos = {rid: 0 for rid, _ in rows}
    for step in range(n_steps or n):
        if between is not None and step:
            between(step)
        batch = RankBatch([SeqRow(rid, last[rid], pos[rid], step == 0) for rid, _ in rows])
        res = model.forward_step(batch, pure_decode=(step > 0) if pure_flags else None,
                                 return_logits=True)
        for j, (rid, _) in enumerate(rows):
            pos[rid] += len(last[rid])
            last[rid] = [res.sampled[rid]]
            out[rid][0].append(res.sampled[rid])
            out[rid][1].append(res.logits[j].numpy())
    return {rid: (t, np.stack(lg)) for rid, (t, lg) in out.items()}


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())
