"""FP8 block-scaled checkpoints (``make_checkpoint(quant="fp8")``) against transformers (with
``accelerate``, which dequantizes them at load on CPU): every dequantized expert weight bit for
bit, greedy tokens single-process (EP1) and on EP2 / EP4 gloo ranks with live moves of every
layer, per-step dequantization and the resident cache; and the move of weights + scales
itself (on the EP2 ranks): a scale swap, a flipped scale byte caught by the canary, the bytes
counted."""

from __future__ import annotations

from dataclasses import replace

import hf_util
import numpy as np
import pytest
import torch
from hf_parity_util import PROMPTS, REL_TOL, cfg_for, generate, hf_generate, one_thread, rel_err

from xllm_eplb.model import fp8
from xllm_eplb.model.checkpoint import make_checkpoint
from xllm_eplb.model.decoder import Decoder

#: deepseek_v3: square 16 blocks, f32 scales (kv_a_proj_with_mqa, 40 rows, stays unquantized);
#: qwen3_moe: non-square 16 x 32 blocks, bf16 scales
CASES = {"deepseek_v3": dict(block_size=16, scale_dtype="float32"),
         "qwen3_moe": dict(block_size=(16, 32), scale_dtype="bfloat16")}
#: single-process only (the same loader and store; F16 scales and mixtral's w1/w3/w2 names;
#: glm4_moe as GLM-4.5-FP8 ships: the q/k/v biases and the router stay unquantized)
EP1_ONLY = {"mixtral": dict(block_size=(32, 16), scale_dtype="float32", num_experts=8, top_k=2),
            "qwen2_moe": dict(block_size=16, scale_dtype="float16"),
            "glm4_moe": dict(block_size=16, scale_dtype="bfloat16")}
_HF: dict = {}


@pytest.fixture(scope="session")
def fp8_ckpts(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("fp8_ckpts")
    return {f: make_checkpoint(f, root / f, quant="fp8", num_experts=16, num_layers=3, seed=3,
                               **kw) for f, kw in CASES.items()}


def tf_model(path, dtype):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation="eager", experts_implementation="eager")


def oracle(path):
    if str(path) not in _HF:
        _HF[str(path)] = hf_generate(path)
    return _HF[str(path)]


@pytest.mark.oracle
@pytest.mark.parametrize("family", sorted(CASES) + sorted(EP1_ONLY))
def test_dequantized_weights_and_ep1_tokens_match_transformers(family, fp8_ckpts, tmp_path):
    if family in CASES:
        path, case = fp8_ckpts[family], CASES[family]
    else:
        case = dict(EP1_ONLY[family])
        path = make_checkpoint(family, tmp_path / family, quant="fp8", num_layers=3, seed=3,
                               num_experts=case.pop("num_experts", 16), **case)
    hf = hf_util.hf_model(path)
    params = dict(hf.named_parameters())
    model = Decoder.reference(cfg_for(path))
    b = case["block_size"]
    assert model.expert_quant == fp8.Fp8Format(block=(b, b) if isinstance(b, int) else b)
    for ml, lm in enumerate(model.logical_layers):
        i = model.spec.moe_layers[ml]
        assert torch.equal(lm.w13, params[f"model.layers.{i}.mlp.experts.gate_up_proj"])
        assert torch.equal(lm.w2, params[f"model.layers.{i}.mlp.experts.down_proj"])
    # the non-expert FP8 Linears, dequantized once at load, too
    attn = "q_a_proj" if family == "deepseek_v3" else "q_proj"        # FP8 in every family
    short = "q_a" if family == "deepseek_v3" else "q"
    for i, layer in enumerate(model.layers):
        assert torch.equal(layer[short], params[f"model.layers.{i}.self_attn.{attn}.weight"])
    # bf16 models: the same rule casts once to bf16 (transformers dequantizes into the dtype)
    hf16 = tf_model(path, torch.bfloat16)
    cfg = cfg_for(path)
    m16 = Decoder.reference(replace(cfg, model=replace(cfg.model, dtype="bfloat16")))
    p16 = dict(hf16.named_parameters())
    for ml, lm in enumerate(m16.logical_layers):
        i = m16.spec.moe_layers[ml]
        assert lm.w13.dtype == torch.bfloat16
        assert torch.equal(lm.w13, p16[f"model.layers.{i}.mlp.experts.gate_up_proj"])
        assert torch.equal(lm.w2, p16[f"model.layers.{i}.mlp.experts.down_proj"])
    want_toks, want_logits = oracle(path)
    with one_thread():
        got = generate(model, list(enumerate(PROMPTS)))
    assert [got[i][0] for i in range(len(PROMPTS))] == want_toks
    worst = max(rel_err(got[i][1], want_logits[i]) for i in range(len(PROMPTS)))
    print(f"{family} fp8 EP1 max rel logit err {worst:.2e}")
    assert worst < REL_TOL


