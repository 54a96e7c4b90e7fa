"""Checkpoint loading: both expert layouts, sharded index files, dtypes, and every bad input
(one line naming the file / tensor / field and the rule)."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import hf_util
import numpy as np
import pytest
import torch
from hf_parity_util import PROMPTS, cfg_for, one_thread
from safetensors.torch import load_file, save_file

from xllm_eplb.errors import ConfigError, InputFileError
from xllm_eplb.model.batch import RankBatch, SeqRow
from xllm_eplb.model.decoder import Decoder
from xllm_eplb.model.resolve import resolve_config
from xllm_eplb.model.spec import parse_spec

pytestmark = pytest.mark.oracle  # builds checkpoints with transformers, its oracle


def prefill_logits(path, **model):
    cfg = cfg_for(path)
    cfg = replace(cfg, model=replace(cfg.model, **model))
    with one_thread():
        m = Decoder.reference(cfg)
        res = m.forward_step(RankBatch([SeqRow(i, p, 0, True) for i, p in enumerate(PROMPTS)]),
                             return_logits=True)
    return m, res.logits.numpy()


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_fused_expert_layout_and_sharded_index(family, hf_ckpts, tmp_path):
    seed = hf_util.FAMILIES.index(family)               # same weights as the session fixture
    fused = hf_util.build(family, tmp_path / "fused", fused=True, seed=seed)
    keys = set(load_file(next(fused.glob("*.safetensors"))))
    assert any(k.endswith("experts.gate_up_proj") for k in keys)
    _, want = prefill_logits(hf_ckpts[family])
    m, got = prefill_logits(fused)
    assert np.array_equal(got, want)
    assert any(r.endswith("gate_up_proj[3]") for r in m.reader.reads)   # row reads only
    tf = hf_util.hf_model(hf_ckpts[family])
    tf.save_pretrained(tmp_path / "sharded", max_shard_size="60KB")
    files = sorted((tmp_path / "sharded").glob("*.safetensors"))
    assert len(files) > 2 and (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    _, got = prefill_logits(tmp_path / "sharded")
    assert np.array_equal(got, want)


def test_dtypes(hf_ckpts, tmp_path):
    path = hf_ckpts["qwen2_moe"]
    _, f32 = prefill_logits(path)
    m64, f64 = prefill_logits(path, dtype="float64")
    assert m64.top["embed"].dtype == torch.float64
    assert np.abs(f64 - f32).max() < 1e-5 * np.abs(f64).max()
    for dt in ("bfloat16", "float16"):
        m, lg = prefill_logits(path, dtype=dt)
        assert m.top["embed"].dtype == getattr(torch, dt) and np.isfinite(lg).all()
        assert (lg.argmax(-1) == f32.argmax(-1)).mean() >= 0.5
    bf = hf_util.build("mixtral", tmp_path / "bf16", dtype=torch.bfloat16)
    auto = cfg_for(bf)
    auto = replace(auto, model=replace(auto.model, dtype="auto"))
    assert resolve_config(auto).model.dtype == "bfloat16"           # dtype from config.json
    m, _ = prefill_logits(bf, dtype="auto")
    assert m.top["embed"].dtype == torch.bfloat16
    assert m.routers[0].gate.dtype == torch.bfloat16


def _copy(hf_ckpts, tmp_path, family="qwen3_moe"):
    dst = tmp_path / family
    shutil.copytree(hf_ckpts[family], dst)
    return dst


def _edit_config(path, **kv):
    p = path / "config.json"
    d = json.loads(p.read_text())
    d.update(kv)
    p.write_text(json.dumps(d))


def _one_line(exc_info):
    msg = str(exc_info.value)
    assert "\n" not in msg
    return msg


def test_bad_folders_and_configs(hf_ckpts, tmp_path):
    with pytest.raises(InputFileError, match="not a folder") as ei:
        Decoder.reference(cfg_for(tmp_path / "nope"))
    _one_line(ei)
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputFileError, match=r"empty/config.json: missing"):
        Decoder.reference(cfg_for(tmp_path / "empty"))
    p = _copy(hf_ckpts, tmp_path)
    (p / "config.json").write_text("{not json")
    with pytest.raises(InputFileError, match=r"config.json: cannot read as JSON"):
        Decoder.reference(cfg_for(p))
    p = _copy(hf_ckpts, tmp_path / "a")
    _edit_config(p, model_type="llama")
    with pytest.raises(InputFileError, match=r"'model_type'='llama' is not supported; supported "
                       r"model_types: deepseek_v2, deepseek_v3, glm4_moe, gpt_oss, mixtral, "
                       r"olmoe, qwen2_moe, qwen3_moe"):
        Decoder.reference(cfg_for(p))
    p = _copy(hf_ckpts, tmp_path / "b")
    _edit_config(p, num_experts_per_tok=0)
    with pytest.raises(InputFileError, match=r"'num_experts_per_tok'=0 must be an integer >= 1"):
        Decoder.reference(cfg_for(p))
    p = _copy(hf_ckpts, tmp_path / "c", "deepseek_v3")
    with pytest.raises(ConfigError, match=r"config.json: n_routed_experts=16 \(routed experts per "
                       r"MoE layer\): must be divisible by --ep_size=3"):
        Decoder.reference(cfg_for(p, ep_size=3))


@pytest.mark.parametrize("family, edit, match", [
    ("deepseek_v2", dict(mlp_bias=True), r"'mlp_bias'=True is not supported"),
    ("deepseek_v2", dict(topk_method="noaux_tc"), r"'topk_method'='noaux_tc' is not supported "
     r"\(greedy or group_limited_greedy\)"),
    ("deepseek_v2", dict(n_group=3), r"'n_group'=3 must divide the 16 routed experts"),
    ("deepseek_v2", dict(topk_group=1, num_experts_per_tok=5),
     r"'num_experts_per_tok'=5 must be <= topk_group=1 x 4 experts per group"),
    ("glm4_moe", dict(rope_parameters={"rope_theta": 1e4, "rope_type": "default",
                                       "partial_rotary_factor": 0.125}),
     r"'partial_rotary_factor'=0.125 must rotate an even number >= 2 of the head_dim=24 "
     r"dims \(got 3\)"),
    ("glm4_moe", dict(rope_parameters={"rope_theta": 1e4, "rope_type": "default",
                                       "partial_rotary_factor": 1.5}),
     r"'partial_rotary_factor'=1.5 must be a number in \(0, 1\]"),
    ("olmoe", dict(head_dim=8), r"'head_dim'=8 must be hidden_size / num_attention_heads"),
    ("olmoe", dict(clip_qkv=-1), r"'clip_qkv'=-1 must be a positive number"),
    ("gpt_oss", dict(layer_types=["full_attention", "chunked_attention", "full_attention"]),
     r"'layer_types'=\[.*\] must list 3 of full_attention / sliding_attention"),
    ("gpt_oss", dict(quantization_config={"quant_method": "mxfp4"}, intermediate_size=48),
     r"'intermediate_size'=48 must be a multiple of 32 \(MXFP4 experts"),
    ("gpt_oss", dict(quantization_config={"quant_method": "bitsandbytes"}),
     r"'quantization_config.quant_method'='bitsandbytes' is not supported"),
    ("qwen3_moe", dict(quantization_config={"quant_method": "mxfp4"}),
     r"'quantization_config.quant_method'='mxfp4' is not supported"),
])
def test_new_families_refuse_what_they_cannot_serve(hf_ckpts, tmp_path, family, edit, match):
    p = _copy(hf_ckpts, tmp_path, family)
    _edit_config(p, **edit)
    with pytest.raises(InputFileError, match=match) as ei:
        parse_spec(p)
    assert str(p / "config.json") in _one_line(ei)


def test_new_families_read_what_their_configs_say(hf_ckpts):
    """The family details transformers' configs carry, as the spec reads them."""
    o, v2, g = (parse_spec(hf_ckpts[f]) for f in ("olmoe", "deepseek_v2", "glm4_moe"))
    assert (o.qk_norm, o.qk_norm_per_head, o.clip_qkv, o.norm_topk_prob) == (True, False, 1.5,
                                                                              False)
    assert o.moe_layers == (0, 1, 2) and o.moe_intermediate_size == 32
    assert (v2.scoring, v2.topk_method, v2.n_group, v2.topk_group) == ("softmax",
                                                                       "group_limited_greedy", 4, 2)
    assert (v2.norm_topk_prob, v2.routed_scaling_factor, v2.mla.q_lora_rank) == (False, 1.5, None)
    assert v2.shared_intermediate_size == 64 and v2.moe_layers == (1, 2)
    assert (g.scoring, g.rotary_dim, g.head_dim, g.qk_norm, g.attn_bias, g.o_bias) == (
        "sigmoid", 12, 24, True, True, False)
    assert g.shared_intermediate_size == 32 and g.moe_layers == (1, 2)
    o = parse_spec(hf_ckpts["gpt_oss"])
    assert (o.sinks, o.sliding_window, o.sliding_layers, o.router_bias, o.expert_bias) == (
        True, 6, (0, 2), True, True)
    assert (o.swiglu_limit, o.swiglu_alpha, o.rope_scaling["factor"]) == (0.6, 1.702, 4.0)


