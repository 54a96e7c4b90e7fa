"""FP8 block-scaled experts without transformers: the dequantization rule, the slot store
(per-step vs resident cache), the slot checksum over the scales, the transport's uint8 view,
and every bad input of an FP8 checkpoint as one ``error:`` line with exit 2."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from xllm_eplb.cli import cli
from xllm_eplb.config import Config, EplbConfig, ModelConfig
from xllm_eplb.eplb.placement import initial_phy2log
from xllm_eplb.errors import InputFileError
from xllm_eplb.model import fp8
from xllm_eplb.model.checkpoint import make_checkpoint
from xllm_eplb.model.decoder import Decoder
from xllm_eplb.model.expert_store import slot_checksum
from xllm_eplb.model.moe import FusedMoE
from xllm_eplb.worker.p2p import chunk

H, INTER, E, BLOCK = 64, 32, 8, (16, 32)


def _expected(q, s, block, dtype):
    """The rule element by element: fp32 decode times the element's block scale, one cast."""
    R, C = q.shape
    rows = torch.arange(R) // block[0]
    cols = torch.arange(C) // block[1]
    return (q.to(torch.float32) * s.to(torch.float32)[rows][:, cols]).to(dtype)


@pytest.mark.parametrize("shape,block", [((64, 32), (16, 32)), ((40, 64), (16, 16)),
                                         ((48, 20), (128, 128))])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequantize_is_the_fp32_product_with_one_cast(shape, block, scale_dtype):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    q, s = fp8.quantize(w, block, scale_dtype)
    assert q.dtype == fp8.FP8 and s.dtype == scale_dtype
    assert tuple(s.shape) == fp8.grid(shape, block)
    assert bool((s.to(torch.float32) > 0).all())
    for dt in (torch.float32, torch.bfloat16):
        got = fp8.dequantize(q, s, block, dt)
        assert torch.equal(got, _expected(q, s, block, dt))
    # within e4m3's precision of the source (3 mantissa bits: relative step 1/8)
    err = (fp8.dequantize(q, s, block, torch.float64) - w).abs()
    assert bool((err <= w.abs() / 8 + 1e-6).all())


def test_bf16_multiply_is_not_the_rule():
    """Why the rule casts once: multiplying in bf16 rounds twice and gives other weights."""
    w = torch.randn(64, 32, generator=torch.Generator().manual_seed(2))
    q, s = fp8.quantize(w, (16, 16))
    exact = fp8.dequantize(q, s, (16, 16), torch.bfloat16)
    rows, cols = torch.arange(64) // 16, torch.arange(32) // 16
    bf16 = q.to(torch.bfloat16) * s.to(torch.bfloat16)[rows][:, cols]
    assert not torch.equal(exact, bf16)


def _fmt():
    return fp8.Fp8Format(block=BLOCK)


def _fp8_source(seed=0):
    """Logical expert e of any layer: quantized seeded weights written into the slot ``out``."""
    def src(layer, e, out):
        g = torch.Generator().manual_seed(seed * 1000 + layer * 100 + e)
        for j in range(2):
            q, s = fp8.quantize(torch.randn(INTER, H, generator=g), BLOCK)
            out["w13_q"][j * INTER:(j + 1) * INTER] = q
            out["w13_s"][j] = s
        out["w2_q"][:], out["w2_s"][:] = fp8.quantize(torch.randn(H, INTER, generator=g), BLOCK)
        return out
    return src


def _cfg(cache: bool, D: int = 2) -> Config:
    return Config(eplb=EplbConfig(ep_size=D, redundant_experts_num=1),
                  model=ModelConfig(num_experts=E, hidden_size=H, moe_intermediate_size=INTER,
                                    dtype="float32", fp8_dequant_cache=cache))


