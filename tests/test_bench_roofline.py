"""``testing/roofline.py``, the arithmetic ``scripts/bench_roofline.py`` and
``scripts/bench_families.py`` use, on a generated checkpoint: the weight bytes by role, the
decode-step lower bound and the active parameters (no server; the scripts run by hand,
docs/benchmarks.md)."""

from __future__ import annotations

import pytest

from xllm_eplb.model.checkpoint import make_checkpoint
from xllm_eplb.testing import roofline as roof


def test_weight_bytes_and_the_decode_bound(tmp_path):
    H, inter, E, L, V = 64, 32, 8, 3, 512
    d = make_checkpoint("qwen3_moe", tmp_path / "q", hidden_size=H, moe_intermediate_size=inter,
                        num_experts=E, top_k=2, num_layers=L, first_k_dense=0, vocab_size=V)
    w = roof.weight_bytes(d)
    assert w["experts"] == {i: E * 3 * H * inter * 4 for i in range(L)}
    assert w["embed"] == V * H * 4
    total = (d / "model.safetensors").stat().st_size
    assert 0 < total - (w["dense"] + w["embed"] + sum(w["experts"].values())) < 64 * 1024
    # a machine whose GEMMs are free: the bound is the bytes a step must read
    mach = {"read_bytes_per_s": 1e9, "gemm_batch_flops": 1e30, "gemm_1024_flops": 1e30}
    r = roof.roofline(d, batch=4, prompt_len=8, new=3, touched=5.0, mach=mach)
    kv_token = L * 2 * (2 * 16) * 4           # layers x kv heads x (k + v dim) x fp32
    per_expert = 3 * H * inter * 4
    steps = [w["dense"] + L * 5.0 * per_expert + 4 * ctx * kv_token for ctx in (9, 10)]
    assert r["decode_step_s"] == pytest.approx(sum(steps) / 2 / 1e9)
    assert r["tokens_per_s"] == pytest.approx(4 * 3 / r["total_s"])
    # compute-bound (1 FLOP/s): 2 FLOPs per active parameter per row, plus attention
    slow = dict(mach, gemm_batch_flops=1.0, gemm_1024_flops=1.0)
    per_row = 2 * (w["dense_params"] + L * 2 * 3 * H * inter)           # top-2 experts
    attn = [4 * ctx * 2 * L * 4 * (16 + 16) for ctx in (9, 10)]          # 4 heads, q.k and p.v
    assert roof.roofline(d, 4, 8, 3, 5.0, slow)["decode_step_s"] == pytest.approx(
        4 * per_row + sum(attn) / 2)


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_bench_families_counts_the_active_parameters(arch, tmp_path):
    """``scripts/bench_families.py``'s count: every non-embedding tensor of the file plus top-k
    experts per MoE layer (gpt_oss: with their biases), against the file's own tensors."""
    from safetensors.torch import load_file

    H, inter, E, k = 64, 32, 8, 2
    d = make_checkpoint(arch, tmp_path / arch, hidden_size=H, moe_intermediate_size=inter,
                        num_experts=E, top_k=k, num_layers=2, first_k_dense=0)
    sd = load_file(d / "model.safetensors")
    expert = sum(t.numel() for n, t in sd.items() if ".experts." in n)
    rest = sum(t.numel() for n, t in sd.items()
               if ".experts." not in n and n != "model.embed_tokens.weight")
    model = roof.reference_decoder(d)
    assert roof.active_params(model) == rest + expert * k // E