def test_bad_tensors(hf_ckpts, tmp_path):
    p = _copy(hf_ckpts, tmp_path / "a")
    _edit_config(p, moe_intermediate_size=40)
    with pytest.raises(InputFileError, match=r"model.safetensors: tensor "
                       r"'model.layers.0.mlp.experts.0.gate_proj.weight' has shape \[32, 64\], "
                       r"config.json needs \[40, 64\]"):
        Decoder.reference(cfg_for(p))
    p = _copy(hf_ckpts, tmp_path / "b")
    sd = load_file(p / "model.safetensors")
    del sd["model.layers.2.mlp.experts.5.down_proj.weight"]
    save_file(sd, p / "model.safetensors")
    with pytest.raises(InputFileError, match=r"missing tensor "
                       r"'model.layers.2.mlp.experts.5.down_proj.weight'"):
        Decoder.reference(cfg_for(p))
    p = _copy(hf_ckpts, tmp_path / "c")
    raw = (p / "model.safetensors").read_bytes()
    (p / "model.safetensors").write_bytes(raw[:8] + b"\x00garbage" + raw[16:])
    with pytest.raises(InputFileError, match=r"model.safetensors: corrupt safetensors header") \
            as ei:
        Decoder.reference(cfg_for(p))
    _one_line(ei)
    n = int.from_bytes(raw[:8], "little")
    (p / "model.safetensors").write_bytes(raw[:8 + n + 100])        # truncated data
    with pytest.raises(InputFileError, match=r"corrupt safetensors header entry for tensor"):
        Decoder.reference(cfg_for(p))
    (p / "model.safetensors").unlink()
    with pytest.raises(InputFileError, match=r"no \*.safetensors file"):
        Decoder.reference(cfg_for(p))
    (p / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"lm_head.weight": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(InputFileError, match=r"index.json: names file "
                       r"'model-00001-of-00002.safetensors', which is missing"):
        Decoder.reference(cfg_for(p))


def test_header_offsets_must_span_the_shapes_bytes(hf_ckpts, tmp_path):
    """Tensors are read by their data_offsets: an entry whose span is not its shape's bytes is
    a corrupt header (named), not a silently misread tensor."""
    p = _copy(hf_ckpts, tmp_path / "a")
    raw = (p / "model.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    hdr = json.loads(raw[8:8 + n])
    name = "model.layers.2.mlp.experts.3.up_proj.weight"
    hdr[name]["shape"] = [hdr[name]["shape"][0] // 2, hdr[name]["shape"][1]]   # half its span
    body = json.dumps(hdr, separators=(",", ":")).encode()
    assert len(body) <= n
    body = body.ljust(n)                                # same header length: offsets stay valid
    (p / "model.safetensors").write_bytes(raw[:8] + body + raw[8 + n:])
    with pytest.raises(InputFileError, match=rf"corrupt safetensors header entry for tensor "
                       rf"'{name}'.*as long as the shape's bytes") as ei:
        Decoder.reference(cfg_for(p))
    _one_line(ei)
