"""Decoder blocks of the Hugging Face MoE families: RMSNorm, SwiGLU MLP, GQA and MLA attention.

Weights are plain tensors in a dict (``p``) keyed by the short names :mod:`loader` produces
(``q``, ``k``, ``v``, ``o`` with optional ``*_bias``, ``q_norm``/``k_norm``; MLA: ``q_a``,
``q_a_norm``, ``q_b`` or ``q``, ``kv_a``, ``kv_a_norm``, ``kv_b``, ``o``). Activations are
``[T, H]`` rows of the step's real tokens; attention runs through :func:`attention.attend`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from xllm_eplb.model import rope
from xllm_eplb.model.attention import AttnBatch, KVCache, attend
from xllm_eplb.model.dense import linear
from xllm_eplb.model.spec import ModelSpec

MLA_NORM_EPS = 1e-6        # DeepSeek's q_a/kv_a layernorms: module default, not rms_norm_eps


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, weight_first: bool = False
             ) -> torch.Tensor:
    """HF RMSNorm: normalise in fp32 (fp64 stays fp64), cast back, then scale. [.., D].
    ``weight_first`` (gpt_oss): scale in fp32, then cast back (the same in fp32 / fp64)."""
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    h = x.to(work)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if weight_first:
        return (w.to(work) * h).to(x.dtype)
    return w * h.to(x.dtype)


def mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """SwiGLU: x [T, H], w13 [2I, H] (gate rows, then up rows), w2 [H, I] -> [T, H]."""
    g, u = linear(x, w13).chunk(2, dim=-1)
    return linear(F.silu(g) * u, w2)


def _lin(x, p, name):
    return linear(x, p[name], p.get(name + "_bias"))


class Rotary:
    """cos/sin of one step for a head dim, with the family's scaling."""

    def __init__(self, spec: ModelSpec, dim: int):
        self.inv, self.factor = rope.inv_freq(dim, spec.rope_theta, spec.rope_scaling,
                                              spec.max_position_embeddings)

    def tables(self, pos: torch.Tensor, dtype: torch.dtype):
        return rope.cos_sin(pos, self.inv, self.factor, dtype)


def _qkv(spec: ModelSpec, p: dict, x: torch.Tensor):
    """q [T, h, hd], k and v [T, kvh, hd] before RoPE: the projections, the q/k RMSNorms
    (per head, or over the whole projection for olmoe), then olmoe's ``clip_qkv`` clamp."""
    T, hd, eps = x.shape[0], spec.head_dim, spec.rms_norm_eps
    q, k, v = _lin(x, p, "q"), _lin(x, p, "k"), _lin(x, p, "v")
    if spec.qk_norm and not spec.qk_norm_per_head:
        q, k = rms_norm(q, p["q_norm"], eps), rms_norm(k, p["k_norm"], eps)
    if spec.clip_qkv is not None:
        c = spec.clip_qkv
        q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
    q = q.view(T, spec.num_heads, hd)
    k, v = k.view(T, spec.num_kv_heads, hd), v.view(T, spec.num_kv_heads, hd)
    if spec.qk_norm and spec.qk_norm_per_head:
        q, k = rms_norm(q, p["q_norm"], eps), rms_norm(k, p["k_norm"], eps)
    return q, k, v


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the first ``cos.shape[-1]`` dims of x [T, heads, hd] (all of them unless the
    family rotates part of each head, glm4_moe), the rest passed through."""
    rd = cos.shape[-1]
    if rd == x.shape[-1]:
        return rope.apply(x, cos, sin)
    return torch.cat([rope.apply(x[..., :rd], cos, sin), x[..., rd:]], dim=-1)


def gqa(spec: ModelSpec, p: dict, x: torch.Tensor, cs, cache: KVCache, ab: AttnBatch,
        layer: int) -> torch.Tensor:
    """Grouped-query attention (mixtral, qwen2_moe, qwen3_moe, glm4_moe, olmoe, gpt_oss with
    its sinks and sliding-window layers): x [T, H] -> [T, H]."""
    T, hd = x.shape[0], spec.head_dim
    q, k, v = _qkv(spec, p, x)
    cos, sin = cs
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    window = spec.sliding_window if layer in spec.sliding_layers else 0
    o = attend(cache, ab, layer, q, k, v, hd ** -0.5, window=window, sinks=p.get("sinks"))
    return _lin(o.reshape(T, -1), p, "o")


def mla_scale(spec: ModelSpec) -> float:
    """Softmax scale of MLA: (nope + rope)^-0.5, times mscale^2 under YaRN with mscale_all_dim."""
    m = spec.mla
    s = (m.qk_nope_head_dim + m.qk_rope_head_dim) ** -0.5
    sc = spec.rope_scaling
    if sc and sc.get("mscale_all_dim"):
        ms = rope.yarn_mscale(float(sc["factor"]), float(sc["mscale_all_dim"]))
        s = s * ms * ms
    return s


def mla(spec: ModelSpec, p: dict, x: torch.Tensor, cs, cache: KVCache, ab: AttnBatch,
        layer: int) -> torch.Tensor:
    """DeepSeek multi-head latent attention: x [T, H] -> [T, H]. The cache keeps the expanded
    per-head keys [h, nope + rope] and values [h, v]."""
    m, T, h = spec.mla, x.shape[0], spec.num_heads
    if m.q_lora_rank is None:
        q = _lin(x, p, "q")
    else:
        q = linear(rms_norm(_lin(x, p, "q_a"), p["q_a_norm"], MLA_NORM_EPS), p["q_b"])
    q = q.view(T, h, m.qk_nope_head_dim + m.qk_rope_head_dim)
    q_pass, q_rot = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
    c, k_rot = _lin(x, p, "kv_a").split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
    kv = linear(rms_norm(c, p["kv_a_norm"], MLA_NORM_EPS), p["kv_b"])
    k_pass, v = kv.view(T, h, m.qk_nope_head_dim + m.v_head_dim).split(
        [m.qk_nope_head_dim, m.v_head_dim], dim=-1)
    k_rot = k_rot.view(T, 1, m.qk_rope_head_dim)
    if m.rope_interleave:
        q_rot, k_rot = rope.deinterleave(q_rot), rope.deinterleave(k_rot)
    cos, sin = cs
    q_rot, k_rot = rope.apply(q_rot, cos, sin), rope.apply(k_rot, cos, sin)
    q = torch.cat([q_pass, q_rot], dim=-1)
    k = torch.cat([k_pass, k_rot.expand(T, h, m.qk_rope_head_dim)], dim=-1)
    o = attend(cache, ab, layer, q, k, v.contiguous(), mla_scale(spec))
    return _lin(o.reshape(T, -1), p, "o")


def attention_fn(spec: ModelSpec):
    return mla if spec.mla is not None else gqa


def kv_dims(spec: ModelSpec) -> tuple[int, int, int]:
    """(cached kv heads, key dim, value dim) per layer."""
    if spec.mla is not None:
        m = spec.mla
        return spec.num_heads, m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim
    return spec.num_kv_heads, spec.head_dim, spec.head_dim


def rope_dim(spec: ModelSpec) -> int:
    """Rotated dims per head: MLA's rope part, a partial-RoPE family's ``rotary_dim``, else
    the whole head."""
    if spec.mla is not None:
        return spec.mla.qk_rope_head_dim
    return spec.rotary_dim or spec.head_dim
