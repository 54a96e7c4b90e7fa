"""Rotary position embeddings as Hugging Face checkpoints expect them.

- ``inv_freq(dim, theta, scaling, max_pos)``: default ``1 / theta^(2i/dim)`` or YaRN (NTK-by-parts
  blend of interpolated and extrapolated frequencies, plus an attention factor on cos/sin);
- ``cos_sin(pos, inv_freq, factor)``: fp32 tables ``[T, dim]`` (the half-frequencies repeated);
- ``apply(x, cos, sin)``: NeoX ``rotate_half`` convention on ``x [T, heads, dim]``;
- ``deinterleave(x)``: DeepSeek's interleaved pairs (x0, x1), (x2, x3) ... -> (evens, odds),
  done before ``apply`` when ``rope_interleave`` is set;
- ``yarn_mscale(scale, mscale)``: ``0.1 * mscale * ln(scale) + 1`` (1 when scale <= 1).
"""

from __future__ import annotations

import math

import torch


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _yarn(dim: int, theta: float, s: dict, max_pos: int) -> tuple[torch.Tensor, float]:
    factor = float(s["factor"])
    attn = s.get("attention_factor")
    mscale, mscale_all = s.get("mscale"), s.get("mscale_all_dim")
    if attn is None:
        attn = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
                if mscale and mscale_all else yarn_mscale(factor))
    fast, slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1
    orig = s.get("original_max_position_embeddings") or max_pos

    def corr_dim(rot: float) -> float:
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(theta))

    low, high = corr_dim(fast), corr_dim(slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    extra_w = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extra_w) + (1.0 / pos_freqs) * extra_w
    return inv, float(attn)


def inv_freq(dim: int, theta: float, scaling: dict | None, max_pos: int
             ) -> tuple[torch.Tensor, float]:
    """-> (inverse frequencies fp32 [dim/2], cos/sin attention factor)."""
    if scaling and scaling.get("rope_type") == "yarn":
        return _yarn(dim, theta, scaling, max_pos)
    exps = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (theta ** exps), 1.0


def cos_sin(pos: torch.Tensor, inv: torch.Tensor, factor: float, dtype: torch.dtype
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """pos int64 [T] -> (cos, sin) [T, dim] in ``dtype`` (computed in fp32, as HF does)."""
    f = pos.to(torch.float32)[:, None] * inv.to(pos.device)[None, :]
    emb = torch.cat([f, f], dim=-1)
    return (emb.cos() * factor).to(dtype), (emb.sin() * factor).to(dtype)


def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, dim], cos/sin [T, dim] -> rotated x (NeoX rotate_half)."""
    c, s = cos[:, None, :], sin[:, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    return x * c + torch.cat([-x2, x1], dim=-1) * s


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[..., dim] pairs (x0, x1), (x2, x3) ... -> (x0, x2, ..., x1, x3, ...)."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
