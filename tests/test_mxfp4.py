"""gpt-oss's MXFP4 experts (``make_checkpoint("gpt_oss", quant="mxfp4")``) against transformers:
our dequantization is transformers' ``convert_moe_packed_tensors`` bit for bit, and the served
model gives the tokens (logits within 1e-5 x max|logit|) of transformers running a float32
gpt_oss checkpoint whose experts are transformers' own dequantization of the same blocks and
scales: single process, and on EP2 gloo ranks through live moves of every layer (the blocks,
scales and biases move, the canary checks them)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from hf_parity_util import PROMPTS, REL_TOL, cfg_for, generate, hf_generate, one_thread, rel_err
from safetensors.torch import load_file, save_file

from xllm_eplb.model import mxfp4
from xllm_eplb.model.checkpoint import make_checkpoint
from xllm_eplb.model.decoder import Decoder

pytestmark = pytest.mark.oracle
SIZES = dict(num_layers=3, num_experts=8, top_k=2, hidden_size=64, moe_intermediate_size=32,
             seed=5)


def test_dequantize_is_transformers_rule():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    w = torch.randn(3, 40, 96, generator=torch.Generator().manual_seed(0)) * 3
    blocks, scales = mxfp4.quantize(w)
    assert blocks.dtype == scales.dtype == torch.uint8 and blocks.shape == (3, 40, 3, 16)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)    # [3, 96, 40]
    assert torch.equal(mxfp4.dequantize(blocks, scales, torch.float32), theirs.transpose(1, 2))
    # each value within half of e2m1's largest step (2) times its block's power of two
    step = torch.pow(2.0, scales.float() - 127).repeat_interleave(mxfp4.BLOCK, dim=-1)
    assert ((mxfp4.dequantize(blocks, scales, torch.float32) - w).abs() <= step).all()


@pytest.fixture(scope="module")
def mx(tmp_path_factory):
    """(the MXFP4 checkpoint, a float32 one whose experts are transformers' dequantization of
    its blocks and scales)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    root = tmp_path_factory.mktemp("mxfp4")
    q = make_checkpoint("gpt_oss", root / "gpt_oss", quant="mxfp4", **SIZES)
    ref = root / "ref" / "gpt_oss"
    shutil.copytree(q, ref)
    cfg = json.loads((ref / "config.json").read_text())
    del cfg["quantization_config"]
    (ref / "config.json").write_text(json.dumps(cfg))
    sd = load_file(q / "model.safetensors")
    out = {k: v for k, v in sd.items() if not k.endswith(("_blocks", "_scales"))}
    for k in [k for k in sd if k.endswith("_blocks")]:
        base = k[: -len("_blocks")]
        out[base] = convert_moe_packed_tensors(sd[k], sd[base + "_scales"],
                                               dtype=torch.float32).contiguous()
    save_file(out, ref / "model.safetensors", metadata={"format": "pt"})
    return q, ref


def test_single_process_matches_transformers_on_the_dequantized_experts(mx):
    from xllm_eplb.model.fp8 import quant_info

    q, ref = mx
    assert quant_info(str(q), False) == {"quant_method": "mxfp4", "expert_dequant": "per_step"}
    want_toks, want_logits = hf_generate(ref)
    model = Decoder.reference(cfg_for(q))
    assert model.spec.mxfp4 and model.logical_layers[0].w13.dtype == torch.float32
    with one_thread():
        got = generate(model, list(enumerate(PROMPTS)))
    assert [got[i][0] for i in range(len(PROMPTS))] == want_toks
    worst = max(rel_err(got[i][1], want_logits[i]) for i in range(len(PROMPTS)))
    assert worst < REL_TOL, worst


def _ep_rank(rank, world, path):
    from test_hf_parity import _family_on_rank

    return _family_on_rank(rank, world, path)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ep2_moves_mxfp4_slots_and_matches_transformers(mx):
    from test_hf_parity import SWITCH_STEPS, expected_reads

    from xllm_eplb.testing.dist import run_ranks

    q, ref = mx
    want_toks, want_logits = hf_generate(ref)
    out = run_ranks(_ep_rank, 2, str(q), timeout=280)
    worst = 0.0
    for rank in range(2):
        r = out[rank]
        assert len(r["changed"]) == len(SWITCH_STEPS) and r["routing"] == "balanced"
        assert r["reads_after"] == r["reads_at_load"]
        assert sorted(r["reads_at_load"]) == expected_reads(r)
        assert any("_blocks[" in k for k in r["reads_at_load"])     # MXFP4 bytes, by row
        for i, (toks, logits) in r["got"].items():
            assert toks == want_toks[i], (rank, i)
            worst = max(worst, rel_err(logits, want_logits[i]))
    moved = np.sum([out[rank]["changed"] for rank in range(2)], axis=0)
    assert (moved > 0).all(), moved
    assert worst < REL_TOL, worst
