"""Chunked prefill on the real model: a prompt longer than --max_prefill_tokens, scheduled in
chunks by the real Scheduler beside another request's decode rows, gives the tokens and logits
of one whole-prompt prefill (greedy, float64); also for gpt_oss, whose sliding-window layers
(128 positions) span chunk boundaries."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from xllm_eplb.config import Config, EplbConfig, ModelConfig
from xllm_eplb.engine.scheduler import Request, Scheduler, is_pure_decode_step
from xllm_eplb.model.batch import RankBatch, SeqRow
from xllm_eplb.model.decoder import Decoder
from xllm_eplb.model.default_checkpoint import with_default_checkpoint

SMALL = ModelConfig(num_layers=3, num_experts=16, num_experts_per_tok=2, hidden_size=32,
                    moe_intermediate_size=16, intermediate_size=48, dtype="float64",
                    max_position_embeddings=512)
N_NEW = 6


def _whole(model: Decoder, prompt: list[int]) -> tuple[list[int], list[np.ndarray]]:
    """Greedy tokens and their logits with the prompt prefilled in one row."""
    toks, logits, last, pos = [], [], prompt, 0
    for step in range(N_NEW):
        res = model.forward_step(RankBatch([SeqRow(1, last, pos, step == 0)]),
                                 pure_decode=step > 0, return_logits=True)
        pos += len(last)
        last = [res.sampled[1]]
        toks.append(res.sampled[1])
        logits.append(res.logits[0].numpy())
    model.release([1])
    return toks, logits


@pytest.mark.parametrize("arch", ["deepseek_v3", "gpt_oss"])
def test_chunked_prefill_gives_the_tokens_and_logits_of_one_prefill(arch):
    cfg = with_default_checkpoint(Config(eplb=EplbConfig(ep_size=4),
                                         model=replace(SMALL, model_arch=arch)))
    model = Decoder.reference(cfg)
    prompt = [int(x) for x in np.random.default_rng(3).integers(0, 512, size=300)]
    want, want_logits = _whole(model, prompt)

    s = Scheduler(dp_size=1, max_batch_size=4, max_prefill_tokens=64)
    other = s.submit(Request(prompt=[7, 8, 9], max_tokens=12, stop_at_eos=False))
    long = s.submit(Request(prompt=prompt, max_tokens=N_NEW, stop_at_eos=False))
    s.pull()
    got_logits, chunks, beside = [], 0, 0
    while not long.done.is_set():
        batches = s.schedule()
        rows = batches[0].rows
        chunk = any(r.req_id == long.req_id and r.is_prefill for r in rows)
        chunks += chunk
        beside += chunk and any(r.req_id == other.req_id and not r.is_prefill for r in rows)
        res = model.forward_step(batches[0], pure_decode=is_pure_decode_step(batches),
                                 return_logits=True)
        mine = [j for j, r in enumerate(rows) if r.req_id == long.req_id]
        if mine and rows[mine[0]].start_pos + len(rows[mine[0]].token_ids) >= len(prompt):
            got_logits.append(res.logits[mine[0]].numpy())          # not a partial chunk
        s.update(res.sampled)
    assert chunks == beside == 5       # 300 = 4 x 64 + 44, each beside the other's decode row
    assert long.output == want and long.finish_reason == "length"
    for g, w in zip(got_logits, want_logits, strict=True):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-9 * np.abs(w).max())