def test_fp8_slots_per_step_and_cache_compute_identically():
    table = initial_phy2log(E, 2, 1)
    x = torch.randn(300, H, generator=torch.Generator().manual_seed(3))
    outs = {}
    for cache in (False, True):
        fm = FusedMoE(_cfg(cache), 0, 1, table, source=_fp8_source(), quant=_fmt())
        names = set(fm.expert_tensors())
        assert names == {"w13_q", "w13_s", "w2_q", "w2_s", "tag", "csum"}
        assert fm.store.w13_q.dtype == fp8.FP8 and fm.store.w13_s.dtype == torch.float32
        S = fm.slots_per_rank
        slots = torch.arange(300) % S
        few = torch.tensor([0, S - 1, 1])
        outs[cache] = (fm.compute(x, slots), fm.compute(x[:3], few))   # grouped and gathered
        d = fm.store.describe()
        assert d["fp8_bytes"] == S * 3 * INTER * H                         # 1 byte per weight
        assert d["scale_bytes"] == S * 4 * (2 * 2 * 2 + 4 * 1)             # f32 grids [2,2,2],[4,1]
        assert ("cache_bytes" in d) == cache
    assert torch.equal(outs[False][0], outs[True][0])
    assert torch.equal(outs[False][1], outs[True][1])


def test_checksum_covers_every_scale_byte():
    fm = FusedMoE(_cfg(False), 0, 0, initial_phy2log(E, 2, 1), source=_fp8_source(),
                  quant=_fmt())
    assert fm.check_checksums() == []
    raw = fm.store.w13_s.view(torch.uint8)          # [S, 2, gI, gH, 4] bytes: flip one of them
    before = slot_checksum(fm.store.slot(2))
    raw.view(-1)[raw[0].numel() * 2 + 5] ^= 0x01
    assert slot_checksum(fm.store.slot(2)) != before
    assert fm.check_checksums() == [2]


def test_fp8_travels_as_uint8_bytes():
    t = torch.randn(4, 64).to(fp8.FP8)
    parts = chunk(t, 100)
    assert all(p.dtype == torch.uint8 for p in parts)
    assert torch.equal(torch.cat(parts).view(fp8.FP8).view(4, 64).view(torch.uint8),
                       t.view(torch.uint8))


# ---- bad inputs ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fp8_ckpt(tmp_path_factory):
    return make_checkpoint("qwen3_moe", tmp_path_factory.mktemp("fp8") / "q", quant="fp8",
                           block_size=16, num_experts=8, num_layers=2)


EXPERT = "model.layers.1.mlp.experts.3.down_proj.weight"


def _with_scale(p, fn):
    sd = load_file(p / "model.safetensors")
    fn(sd, EXPERT + "_scale_inv")
    save_file(sd, p / "model.safetensors", metadata={"format": "pt"})


def _set(value):
    def fn(sd, k):
        sd[k][0, 1] = value
    return fn


BAD = {
    "missing_scale": (lambda p: _with_scale(p, lambda sd, k: sd.pop(k)),
                      rf"tensor '{EXPERT}' is F8_E4M3 but its scale '{EXPERT}_scale_inv' is "
                      r"missing"),
    "transposed_grid": (lambda p: _with_scale(p, lambda sd, k: sd.__setitem__(
        k, sd[k].t().contiguous())), rf"scale '{EXPERT}_scale_inv' has shape \[2, 4\], expected "
                        r"\[4, 2\] = ceil\(\[64, 32\] / weight_block_size \[16, 16\]\)"),
    "short_grid": (lambda p: _with_scale(p, lambda sd, k: sd.__setitem__(k, sd[k][:1].clone())),
                   r"has shape \[1, 2\], expected \[4, 2\]"),
    "nan_scale": (lambda p: _with_scale(p, _set(float("nan"))), r"holds nan at \[0, 1\]; every "
                  r"scale must be finite and > 0"),
    "inf_scale": (lambda p: _with_scale(p, _set(float("inf"))), r"holds inf at \[0, 1\]"),
    "zero_scale": (lambda p: _with_scale(p, _set(0.0)), r"holds 0.0 at \[0, 1\]"),
    "negative_scale": (lambda p: _with_scale(p, _set(-1.0)), r"holds -1.0 at \[0, 1\]"),
    "int_scale": (lambda p: _with_scale(p, lambda sd, k: sd.__setitem__(k, sd[k].to(
        torch.int32))), rf"scale '{EXPERT}_scale_inv' has dtype I32, expected one of F32, BF16, "
                  r"F16"),
    "orphan_scale": (lambda p: _with_scale(p, lambda sd, k: sd.__setitem__(
        "model.norm.weight_scale_inv", torch.ones(1, 1))),
                     r"scale 'model.norm.weight_scale_inv' belongs to no F8_E4M3 weight"),
    "experts_partly_fp8": (lambda p: _with_scale(p, lambda sd, k: (
        sd.__setitem__(EXPERT, sd[EXPERT].to(torch.float32)), sd.pop(k))),
        r"some routed expert weights are F8_E4M3 and some are not"),
    "unknown_method": (lambda p: _edit_quant(p, quant_method="gptq"),
                       r"field 'quantization_config.quant_method'='gptq' is not supported"),
    "unknown_fmt": (lambda p: _edit_quant(p, fmt="e5m2"),
                    r"field 'quantization_config.fmt'='e5m2' is not supported"),
    "no_quant_config": (lambda p: _edit_quant(p, _drop=True),
                        r"is F8_E4M3 but .*config.json has no quantization_config"),
}


