"""The FP8 per-step expert path chunk by chunk (``Fp8Slots.dense_range`` feeding
``moe.grouped_ffn(chunks=)``): the same dequantized weights as ``fp8.dequantize``, and the same
outputs as the resident dequantized cache, bit for bit, at several chunk sizes: one layer's
expert compute (decode-like, sparse, hot-expert and prefill-like rows; fp32 and bf16) and whole
decoder steps of a generated FP8 checkpoint (a prefill, then decode batches whose active
experts are not a contiguous range of slots) on a 1-rank gloo group."""

from __future__ import annotations

import pytest
import torch

from xllm_eplb.config import Config, EplbConfig, ModelConfig
from xllm_eplb.eplb.placement import initial_phy2log
from xllm_eplb.model import expert_store, fp8
from xllm_eplb.model.batch import RankBatch, SeqRow
from xllm_eplb.model.checkpoint import make_checkpoint
from xllm_eplb.model.moe import FusedMoE, chunk_spans

H, INTER, E = 48, 24, 12
BLOCK = (16, 16)                     # INTER 24 and H 48 / 16: partial edge blocks in w2's grid


def _source(layer, e, out):
    """Logical expert e: seeded weights quantized into the slot's tensors (gate, up, down)."""
    g = torch.Generator().manual_seed(100 * layer + e)
    for j in range(2):
        out["w13_q"][j * INTER:(j + 1) * INTER], out["w13_s"][j] = fp8.quantize(
            torch.randn(INTER, H, generator=g), BLOCK)
    out["w2_q"][:], out["w2_s"][:] = fp8.quantize(torch.randn(H, INTER, generator=g), BLOCK)
    return out


def _layer(cache: bool, dtype: str) -> FusedMoE:
    cfg = Config(eplb=EplbConfig(ep_size=1, redundant_experts_num=0),
                 model=ModelConfig(num_experts=E, hidden_size=H, moe_intermediate_size=INTER,
                                   dtype=dtype, fp8_dequant_cache=cache))
    return FusedMoE(cfg, 0, 0, initial_phy2log(E, 1, 0), source=_source,
                    quant=fp8.Fp8Format(block=BLOCK))


@pytest.mark.parametrize("name", ["float32", "bfloat16"])
def test_dense_range_is_the_rule(name):
    store, dtype = _layer(False, name).store, getattr(torch, name)
    for a, b in [(0, 2), (3, 6), (10, 12), (0, E)]:
        w13, w2 = store.dense_range(a, b)
        assert w13.dtype == w2.dtype == dtype and w13.shape == (b - a, 2 * INTER, H)
        for k, s in enumerate(range(a, b)):
            for j in range(2):
                rows = slice(j * INTER, (j + 1) * INTER)
                want = fp8.dequantize(store.w13_q[s, rows], store.w13_s[s, j], BLOCK, dtype)
                assert torch.equal(w13[k, rows], want)
            assert torch.equal(w2[k], fp8.dequantize(store.w2_q[s], store.w2_s[s], BLOCK, dtype))


def test_chunk_spans_never_leave_one_expert_alone():
    assert chunk_spans(1, 2) == [(0, 1)]
    assert chunk_spans(5, 2) == [(0, 2), (2, 5)]
    assert chunk_spans(6, 3) == [(0, 3), (3, 6)]
    assert chunk_spans(7, 3) == [(0, 3), (3, 7)]
    assert chunk_spans(4, 8) == [(0, 4)]


def _rows(kind: str, g: torch.Generator) -> torch.Tensor:
    """Slot ids of the rows of one layer: every slot (decode-like), a few scattered ones,
    one hot expert, or many rows (prefill-like)."""
    if kind == "decode":
        return torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(16)]).reshape(-1)
    if kind == "sparse":
        return torch.tensor([9, 2, 2, 5, 11, 9, 2])
    if kind == "hot":
        return torch.tensor([4] * 40 + [7, 8])
    return torch.randint(0, E, (300,), generator=g)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("chunk", [2, 3, E])
def test_chunked_layer_equals_cache(dtype, chunk, monkeypatch):
    cached, per_step = _layer(True, dtype), _layer(False, dtype)
    monkeypatch.setattr(expert_store, "CHUNK_BYTES", 1 if chunk == 2 else 10 ** 9)
    if chunk == 3:                           # between the forced minimum and one chunk
        per = per_step.store.w2_q[0].numel() * 3 * (6 + (dtype != "float32") * 2)
        monkeypatch.setattr(expert_store, "CHUNK_BYTES", 3 * per)
    assert per_step.store.chunk == chunk
    calls = []
    spy = per_step.store.dense_range
    per_step.store.dense_range = lambda a, b: calls.append((a, b)) or spy(a, b)
    g = torch.Generator().manual_seed(chunk)
    for kind in ("decode", "sparse", "hot", "prefill"):
        slots = _rows(kind, g)
        x = torch.randn(slots.numel(), H, generator=g).to(getattr(torch, dtype))
        calls.clear()
        assert torch.equal(per_step.compute(x, slots), cached.compute(x, slots)), kind
        used = {s for a, b in calls for s in range(a, b)}
        assert set(slots.tolist()) <= used              # every active slot dequantized
        if kind == "decode":        # the padded batched GEMMs: chunks of 2+ experts
            assert all(b - a >= 2 for a, b in calls) and (len(calls) > 1) == (chunk < E)


def _steps_on_rank(rank, world, path):
    import torch.distributed as dist

    from xllm_eplb.model.decoder import Decoder

    expert_store.CHUNK_BYTES = 1                        # chunks of 2 experts at these sizes
    models = {cache: Decoder(Config(eplb=EplbConfig(ep_size=1, redundant_experts_num=0),
                                    model=ModelConfig(model=str(path), dtype="float32",
                                                      fp8_dequant_cache=cache)),
                             0, dist.group.WORLD) for cache in (True, False)}
    assert models[False].moe_layers[0].store.cache is None
    prompts = {1: [5, 9, 17, 3, 44], 2: [7, 7, 8], 3: [100, 2, 60, 61, 9, 12, 30]}
    batch = RankBatch([SeqRow(r, p, 0, True) for r, p in prompts.items()])
    pos = {r: len(p) for r, p in prompts.items()}
    last, out = {}, []
    for rows in ([1, 2, 3], [2], [3, 1], [1], [1, 2, 3]):
        res = {c: m.forward_step(batch, return_logits=True, return_routing=True)
               for c, m in models.items()}
        a, b = res[True], res[False]
        active = [sorted(set(ids.reshape(-1).tolist())) for ids in a.routed]
        out.append((bool(torch.equal(a.logits, b.logits)), a.sampled == b.sampled, active))
        last.update(a.sampled)
        batch = RankBatch([SeqRow(r, [last[r]], pos[r], False) for r in rows])
        for r in rows:
            pos[r] += 1
    return out


@pytest.mark.slow      # a gloo rank in its own process (testing/dist.run_ranks)
def test_decoder_steps_chunked_equal_cached(tmp_path):
    from xllm_eplb.testing.dist import run_ranks

    path = make_checkpoint("qwen3_moe", tmp_path / "fp8", quant="fp8", block_size=(16, 32),
                           num_layers=3, num_experts=16, top_k=2, seed=4)
    (steps,) = run_ranks(_steps_on_rank, 1, path, timeout=180)
    assert [s[:2] for s in steps] == [(True, True)] * len(steps)
    # a decode step of one row: 2 experts per layer, not neighbours in some layer
    gaps = [ids for _, _, act in steps[1:] for ids in act if ids[-1] - ids[0] >= len(ids)]
    assert gaps
