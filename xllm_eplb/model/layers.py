"""Dense building blocks: RMSNorm, positions, per-request KV cache + causal attention, sampling."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

EPS = 1e-6


def rms_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, H] -> [T, H]."""
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + EPS) * w


def positions_encoding(pos: torch.Tensor, hidden: int, dtype) -> torch.Tensor:
    """Small sinusoidal position signal, [T] -> [T, H] (scale 0.1 so topics dominate routing)."""
    half = hidden // 2
    freq = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float64) / max(1, half))
    ang = pos.to(torch.float64)[:, None] * freq[None, :]
    pe = torch.zeros((pos.shape[0], hidden), dtype=torch.float64)
    pe[:, :half] = torch.sin(ang)
    pe[:, half:2 * half] = torch.cos(ang)
    return (0.1 * pe).to(dtype)


def swiglu(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """x [T, H], w13 [2I, H], w2 [H, I] -> [T, H]."""
    g, u = (x @ w13.t()).chunk(2, dim=-1)
    return (F.silu(g) * u) @ w2.t()


class KVCache:
    """Per-request keys/values: req_id -> per decoder layer (k, v), each [heads, n, head_dim]."""

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self.store: dict[int, list] = {}

    def length(self, req_id: int) -> int:
        e = self.store.get(req_id)
        return 0 if e is None or e[0] is None else e[0][0].shape[1]

    def append(self, req_id: int, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Append k, v [heads, n, hd] to layer ``layer``; returns the full (k, v)."""
        e = self.store.setdefault(req_id, [None] * self.num_layers)
        if e[layer] is not None:
            k = torch.cat([e[layer][0], k], dim=1)
            v = torch.cat([e[layer][1], v], dim=1)
        e[layer] = (k, v)
        return k, v

    def release(self, req_id: int) -> None:
        self.store.pop(req_id, None)

    def __len__(self) -> int:
        return len(self.store)


def attention(xn: torch.Tensor, wqkv: torch.Tensor, wo: torch.Tensor, heads: int,
              cache: KVCache, layer: int, req_id: int, start_pos: int) -> torch.Tensor:
    """Causal self-attention of one request's new tokens xn [n, H] over its cache -> [n, H]."""
    n, H = xn.shape
    hd = H // heads
    q, k, v = (xn @ wqkv.t()).split(H, dim=-1)
    q = q.reshape(n, heads, hd).transpose(0, 1)
    k = k.reshape(n, heads, hd).transpose(0, 1)
    v = v.reshape(n, heads, hd).transpose(0, 1)
    K, V = cache.append(req_id, layer, k, v)
    total = K.shape[1]
    s = (q @ K.transpose(1, 2)) / math.sqrt(hd)                     # [heads, n, total]
    qpos = torch.arange(start_pos, start_pos + n, device=xn.device)[:, None]
    kpos = torch.arange(total, device=xn.device)[None, :]
    s = s.masked_fill(kpos > qpos, float("-inf"))
    o = torch.softmax(s, dim=-1) @ V                                 # [heads, n, hd]
    return o.transpose(0, 1).reshape(n, H) @ wo.t()


def sample(logits: torch.Tensor, temperature: float, seed: int, position: int,
           top_p: float = 1.0, top_k: int = 0) -> int:
    """Greedy when temperature == 0; else a draw seeded by (seed, position) only, so a request
    gets the same token whatever batch it shares. logits [V]. ``top_k`` > 0 keeps the k most
    likely tokens; ``top_p`` < 1 keeps the smallest most-likely set whose probability reaches
    ``top_p`` (nucleus; always at least one token)."""
    lg = logits.to(torch.float64)
    if temperature <= 0:
        return int(torch.argmax(lg))
    g = torch.Generator()
    g.manual_seed((int(seed) * 1_000_033 + int(position) * 7_919 + 1) % (1 << 62))
    p = torch.softmax(lg / temperature, dim=-1)
    if top_k > 0 or top_p < 1.0:
        p = _truncate(p, top_p, top_k)
    return int(torch.multinomial(p, 1, generator=g))


def _truncate(p: torch.Tensor, top_p: float, top_k: int) -> torch.Tensor:
    """Probabilities p [V] with everything outside top-k / the top-p nucleus set to 0."""
    sp, idx = torch.sort(p, descending=True)
    keep = torch.ones_like(sp, dtype=torch.bool)
    if top_k > 0:
        keep[top_k:] = False
    if top_p < 1.0:
        before = torch.cumsum(sp, dim=0) - sp          # mass of the more likely tokens
        keep &= before < top_p
    keep[0] = True
    out = torch.zeros_like(p)
    out[idx[keep]] = sp[keep]
    return out