def _edit_quant(p, _drop=False, **kv):
    d = json.loads((p / "config.json").read_text())
    if _drop:
        del d["quantization_config"]
    else:
        d["quantization_config"].update(kv)
    (p / "config.json").write_text(json.dumps(d))


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_fp8_checkpoint_is_one_error_line_exit_2(case, fp8_ckpt, tmp_path):
    p = tmp_path / case
    shutil.copytree(fp8_ckpt, p)
    edit, msg = BAD[case]
    edit(p)
    with pytest.raises(InputFileError, match=msg):          # in process: nothing half-built
        Decoder.reference(Config(eplb=EplbConfig(ep_size=2), model=ModelConfig(model=str(p))))
    # serve's pre-start checks (`config validate` runs exactly them): one line, exit 2
    r = CliRunner().invoke(cli, ["config", "validate", "--model", str(p), "--ep-size", "2",
                                 "--port", "0"])
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.output
    assert re.search(msg, lines[0]), lines[0]


def test_fp8_checkpoint_passes_the_checks_and_reports_itself(fp8_ckpt):
    r = CliRunner().invoke(cli, ["config", "validate", "--model", str(fp8_ckpt), "--ep-size",
                                 "2", "--port", "0"])
    assert r.exit_code == 0, r.output
    info = fp8.quant_info(str(fp8_ckpt), False)
    assert info == {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [16, 16],
                    "activation_scheme": "dynamic", "expert_dequant": "per_step"}


def test_make_checkpoint_cli_writes_fp8(tmp_path):
    from xllm_eplb.model.loader import read_header

    out = tmp_path / "ds"
    r = CliRunner().invoke(cli, ["make-checkpoint", "--arch", "deepseek_v3", "--quant", "fp8",
                                 "--block-size", "32", "--num-experts", "8", "--num-layers",
                                 "2", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "quant=fp8 block_size=32 scale_dtype=float32" in r.output
    q = json.loads((out / "config.json").read_text())["quantization_config"]
    assert q["quant_method"] == "fp8" and q["weight_block_size"] == [32, 32]
    assert q["modules_to_not_convert"] == ["model.layers.0.self_attn.kv_a_proj_with_mqa",
                                           "model.layers.1.self_attn.kv_a_proj_with_mqa"]
    hdr = read_header(out / "model.safetensors")
    w = "model.layers.1.mlp.experts.7.down_proj.weight"
    assert hdr[w]["dtype"] == "F8_E4M3" and hdr[w + "_scale_inv"]["shape"] == [2, 1]
    assert hdr["model.layers.1.mlp.gate.weight"]["dtype"] == "F32"        # the router stays
    r = CliRunner().invoke(cli, ["make-checkpoint", "--quant", "fp8", "--block-size", "0",
                                 "--out", str(tmp_path / "x")])
    assert r.exit_code == 2


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_serve_refuses_a_bad_scale_before_starting_anything(fp8_ckpt, tmp_path):
    import subprocess
    import sys

    p = tmp_path / "bad"
    shutil.copytree(fp8_ckpt, p)
    _with_scale(p, _set(-2.0))
    logs = tmp_path / "logs"
    r = subprocess.run([sys.executable, "-m", "xllm_eplb", "serve", "--model", str(p),
                        "--ep-size", "2", "--port", "0", "--log_dir", str(logs)],
                       capture_output=True, text=True, timeout=50)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and re.match(rf"error: .*scale '{EXPERT}_scale_inv' holds -2.0 at "
                                        r"\[0, 1\]", lines[0]), r.stderr
    assert not logs.exists()                    # nothing started, nothing written
