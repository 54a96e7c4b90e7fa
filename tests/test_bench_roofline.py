"""``scripts/bench_roofline.py``'s arithmetic on a generated checkpoint: the weight bytes by
role and the decode-step lower bound (no server; the script itself runs by hand,
docs/benchmarks.md)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from xllm_eplb.model.checkpoint import make_checkpoint

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@pytest.fixture(scope="module")
def roof():
    sys.path.insert(0, str(SCRIPTS))
    try:
        import bench_roofline
    finally:
        sys.path.remove(str(SCRIPTS))
    return bench_roofline


def test_weight_bytes_and_the_decode_bound(roof, tmp_path):
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
