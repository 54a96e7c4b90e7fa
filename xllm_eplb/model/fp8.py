"""FP8 block-scaled weights (DeepSeek-V3/R1, Qwen3 FP8): the format, the exact dequantization
rule, the quantizer of the generated checkpoints, and the checks of a checkpoint's scales.

Format (``config.json`` ``quantization_config``: ``quant_method: "fp8"``, ``fmt: "e4m3"``,
``weight_block_size: [bn, bk]``): a quantized Linear ``X`` is stored as ``X.weight``
(``float8_e4m3fn`` [R, C]) plus ``X.weight_scale_inv`` (F32, BF16 or F16, one scale per
``bn x bk`` block: grid [ceil(R/bn), ceil(C/bk)]; an edge block is a partial block). Despite its
name the scale is *multiplied*. Every other tensor (embeddings, norms, routers, ``lm_head``, a
Linear the quantizer left out) keeps its own dtype; which Linears are FP8 is read from the file
(dtype F8_E4M3), so ``modules_to_not_convert`` needs no interpretation here.

Rule (transformers' ``Fp8Dequantize`` on CPU, bit for bit): ``W = (q.to(f32) * s.to(f32)
[block of each element]).to(dtype)``: one fp32 product, one rounding to the model dtype. A bf16
multiply is *not* the same (7-36 % of the elements differ with fp32 scales).

Every check raises :class:`InputFileError` naming the file, the tensor, the value and the rule;
nothing is warned about and kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from xllm_eplb.errors import InputFileError

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0                     # largest finite e4m3fn value
ST_FP8 = "F8_E4M3"                  # the safetensors dtype name
SCALE_SUFFIX = "_scale_inv"         # X.weight -> X.weight_scale_inv
SCALE_DTYPES = ("F32", "BF16", "F16")
SCALE_TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
METHODS = ("fp8",)
FMTS = ("e4m3",)
ACTIVATION_SCHEMES = ("dynamic",)


@dataclass(frozen=True)
class Fp8Format:
    """A checkpoint's FP8 block quantization (``quantization_config``); ``block`` = (bn, bk)
    rows x columns per scale."""

    block: tuple[int, int]
    fmt: str = "e4m3"
    activation_scheme: str = "dynamic"

    def describe(self) -> dict:
        """What ``/v1/models`` and ``/eplb/status`` report."""
        return {"quant_method": "fp8", "fmt": self.fmt,
                "weight_block_size": list(self.block),
                "activation_scheme": self.activation_scheme}


def parse_quant(d: dict, path: Path | str) -> Fp8Format | None:
    """``config.json`` (``path``, already read into ``d``) -> its FP8 format, or None without a
    ``quantization_config``. Unknown methods, formats, activation schemes and bad block sizes
    raise InputFileError naming the field."""
    q = d.get("quantization_config")
    if q is None:
        return None

    def err(field: str, value, rule: str) -> InputFileError:
        return InputFileError(f"{path}: field 'quantization_config.{field}'={value!r} {rule}")

    if not isinstance(q, dict):
        raise err("", q, "must be a JSON object")
    method = q.get("quant_method")
    if method not in METHODS:
        raise err("quant_method", method, f"is not supported (supported: {', '.join(METHODS)}: "
                  "block-scaled float8_e4m3fn weights)")
    fmt = q.get("fmt", "e4m3")
    if fmt not in FMTS:
        raise err("fmt", fmt, f"is not supported (supported: {', '.join(FMTS)})")
    act = q.get("activation_scheme", "dynamic")
    if act not in ACTIVATION_SCHEMES:
        raise err("activation_scheme", act, "is not supported (dynamic only: weight-only "
                  "dequantization, as transformers runs FP8 on CPU)")
    if q.get("scale_fmt") not in (None, "float"):
        raise err("scale_fmt", q.get("scale_fmt"), "is not supported (float scales only)")
    b = q.get("weight_block_size")
    if not (isinstance(b, list) and len(b) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in b)):
        raise err("weight_block_size", b, "must be two integers >= 1 ([rows, columns])")
    return Fp8Format(block=(b[0], b[1]), fmt=fmt, activation_scheme=act)


def quantization_config(block: tuple[int, int], not_converted: list[str]) -> dict:
    """The ``quantization_config`` a generated FP8 checkpoint carries (DeepSeek's keys)."""
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": list(block), "modules_to_not_convert": sorted(not_converted)}


def grid(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """Scale grid of a weight [R, C]: (ceil(R/bn), ceil(C/bk))."""
    R, C = shape[-2:]
    return -(-R // block[0]), -(-C // block[1])


# ---- the rule ---------------------------------------------------------------------------------

def decode(q: torch.Tensor, out: torch.Tensor | None = None,
           work: torch.Tensor | None = None, *, unscaled: bool = False) -> torch.Tensor:
    """``q`` float8_e4m3fn -> float32 (into ``out`` when given), equal to ``q.to(float32)``
    for every finite code (the two NaN codes, which :func:`quantize` never writes, decode to
    +-480). ``work``: an int16 buffer of at least ``q.numel()`` elements (else one is made).

    How: the fp8 byte sign-extended to int16 and shifted left by 7 (a wrapping multiply by
    128: the same bits, a faster vectorised pass) is the float16 with the same sign, mantissa
    and (exponent - 8), once the stray exponent bit 14 is cleared; float16 -> float32 and * 256
    are exact (``unscaled``: leave out the * 256, for a caller that folds it into its own
    product: x / 256 * (s * 256) rounds exactly as x * s). All vectorised in-place passes:
    torch's own fp8 conversion is a scalar loop, several times slower on CPU."""
    i16 = (torch.empty(q.shape, dtype=torch.int16, device=q.device) if work is None
           else work.reshape(-1)[:q.numel()].view(q.shape))
    i16.copy_(q.view(torch.int8))
    _half_bits_(i16)
    if out is None:
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    out.copy_(i16.view(torch.float16))
    return out if unscaled else out.mul_(256.0)


def _half_bits_(i16: torch.Tensor) -> torch.Tensor:
    """Sign-extended fp8 bytes -> the float16 bits of value / 256, in place (see decode)."""
    return i16.mul_(128).bitwise_and_(-16385)


def scale_factors(s: torch.Tensor) -> torch.Tensor:
    """Scales as :func:`scale_` takes them: float32 times the 2^8 an unscaled decode leaves
    out (exact)."""
    return s.to(torch.float32) * 256.0


def scale_(w: torch.Tensor, sf: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Multiply the unscaled decode ``w`` float32 [..., R, C] in place by its blocks' factors
    ``sf`` [..., ceil(R/bn), ceil(C/bk)] (:func:`scale_factors`): the rule's one fp32
    product."""
    R, C = w.shape[-2:]
    gr, gc = sf.shape[-2:]
    bn, bk = block
    if R == gr * bn and C == gc * bk:
        lead = w.shape[:-2]
        w.view(*lead, gr, bn, gc, bk).mul_(sf.reshape(*lead, gr, 1, gc, 1))
    else:                           # partial edge blocks: expand the grid and cut it to [R, C]
        w.mul_(sf.repeat_interleave(bn, dim=-2)[..., :R, :].repeat_interleave(bk, dim=-1)[..., :C])
    return w


def dequantize(q: torch.Tensor, s: torch.Tensor, block: tuple[int, int], dtype: torch.dtype,
               out: torch.Tensor | None = None, work: tuple[torch.Tensor, torch.Tensor] |
               None = None) -> torch.Tensor:
    """``q`` fp8 [..., R, C] with scales ``s`` [..., ceil(R/bn), ceil(C/bk)] -> ``dtype``
    [..., R, C]: fp32 product of the decoded fp8 (:func:`decode`) and its block's fp32 scale,
    one cast (into ``out`` when given). ``work``: (int16, float32) buffers of at least
    ``q.numel()`` elements for the temporaries (else they are allocated); a float32 ``out`` is
    its own temporary."""
    i16, f32 = work if work is not None else (None, None)
    if out is not None and out.dtype == torch.float32 and out.is_contiguous():
        w = out
    elif f32 is not None:
        w = f32.reshape(-1)[:q.numel()].view(q.shape)
    else:
        w = None
    w = scale_(decode(q, w, i16, unscaled=True), scale_factors(s), block)
    if out is None:
        return w.to(dtype, copy=work is not None)      # never hand out the work buffer
    return w if w is out else out.copy_(w)


def dequantize_parts(parts: list[tuple[torch.Tensor, torch.Tensor]], block: tuple[int, int],
                     out: torch.Tensor, i16: torch.Tensor) -> list[torch.Tensor]:
    """Several fp8 tensors at once, each by :func:`dequantize`'s rule into float32:
    ``parts`` [(q [..., R, C], sf [..., ceil(R/bn), ceil(C/bk)] from :func:`scale_factors`)]
    -> views of consecutive ranges of ``out`` (1-D float32) shaped as each ``q``; ``i16``
    (1-D int16) holds the bits. Each decode pass runs once over all the parts, not once per
    part (the per-step expert path calls this per chunk of experts: few ops, cache-sized)."""
    off, views = 0, []
    for q, _ in parts:
        n = q.numel()
        i16[off:off + n].view(q.shape).copy_(q.view(torch.int8))
        views.append(out[off:off + n].view(q.shape))
        off += n
    out[:off].copy_(_half_bits_(i16[:off]).view(torch.float16))
    for w, (_, sf) in zip(views, parts, strict=True):
        scale_(w, sf, block)
    return views


def quantize(w: torch.Tensor, block: tuple[int, int],
             scale_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-quantize ``w`` [R, C] (DeepSeek's recipe: a block's scale is its amax / 448, an
    all-zero block gets scale 1; values clamped to +-448) -> (fp8 [R, C], scales
    [ceil(R/bn), ceil(C/bk)] in ``scale_dtype``). The fp8 values are computed against the scale
    as stored, so dequantize(quantize(w)) is the nearest fp8 grid point of every element."""
    R, C = w.shape
    bn, bk = block
    gr, gc = grid(w.shape, block)
    pad = torch.zeros(gr * bn, gc * bk, dtype=torch.float32)
    pad[:R, :C] = w.to(torch.float32)
    blocks = pad.reshape(gr, bn, gc, bk)
    amax = blocks.abs().amax(dim=(1, 3))
    s = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)).to(scale_dtype)
    q = (blocks / s.to(torch.float32).reshape(gr, 1, gc, 1)).clamp(-FP8_MAX, FP8_MAX)
    return q.reshape(gr * bn, gc * bk)[:R, :C].to(FP8).contiguous(), s.contiguous()


# ---- checks -----------------------------------------------------------------------------------

def scale_name(weight: str) -> str:
    """``X.weight`` -> ``X.weight_scale_inv``."""
    return weight + SCALE_SUFFIX


def check_pairing(meta: dict, fmt: Fp8Format | None, folder: Path) -> list[str]:
    """Headers only: every fp8 tensor has a scale of an accepted dtype and of exactly its ceil
    grid, every scale belongs to an fp8 weight, and fp8 tensors exist only with a
    ``quantization_config``. ``meta``: name -> (path, safetensors dtype, shape). Returns the
    fp8 weight names."""
    fp8 = sorted(n for n, (_, dt, _) in meta.items() if dt == ST_FP8)
    if fmt is None:
        if fp8:
            path = meta[fp8[0]][0]
            raise InputFileError(f"{path}: tensor {fp8[0]!r} is {ST_FP8} but "
                                 f"{folder / 'config.json'} has no quantization_config (an FP8 "
                                 f"checkpoint needs quant_method 'fp8' and weight_block_size)")
        return []
    for n in fp8:
        path, _, shape = meta[n]
        sn = scale_name(n)
        if len(shape) != 2:
            raise InputFileError(f"{path}: tensor {n!r} is {ST_FP8} of shape {list(shape)}; an "
                                 f"FP8 weight must be 2-D [out, in]")
        if sn not in meta:
            raise InputFileError(f"{path}: tensor {n!r} is {ST_FP8} but its scale {sn!r} is "
                                 f"missing (every FP8 weight needs one)")
        spath, sdt, sshape = meta[sn]
        if sdt not in SCALE_DTYPES:
            raise InputFileError(f"{spath}: scale {sn!r} has dtype {sdt}, expected one of "
                                 f"{', '.join(SCALE_DTYPES)}")
        want = grid(shape, fmt.block)
        if tuple(sshape) != want:
            raise InputFileError(f"{spath}: scale {sn!r} has shape {list(sshape)}, expected "
                                 f"{list(want)} = ceil({list(shape)} / weight_block_size "
                                 f"{list(fmt.block)})")
    for n, (path, _dt, _) in meta.items():
        if n.endswith(SCALE_SUFFIX):
            w = n[: -len(SCALE_SUFFIX)]
            if meta.get(w, (None, None))[1] != ST_FP8:
                raise InputFileError(f"{path}: scale {n!r} belongs to no {ST_FP8} weight {w!r}")
    return fp8


def check_values(name: str, path, s: torch.Tensor) -> None:
    """A scale grid must be finite and > 0 (a NaN, infinite, zero or negative scale would
    serve garbage without a sign)."""
    sf = s.to(torch.float32)
    bad = ~(torch.isfinite(sf) & (sf > 0))
    if bool(bad.any()):
        i = [int(v) for v in torch.nonzero(bad)[0]]
        raise InputFileError(f"{path}: scale {name!r} holds {float(sf[tuple(i)])!r} at {i}; "
                             f"every scale must be finite and > 0")


# ---- generated checkpoints --------------------------------------------------------------------

#: the decoder Linears a generated FP8 checkpoint quantizes (DeepSeek/Qwen: every projection of
#: attention, dense MLPs, shared and routed experts; never embeddings, norms, routers, lm_head)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj",
           "kv_a_proj_with_mqa", "kv_b_proj", "gate_proj", "up_proj", "down_proj",
           "w1", "w2", "w3")


def _aligned(shape: tuple[int, ...], block: tuple[int, int]) -> bool:
    """Every dim a multiple of its block, or inside one block: the shapes transformers
    dequantizes (it derives the block from the grid and cannot split a partial block)."""
    return all(d % b == 0 or d < b for d, b in zip(shape, block, strict=True))


def quantize_state_dict(sd: dict[str, torch.Tensor], block: tuple[int, int],
                        scale_dtype: torch.dtype = torch.float32
                        ) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Quantize the decoder Linears of a hub-layout state dict -> (state dict with
    ``X.weight`` fp8 + ``X.weight_scale_inv``, the modules left unquantized because their
    shape is not block-aligned: ``modules_to_not_convert``)."""
    out: dict[str, torch.Tensor] = {}
    skipped: list[str] = []
    for k, v in sd.items():
        parts = k.split(".")
        linear = (k.startswith("model.layers.") and parts[-1] == "weight" and v.dim() == 2
                  and parts[-2] in LINEARS)
        if linear and _aligned(tuple(v.shape), block):
            out[k], out[scale_name(k)] = quantize(v, block, scale_dtype)
        else:
            if linear:
                skipped.append(k[: -len(".weight")])
            out[k] = v
    return out, skipped


def quant_info(model_dir: str, dequant_cache: bool) -> dict | None:
    """What ``/v1/models`` and ``/eplb/status`` report for checkpoint ``model_dir``: its FP8
    format and the expert dequantization mode (gpt_oss's MXFP4 experts: ``quant_method``
    mxfp4, dequantized per step), or None (not quantized / no ``--model``)."""
    if not model_dir:
        return None
    import json

    path = Path(model_dir) / "config.json"
    try:
        d = json.loads(path.read_text())
        q = d.get("quantization_config")
        if d.get("model_type") == "gpt_oss" and isinstance(q, dict) \
                and q.get("quant_method") == "mxfp4":
            return {"quant_method": "mxfp4", "expert_dequant": "per_step"}
        fmt = parse_quant(d, path)
    except (OSError, ValueError, AttributeError, InputFileError):
        return None
    if fmt is None:
        return None
    return {**fmt.describe(), "expert_dequant": "cache" if dequant_cache else "per_step"}
