"""The fused CPU kernels (``xllm_eplb.kernels``) against torch: one MoE layer's experts and the
dense linear, fp32 and bf16, every instruction-set variant this CPU runs; slots with 0, 1,
2-16 and 100+ rows, non-contiguous active slots, one expert on several slots; biases and
gpt-oss's clamped SwiGLU; batch invariance (a row's output is the same bits alone, in any
batch, in any order, at any thread count); the FP8 paths; bad input; the torch fallback when
the library is absent."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from xllm_eplb import kernels
from xllm_eplb.config import Config, EplbConfig, ModelConfig
from xllm_eplb.eplb.placement import initial_phy2log
from xllm_eplb.kernels import build
from xllm_eplb.model import dense, fp8
from xllm_eplb.model.moe import FusedMoE, grouped_ffn

# odd sizes: tails after the 16/32-wide vector steps in both GEMMs
S, H, W = 12, 100, 36
DTYPES = [torch.float32, torch.bfloat16]


def test_the_library_is_built_by_the_install():
    assert kernels.load(), kernels.unavailable_reason()
    assert kernels.isas()[-1] == "generic" and len(kernels.isas()) >= 2


ISAS = kernels.isas() or ["generic"]


def _weights(dtype, g, s=S, h=H, i=W):
    w13 = (torch.randn(s, 2 * i, h, generator=g) / h ** 0.5).to(dtype)
    w2 = (torch.randn(s, h, i, generator=g) / i ** 0.5).to(dtype)
    return w13, w2


def _slots(g) -> torch.Tensor:
    """Rows per slot: 0, 1, 2, 3, 5, 8, 16, 130 and 0s between (non-contiguous active slots),
    shuffled."""
    per = {1: 1, 2: 2, 4: 3, 5: 5, 7: 8, 8: 16, 10: 130}
    ids = torch.cat([torch.full((n,), s) for s, n in per.items()])
    return ids[torch.randperm(len(ids), generator=g)]


def _err(y, ref):
    return (y.double() - ref).abs().max().item()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_experts_match_torch_at_least_as_closely_as_torch_itself(dtype, isa):
    g = torch.Generator().manual_seed(0)
    w13, w2 = _weights(dtype, g)
    slots = _slots(g)
    x = torch.randn(len(slots), H, generator=g).to(dtype)
    ref = grouped_ffn(x.double(), w13.double(), w2.double(), slots)     # float64 reference
    y = kernels.fused_experts(x, slots, w13, w2, isa=isa)
    assert y.dtype == dtype and y.shape == x.shape
    torch_err = _err(grouped_ffn(x, w13, w2, slots), ref)
    assert _err(y, ref) <= 2 * torch_err + 1e-6, (_err(y, ref), torch_err)


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_expert_on_several_slots_gives_the_same_bits(dtype):
    g = torch.Generator().manual_seed(1)
    w13, w2 = _weights(dtype, g)
    w13[9], w2[9] = w13[3], w2[3]                        # slot 9 replicates slot 3's expert
    x = torch.randn(20, H, generator=g).to(dtype)
    a = kernels.fused_experts(x, torch.full((20,), 3), w13, w2)
    b = kernels.fused_experts(x, torch.tensor([9, 3] * 10), w13, w2)
    assert torch.equal(a, b)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_experts_are_batch_invariant(dtype, isa):
    g = torch.Generator().manual_seed(2)
    w13, w2 = _weights(dtype, g)
    slots = _slots(g)
    x = torch.randn(len(slots), H, generator=g).to(dtype)
    full = kernels.fused_experts(x, slots, w13, w2, isa=isa)
    for n in (1, 3, 17, len(slots)):
        idx = torch.randperm(len(slots), generator=g)[:n]
        assert torch.equal(kernels.fused_experts(x[idx], slots[idx], w13, w2, isa=isa),
                           full[idx])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(kernels.fused_experts(x, slots, w13, w2, isa=isa), full)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_matches_torch_and_is_batch_invariant(dtype, isa):
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(70, H, generator=g) / H ** 0.5).to(dtype)
    b = torch.randn(70, generator=g).to(dtype)
    x = torch.randn(150, H, generator=g).to(dtype)
    ref = F.linear(x.double(), w.double(), b.double())
    y = kernels.linear(x, w, b, isa=isa)
    assert _err(y, ref) <= 2 * _err(F.linear(x, w, b), ref) + 1e-6
    for n in (1, 5, 64):
        idx = torch.randperm(150, generator=g)[:n]
        assert torch.equal(kernels.linear(x[idx], w, b, isa=isa), y[idx])
    assert kernels.linear(x.view(3, 50, H), w, isa=isa).shape == (3, 50, 70)


def _act_ref(g, u, act, alpha, limit):
    if act == "silu":
        return F.silu(g) * u
    g, u = g.clamp(max=limit), u.clamp(-limit, limit)
    return (u + 1) * g * torch.sigmoid(alpha * g)


@pytest.mark.parametrize("act", sorted(kernels.ACTIVATIONS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_biases_and_activations(dtype, act):
    g = torch.Generator().manual_seed(4)
    w13, w2 = _weights(dtype, g)
    w13 = w13 * 4                                   # gate/up values beyond the clamp limit
    b13 = torch.randn(S, 2 * W, generator=g).to(dtype)
    b2 = torch.randn(S, H, generator=g).to(dtype)
    slots = _slots(g)
    x = torch.randn(len(slots), H, generator=g).to(dtype)
    alpha, limit = 1.702, 3.0
    d = {n: t.double() for n, t in dict(x=x, w13=w13, w2=w2, b13=b13, b2=b2).items()}
    hu = torch.einsum("nh,nkh->nk", d["x"], d["w13"][slots]) + d["b13"][slots]
    h = _act_ref(hu[:, :W], hu[:, W:], act, alpha, limit)
    ref = torch.einsum("ni,nhi->nh", h, d["w2"][slots]) + d["b2"][slots]
    y = kernels.fused_experts(x, slots, w13, w2, b13, b2, act=act, alpha=alpha, limit=limit)
    tol = 1e-4 if dtype == torch.float32 else 0.05
    assert _err(y, ref) <= tol * ref.abs().max().item()
    assert (hu[:, :W] > limit).any()                 # the clamp was exercised


def test_empty_batch_and_bad_input_name_the_rule():
    g = torch.Generator().manual_seed(5)
    w13, w2 = _weights(torch.float32, g)
    x = torch.randn(4, H)
    assert kernels.fused_experts(x[:0], torch.empty(0, dtype=torch.int64), w13, w2).shape == (0, H)
    with pytest.raises(RuntimeError, match=r"slots\[2\]=12 is outside \[0, 12\)"):
        kernels.fused_experts(x, torch.tensor([0, 1, 12, 3]), w13, w2)
    with pytest.raises(RuntimeError, match="Double is not supported"):
        kernels.fused_experts(x.double(), torch.zeros(4, dtype=torch.int64), w13.double(),
                              w2.double())
    with pytest.raises(RuntimeError, match="w13 must be contiguous"):
        kernels.fused_experts(x, torch.zeros(4, dtype=torch.int64), w13[:, ::2], w2)
    with pytest.raises(RuntimeError, match="w2 dtype BFloat16 differs"):
        kernels.fused_experts(x, torch.zeros(4, dtype=torch.int64), w13, w2.bfloat16())
    with pytest.raises(RuntimeError, match="isa='nope' is not available on this CPU; available"):
        kernels.linear(x, w2[0], isa="nope")
    with pytest.raises(ValueError, match="act='relu' is not one of"):
        kernels.fused_experts(x, torch.zeros(4, dtype=torch.int64), w13, w2, act="relu")


def _fp8_layer(cache: bool, dtype: str, kernel: str) -> FusedMoE:
    block = (16, 16)

    def source(layer, e, out):
        gen = torch.Generator().manual_seed(100 * layer + e)
        for j in range(2):
            out["w13_q"][j * 32:(j + 1) * 32], out["w13_s"][j] = fp8.quantize(
                torch.randn(32, 64, generator=gen), block)
        out["w2_q"][:], out["w2_s"][:] = fp8.quantize(torch.randn(64, 32, generator=gen), block)
        return out

    cfg = Config(eplb=EplbConfig(ep_size=1, redundant_experts_num=0),
                 model=ModelConfig(num_experts=8, hidden_size=64, moe_intermediate_size=32,
                                   dtype=dtype, fp8_dequant_cache=cache, moe_kernel=kernel))
    return FusedMoE(cfg, 0, 0, initial_phy2log(8, 1, 0), source=source,
                    quant=fp8.Fp8Format(block=block))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fp8_per_step_and_cached_on_the_kernel(dtype):
    layers = {(c, k): _fp8_layer(c, dtype, k) for c in (True, False) for k in ("fused", "torch")}
    assert layers[(True, "fused")].fused and not layers[(True, "torch")].fused
    g = torch.Generator().manual_seed(6)
    slots = torch.tensor([6, 1, 1, 3, 6, 6, 0] * 5)
    x = torch.randn(len(slots), 64, generator=g).to(getattr(torch, dtype))
    y = {key: m.compute(x, slots) for key, m in layers.items()}
    assert torch.equal(y[(True, "fused")], y[(False, "fused")])      # per step == cache, bitwise
    tol = 1e-4 if dtype == "float32" else 0.05
    scale = y[(True, "torch")].abs().max().item()
    assert _err(y[(True, "fused")], y[(True, "torch")].double()) <= tol * scale


def test_without_the_library_the_model_runs_torch_and_says_why(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(kernels, "_state", {})
    monkeypatch.setattr(build, "library_path", lambda t=None: tmp_path / "missing.so")
    monkeypatch.setattr(dense, "_logged", set())
    assert "not built for these sources" in kernels.supports(torch.float32, "cpu")
    with caplog.at_level(logging.INFO, logger="xllm_eplb.model.dense"):
        layer = _fp8_layer(True, "float32", "fused")
    assert not layer.fused
    assert "moe kernel" in caplog.text and "using=torch" in caplog.text
    assert "not built" in caplog.text
    x = torch.randn(5, 64)
    slots = torch.tensor([0, 7, 7, 2, 0])
    assert torch.equal(layer.compute(x, slots), _fp8_layer(True, "float32", "torch").compute(x, slots))


def test_float64_and_non_cpu_use_torch():
    assert "float64" in kernels.supports(torch.float64, "cpu")
    assert "meta" in kernels.supports(torch.float32, "meta")
    assert not dense.resolve("fused", torch.float64, "cpu")
    assert not dense.resolve("torch", torch.float32, "cpu")
    assert dense.resolve("fused", torch.float32, "cpu")