def _fp8_on_rank(rank, world, paths):
    from test_hf_parity import _family_on_rank

    out = {(f, cache): _family_on_rank(rank, world, p, cache)
           for f, p in paths.items() for cache in (False, True)}
    if world == 2:                  # the scale swap shares these ranks (no second spawn)
        out["swap"] = _swap_on_rank(rank, world)
    return out


@pytest.mark.slow
@pytest.mark.oracle
@pytest.mark.timeout(400)
@pytest.mark.parametrize("world", [2, 4])
def test_fp8_expert_parallel_matches_transformers_across_live_moves(world, fp8_ckpts):
    from test_hf_parity import SWITCH_STEPS, expected_reads

    from xllm_eplb.testing.dist import run_ranks

    paths = {f: str(p) for f, p in fp8_ckpts.items()}
    out = run_ranks(_fp8_on_rank, world, paths, timeout=380)
    if world == 2:
        check_swap([o.pop("swap") for o in out])
    for (f, cache) in out[0]:
        want_toks, want_logits = oracle(paths[f])
        worst = 0.0
        for rank in range(world):
            r = out[rank][(f, cache)]
            assert len(r["changed"]) == len(SWITCH_STEPS)
            assert r["reads_after"] == r["reads_at_load"]
            # only the rank's experts: their fp8 bytes and their scales
            assert sorted(r["reads_at_load"]) == expected_reads(r), (f, world, rank)
            for i, (toks, logits) in r["got"].items():
                assert toks == want_toks[i], (f, cache, world, i)
                worst = max(worst, rel_err(logits, want_logits[i]))
        moved = np.sum([out[rank][(f, cache)]["changed"] for rank in range(world)], axis=0)
        assert (moved > 0).all(), (f, world, moved)
        print(f"{f} fp8 cache={cache} EP{world} max rel logit err {worst:.2e}")
        assert worst < REL_TOL


# ---- the move of weights + scales ------------------------------------------------------------

E, H, INTER, BLOCK = 8, 64, 32, (16, 16)


def _swap_source(layer, e, out):
    """Experts 0 and 5: the same fp8 bytes, different scales; 1 and 6: the same scales,
    different bytes; the others seeded."""
    g = torch.Generator().manual_seed({5: 0, 6: 106}.get(e, 100 + e))
    for name, t in out.items():
        if name.endswith("_q"):
            t.copy_((torch.randn(t.shape, generator=g) * 40).clamp(-448, 448).to(fp8.FP8))
        else:
            t.copy_(torch.rand(t.shape, generator=torch.Generator().manual_seed(
                {5: 500, 6: 1}.get(e, e))) + 0.5)
    return out


