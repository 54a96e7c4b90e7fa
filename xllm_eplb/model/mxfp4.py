"""MXFP4 experts (the OCP MX format gpt-oss ships): e2m1 values, two per byte, one e8m0 scale
per 32 values.

On disk (gpt-oss's hub files, ``quantization_config.quant_method: mxfp4``): per MoE layer
``experts.gate_up_proj_blocks`` uint8 [E, 2I, H/32, 16] and ``gate_up_proj_scales`` uint8
[E, 2I, H/32] (row r = output column r of ``gate_up_proj``, gate and up interleaved),
``down_proj_blocks`` [E, H, I/32, 16] and ``down_proj_scales`` [E, H, I/32]; the biases stay
bf16. Value ``2j`` of a 32-block is the low nibble of byte ``j``, ``2j + 1`` the high one;
each is ``FP4[nibble] * 2^(scale - 127)`` (transformers' ``convert_moe_packed_tensors``, the
rule the tests compare against). A row is ``[G, 16]`` bytes -> ``G * 32`` values.

- :func:`dequantize` (blocks [..., G, 16], scales [..., G]) -> [..., G * 32];
- :func:`quantize` ([..., K], K % 32 == 0) -> (blocks, scales): per 32 values the scale
  ``2^e`` with ``e = ceil(log2(amax / 6))`` (6 = e2m1's largest), values rounded to the
  nearest e2m1 value (ties to the lower magnitude): ``make-checkpoint --quant mxfp4``.
"""

from __future__ import annotations

import torch

FP4 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32
METHOD = "mxfp4"
ST_U8 = "U8"
EXPERT_TENSORS = ("gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks",
                  "down_proj_scales")


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """blocks uint8 [..., G, 16], scales uint8 [..., G] -> values [..., G * 32] in ``dtype``
    (into ``out`` of that shape when given)."""
    lut = torch.tensor(FP4, dtype=torch.float32, device=blocks.device)
    *pre, G, B = blocks.shape
    v = torch.empty((*pre, G, 2 * B), dtype=torch.float32, device=blocks.device)
    v[..., 0::2] = lut[(blocks & 0x0F).long()]
    v[..., 1::2] = lut[(blocks >> 4).long()]
    v = torch.ldexp(v, (scales.to(torch.int32) - 127).unsqueeze(-1).to(torch.float32))
    v = v.reshape(*pre, G * 2 * B)
    if out is None:
        return v.to(dtype)
    return out.copy_(v)


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., K] (K % 32 == 0) -> (blocks uint8 [..., K/32, 16], scales uint8 [..., K/32])."""
    *pre, K = w.shape
    x = w.to(torch.float64).reshape(*pre, K // BLOCK, BLOCK)
    amax = x.abs().amax(dim=-1)
    e = torch.ceil(torch.log2(torch.clamp(amax, min=2.0 ** -126) / 6.0)).clamp(-127, 127)
    y = x / torch.pow(2.0, e).unsqueeze(-1)
    mags = torch.tensor(FP4[:8], dtype=torch.float64)
    idx = (y.abs().unsqueeze(-1) - mags).abs().argmin(dim=-1)        # nearest magnitude
    nib = (idx + 8 * (y < 0)).to(torch.uint8)
    blocks = nib[..., 0::2] | (nib[..., 1::2] << 4)
    return blocks.contiguous(), (e + 127).to(torch.uint8)
