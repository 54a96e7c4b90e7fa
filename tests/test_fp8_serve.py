"""`xllm-eplb serve --model <FP8 checkpoint>`: greedy tokens over HTTP equal
transformers.generate before and after EPLB moved experts (weights + scales) live, with
per-step dequantization at EP4 and the resident cache at EP2 (and at EP1, one rank without
EPLB, the cache); /v1/models and /eplb/status
report the quantization; the move's log line and the P2P byte counter count the scales."""

from __future__ import annotations

import re

import pytest
from hf_parity_util import hf_generate
from test_fp8_parity import CASES
from test_serve import _get, _wait
from test_serve_hf import N_NEW, PROMPTS, _generate

from xllm_eplb.model.checkpoint import make_checkpoint


@pytest.mark.slow
@pytest.mark.oracle
@pytest.mark.timeout(300)
@pytest.mark.parametrize("family,ep,cache", [("deepseek_v3", 4, False), ("qwen3_moe", 2, True),
                                              ("deepseek_v3", 1, True)])
def test_serve_fp8_checkpoint_moves_experts_with_transformers_tokens(family, ep, cache,
                                                                      tmp_path, start_server):
    path = make_checkpoint(family, tmp_path / family, quant="fp8", num_experts=16, num_layers=3,
                           seed=3, **CASES[family])
    want, _ = hf_generate(path, PROMPTS, N_NEW)
    eplb = (["--enable_eplb=true", "--eplb_update_interval=2", "--workload=synthetic",
             "--workload_rate=6", "--workload_output_len=16", "--workload_prompt_len=8",
             "--eplb_min_peak_load_improvement=0"] if ep > 1 else [])   # EP1: one rank, no EPLB
    s = start_server("--model", str(path), "--ep-size", str(ep), f"--fp8_dequant_cache={cache}",
                     *eplb)
    s.wait_ready(180)
    q = _get(s.url + "/v1/models")["data"][0]["quantization"]
    mode = "cache" if cache else "per_step"
    assert q["quant_method"] == "fp8" and q["expert_dequant"] == mode, q
    assert _generate(s, ignore_eos=True) == [(w, "length") for w in want]
    if ep == 1:
        return
    st = _wait(lambda: (lambda st: st if st["layers_committed"] >= 2 else None)(
        _get(s.url + "/eplb/status")), 150, "two committed layers", s)
    assert st["slots_moved"] > 0 and st["quantization"]["expert_dequant"] == mode
    assert _generate(s, ignore_eos=True) == [(w, "length") for w in want]
    # one slot = fp8 gate/up/down + f32 scale grids + tag + checksum
    H, inter = 64, 32
    b = CASES[family]["block_size"]
    bn, bk = (b, b) if isinstance(b, int) else b
    g = 2 * -(-inter // bn) * -(-H // bk) + -(-H // bn) * -(-inter // bk)
    slot = 3 * inter * H + 4 * g + 24
    logs = "".join(p.read_text() for p in s.log_dir.rglob("*.log"))
    moved = [int(m) for m in re.findall(r"update_expert_weight .*slot_bytes=(\d+)", logs)]
    assert moved and set(moved) == {slot}, (moved[:4], slot)
    sent = re.search(r'xllm_eplb_p2p_bytes_total\{direction="sent"\} ([0-9.e+]+)',
                     _get(s.url + "/metrics").decode())
    assert sent and float(sent.group(1)) > 0 and float(sent.group(1)) % slot == 0
