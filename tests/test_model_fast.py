"""The fast paths of the model step against their plain definitions: the padded batched expert
GEMMs against one GEMM pair per expert, the vectorised fp8 decode against torch's conversion,
the FP8 per-step scratch against fresh tensors, and the step timer's phases."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from xllm_eplb.config import Config, EplbConfig, ModelConfig
from xllm_eplb.model import fp8
from xllm_eplb.model import moe as moe_mod
from xllm_eplb.model.batch import RankBatch, SeqRow
from xllm_eplb.model.decoder import Decoder
from xllm_eplb.model.default_checkpoint import with_default_checkpoint
from xllm_eplb.model.expert_store import DequantScratch, make_store
from xllm_eplb.obs.step_timer import NULL, StepTimer


def _per_expert(x, w13, w2, idx):
    out = torch.empty_like(x)
    for e in idx.unique().tolist():
        sel = idx == e
        out[sel] = moe_mod.expert_ffn(x[sel], w13[e], w2[e])
    return out


@pytest.mark.parametrize("counts", [[1, 0, 1, 1, 0, 0], [3, 1, 0, 5, 2, 2], [0, 0, 40, 1, 0, 0],
                                    [0, 2, 0, 0, 0, 1]])
def test_grouped_ffn_both_paths_equal_per_expert(counts):
    g = torch.Generator().manual_seed(len(counts) + sum(counts))
    M, H, inter = len(counts), 24, 8
    w13 = torch.randn(M, 2 * inter, H, generator=g, dtype=torch.float64)
    w2 = torch.randn(M, H, inter, generator=g, dtype=torch.float64)
    idx = torch.repeat_interleave(torch.arange(M), torch.tensor(counts))
    idx = idx[torch.randperm(idx.numel(), generator=g)]
    x = torch.randn(idx.numel(), H, generator=g, dtype=torch.float64)
    want = _per_expert(x, w13, w2, idx)
    got = moe_mod.grouped_ffn(x, w13, w2, idx)
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)
    # the other path too: the padded one forced on, then the loop forced on
    for pad in (True, False):
        orig = moe_mod._use_padded
        moe_mod._use_padded = lambda c, pad=pad: pad
        try:
            assert torch.allclose(moe_mod.grouped_ffn(x, w13, w2, idx), want,
                                  rtol=1e-12, atol=1e-12)
        finally:
            moe_mod._use_padded = orig
    assert moe_mod.grouped_ffn(x[:0], w13, w2, idx[:0]).shape == (0, H)


def test_padded_chosen_for_decode_and_loop_for_a_hot_expert():
    assert moe_mod._use_padded([4] * 32)                 # batch 32 decode, top-4 of 32
    assert moe_mod._use_padded([1, 1, 0, 1])             # one row per expert
    assert not moe_mod._use_padded([1] + [0] * 30 + [1])  # two far-apart experts: read 32
    assert not moe_mod._use_padded([200] + [1] * 31)     # a hot expert: padding 31 x 200 rows


def test_fp8_decode_equals_torch_for_every_finite_code():
    codes = torch.arange(256, dtype=torch.uint8).view(fp8.FP8)
    want, got = codes.to(torch.float32), fp8.decode(codes)
    finite = ~want.isnan()
    assert int(finite.sum()) == 254
    assert torch.equal(got[finite].view(torch.int32), want[finite].view(torch.int32))  # +-0
    work = torch.empty(300, dtype=torch.int16)
    assert torch.equal(fp8.decode(codes.view(16, 16), work=work)[finite.view(16, 16)],
                       want.view(16, 16)[finite.view(16, 16)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_with_work_buffers_is_the_rule(dtype):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(40, 72, generator=g)
    q, s = fp8.quantize(w, (16, 32))
    want = (q.to(torch.float32) * s.repeat_interleave(16, 0)[:40].repeat_interleave(32, 1)[:, :72]
            ).to(dtype)
    work = (torch.empty(40 * 72, dtype=torch.int16), torch.empty(40 * 72, dtype=torch.float32))
    for kw in ({}, {"work": work}):
        assert torch.equal(fp8.dequantize(q, s, (16, 32), dtype, **kw), want)
        out = torch.empty(40, 72, dtype=dtype)
        assert torch.equal(fp8.dequantize(q, s, (16, 32), dtype, out=out, **kw), want)
    a = fp8.dequantize(q, s, (16, 32), dtype, work=work)
    b = fp8.dequantize(q[:8], s[:1], (16, 32), dtype, work=work)
    assert torch.equal(a, want)                    # a result never aliases the work buffer
    assert b.shape == (8, 72)


def test_fp8_per_step_scratch_equals_fresh_and_cache():
    fmt = fp8.Fp8Format(block=(16, 16))
    scratch = DequantScratch()
    stores = [make_store(4, 32, 16, torch.float32, "cpu", fmt=fmt, scratch=scratch),
              make_store(4, 32, 16, torch.float32, "cpu", fmt=fmt, cache=True)]
    g = torch.Generator().manual_seed(0)
    for s in range(4):
        for name, w in (("w13", torch.randn(32, 32, generator=g)),
                        ("w2", torch.randn(32, 16, generator=g))):
            q, sc = fp8.quantize(w, fmt.block)       # gate / up grids: I = 16 is block-aligned
            for st in stores:
                slot = st.slot(s)
                slot[name + "_q"].copy_(q)
                slot[name + "_s"].copy_(sc.view(slot[name + "_s"].shape))
    stores[1].refresh(range(4))
    ids = torch.tensor([3, 1, 1, 3])
    w13, w2, idx = stores[0].weights(ids)
    f13, f2 = stores[0].dense(torch.tensor([1, 3]))
    assert torch.equal(w13, f13) and torch.equal(w2, f2) and idx.tolist() == [1, 0, 0, 1]
    c13, c2, _ = stores[1].weights(ids)
    assert torch.equal(c13[[1, 3]], f13) and torch.equal(c2[[1, 3]], f2)


def _cfg() -> Config:
    return with_default_checkpoint(Config(eplb=EplbConfig(ep_size=2), model=replace(
        ModelConfig(), num_layers=3, num_experts=8, num_experts_per_tok=2, hidden_size=32,
        moe_intermediate_size=16, intermediate_size=48, dtype="float64")))


def test_decoder_timer_phases_and_null_default():
    model = Decoder.reference(_cfg())
    assert model.timer is NULL
    rows = [SeqRow(1, [5, 6, 7], 0, True), SeqRow(2, [8], 0, True)]
    a = model.forward_step(RankBatch(rows), return_logits=True)
    timer = StepTimer()
    model.time_phases(timer)
    b = Decoder.reference(_cfg())
    b.time_phases(timer)
    got = b.forward_step(RankBatch(rows), return_logits=True)
    assert torch.equal(a.logits, got.logits)                 # timing changes nothing
    ph = timer.take()
    assert {"attention", "router", "experts", "dispatch", "sampling", "other"} <= set(ph)
    assert all(v >= 0 for v in ph.values())
    assert sum(ph.values()) <= got.timings["total_s"] + 1e-3


def _sharded_timed(rank, world, cfg):
    import torch.distributed as dist

    model = Decoder(cfg, rank, dist.group.WORLD)
    timer = StepTimer()
    model.time_phases(timer)
    res = model.forward_step(RankBatch([SeqRow(1, [5, 6, 7], 0, True)]), return_logits=True)
    return timer.take(), res.timings["total_s"], res.logits.numpy()


@pytest.mark.slow      # a gloo rank in its own process (testing/dist.run_ranks)
def test_sharded_decoder_times_dispatch_and_experts_apart():
    from xllm_eplb.testing.dist import run_ranks

    cfg = _cfg()
    cfg = replace(cfg, eplb=replace(cfg.eplb, ep_size=1, redundant_experts_num=0))
    (ph, total, logits), = run_ranks(_sharded_timed, 1, cfg, timeout=120)
    assert {"attention", "router", "experts", "dispatch", "sampling", "other"} <= set(ph)
    assert ph["experts"] > 0 and ph["dispatch"] >= 0
    assert sum(ph.values()) <= total + 1e-3
    ref = Decoder.reference(cfg).forward_step(RankBatch([SeqRow(1, [5, 6, 7], 0, True)]),
                                              return_logits=True)
    assert torch.allclose(torch.as_tensor(logits), ref.logits, rtol=1e-9, atol=1e-9)