def _swap_on_rank(rank, world):
    from types import SimpleNamespace

    from xllm_eplb.config import Config, EplbConfig, ModelConfig
    from xllm_eplb.eplb.placement import initial_phy2log
    from xllm_eplb.kernels import fused_experts
    from xllm_eplb.model.expert_store import make_store
    from xllm_eplb.model.moe import FusedMoE, grouped_ffn
    from xllm_eplb.worker.comm import groups_from_world
    from xllm_eplb.worker.migration import EplbCanaryError, ModelEplbHooks

    cfg = Config(eplb=EplbConfig(ep_size=world, redundant_experts_num=0),
                 model=ModelConfig(num_experts=E, hidden_size=H, moe_intermediate_size=INTER,
                                   dtype="float32", num_layers=2))
    groups = groups_from_world(cfg)
    fmt = fp8.Fp8Format(block=BLOCK)
    old = initial_phy2log(E, world, 0)                 # rank 0: 0..3, rank 1: 4..7
    fm = FusedMoE(cfg, 0, rank, old, source=_swap_source, quant=fmt)
    hooks = ModelEplbHooks(SimpleNamespace(moe_layers=[fm]), groups.eplb_group, cfg, canary=True)
    new = old.copy()
    new[[0, 5]], new[[1, 6]] = old[[5, 0]], old[[6, 1]]     # swap 0<->5 and 1<->6 across ranks
    assert hooks.prepare_expert_weight(0, new)
    hooks.start_expert_weight_transfer(0)
    st = hooks.update_expert_weight(0)
    # every slot's tensors are the checkpoint's bytes of its new logical expert
    ref = make_store(E, H, INTER, torch.float32, "cpu", fmt=fmt)
    for e in range(E):
        _swap_source(0, e, ref.slot(e))
    exact = all(torch.equal(t.view(torch.uint8), ref.slot(int(e))[n].view(torch.uint8))
                for s, e in enumerate(fm.local_expert_ids.tolist())
                for n, t in fm.store.slot(s).items())
    x = torch.randn(4, H, generator=torch.Generator().manual_seed(9))
    outs = {}
    for s, e in enumerate(fm.local_expert_ids.tolist()):
        w13, w2 = ref.dense(torch.tensor([e]))
        got = fm.compute(x, torch.full((4,), s))
        zero = torch.zeros(4, dtype=torch.int64)
        # the same expert computation the layer runs (the fused kernel or the torch path)
        want = (fused_experts(x, zero, w13, w2) if fm.fused else grouped_ffn(x, w13, w2, zero))
        outs[e] = (bool(torch.equal(got, want)),
                   got.numpy())          # numpy: torch tensors through the result queue race
    # a flipped scale byte after the move: the canary names the layer and the slot
    caught = ""
    if rank == 1:
        fm.store.w2_s.view(torch.uint8)[2].view(-1)[3] ^= 0x40
        try:
            hooks.check_canary(0)
        except EplbCanaryError as exc:
            caught = str(exc)
    return {"exact": exact, "match": {e: v[0] for e, v in outs.items()},
            "out": {e: v[1] for e, v in outs.items()}, "ids": fm.local_expert_ids.tolist(),
            "p2p_bytes": st.p2p_bytes, "slot_bytes": st.slot_bytes,
            "recv": st.recv_slots, "send": st.send_slots, "caught": caught}


def check_swap(r: list[dict]) -> None:
    """Scales move with their bytes (two experts with the same fp8 bytes and different scales,
    two with the same scales and different bytes, swapped across 2 ranks: every slot holds its
    new expert's bytes and computes with its own scales), the moved bytes count the scales, and
    a scale byte flipped after the move fails the canary naming layer and slot."""
    assert r[0]["ids"] == [5, 6, 2, 3] and r[1]["ids"] == [4, 0, 1, 7]
    assert r[0]["exact"] and r[1]["exact"]
    assert all(r[0]["match"].values()) and all(r[1]["match"].values())
    # same fp8 bytes, different scales -> different outputs; each follows its own scales
    assert not np.array_equal(r[0]["out"][5], r[1]["out"][0])
    gI, gH = -(-INTER // 16), -(-H // 16)
    slot = 2 * INTER * H + 2 * gI * gH * 4 + H * INTER + gH * gI * 4 + 2 * 8 + 8
    assert r[0]["slot_bytes"] == slot
    for q in r:                             # 2 slots each way: bytes + scales + tag + checksum
        assert q["send"] == q["recv"] == 2 and q["p2p_bytes"] == 4 * slot
    assert "EPLB canary: layer 0 rank 1 slot 2" in r[1]["caught"]
    assert "checksum" in r[1]["caught"]
