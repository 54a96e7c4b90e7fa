"""Batched causal attention over a preallocated per-rank KV cache.

:class:`KVCache` holds ``k [layers, slots, kv_heads, cap, k_dim]`` and ``v [layers, slots,
kv_heads, cap, v_dim]`` (a layer's cache of a request is already in the ``[kv_heads, positions,
dim]`` layout attention reads); a request gets a slot at its first forward and frees it on
release. Both axes grow by doubling when a request or a position does not fit (rare,
amortised; no per-step concatenation).

:class:`AttnBatch` is one step's layout, built once and shared by every layer: the requests
padded to ``[R, n_max]`` query rows and ``P = max(start_pos + n)`` key positions, with a boolean
mask ``[R, 1, n_max, P]`` (causal and in-length; padded query rows see position 0 only, their
output is dropped). :func:`attend` writes this layer's new keys/values into the cache and runs
``scaled_dot_product_attention`` for all requests at once: when the step's requests hold
consecutive slots (the usual case) it reads the cache through a view, else one gather per
layer; grouped-query heads go in as they are (``enable_gqa``), never repeated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class KVCache:
    """Per-rank KV storage; ``slot_of``: req_id -> slot, ``lengths``: req_id -> positions held."""

    def __init__(self, layers: int, kv_heads: int, k_dim: int, v_dim: int, max_pos: int,
                 dtype: torch.dtype, device: torch.device, slots: int = 8, cap: int = 64):
        self.layers, self.kv_heads, self.k_dim, self.v_dim = layers, kv_heads, k_dim, v_dim
        self.max_pos, self.dtype, self.device = max_pos, dtype, device
        self.slot_of: dict[int, int] = {}
        self.lengths: dict[int, int] = {}
        self.k = self.v = None
        self._alloc(max(1, slots), min(max(1, cap), max_pos))

    def _alloc(self, slots: int, cap: int) -> None:
        def grow(old, dim):
            new = torch.zeros((self.layers, slots, self.kv_heads, cap, dim), dtype=self.dtype,
                              device=self.device)
            if old is not None:
                new[:, :old.shape[1], :, :old.shape[3]] = old
            return new
        self.k, self.v = grow(self.k, self.k_dim), grow(self.v, self.v_dim)
        self.free = sorted(set(range(slots)) - set(self.slot_of.values()))

    def length(self, req_id: int) -> int:
        return self.lengths.get(int(req_id), 0)

    def reserve(self, req_ids: list[int], ends: list[int]) -> list[int]:
        """Slots of ``req_ids`` (new ones assigned), with room for positions < ``ends``."""
        need_new = sum(1 for r in set(req_ids) if r not in self.slot_of)
        slots, cap = self.k.shape[1], self.k.shape[3]
        while len(self.free) < need_new:
            slots *= 2
            self._alloc(slots, cap)
            need_new -= 0
        top = max(ends, default=0)
        if top > cap:
            while cap < top:
                cap *= 2
            self._alloc(self.k.shape[1], min(cap, self.max_pos))
        out = []
        for r in req_ids:
            if r not in self.slot_of:
                self.slot_of[r] = self.free.pop(0)
                self.lengths[r] = 0
            out.append(self.slot_of[r])
        return out

    def advance(self, req_ids: list[int], ends: list[int]) -> None:
        for r, e in zip(req_ids, ends, strict=True):
            self.lengths[r] = e

    def truncate(self, req_id: int, length: int) -> None:
        """Keep only the first ``length`` cached positions of ``req_id`` (the later ones are
        never read: attention masks positions past the length, the next write overwrites
        them). A request without a slot is skipped; one holding fewer positions is an error."""
        r = int(req_id)
        have = self.lengths.get(r)
        if have is None:
            return
        if not 0 <= length <= have:
            raise ValueError(f"request {r}: truncate to {length} positions but the KV cache "
                             f"holds {have}")
        self.lengths[r] = int(length)

    def release(self, req_id: int) -> None:
        r = int(req_id)
        s = self.slot_of.pop(r, None)
        self.lengths.pop(r, None)
        if s is not None:
            self.free.append(s)
            self.free.sort()

    def __len__(self) -> int:
        return len(self.slot_of)


class AttnBatch:
    """Layout of one step's real tokens: ``spans`` [(start, n)] per request in row order,
    ``starts`` the cached positions before the step, ``slots`` the requests' cache slots
    (``first_slot``: the first of them when they are consecutive, else None)."""

    def __init__(self, spans: list[tuple[int, int]], starts: list[int], slots: list[int],
                 device: torch.device):
        R = len(spans)
        self.R = R
        self.n_max = max((n for _, n in spans), default=1)
        self.P = max((p + n for (_, n), p in zip(spans, starts, strict=True)), default=1)
        rows = [r for r, (_, n) in enumerate(spans) for _ in range(n)]
        cols = [j for _, n in spans for j in range(n)]
        pos = [p + j for (_, n), p in zip(spans, starts, strict=True) for j in range(n)]
        self.tok_row = torch.tensor(rows, dtype=torch.int64, device=device)
        self.tok_col = torch.tensor(cols, dtype=torch.int64, device=device)
        self.tok_pos = torch.tensor(pos, dtype=torch.int64, device=device)
        self.row_slot = torch.tensor(slots, dtype=torch.int64, device=device)
        lo = slots[0] if slots else 0
        self.first_slot = lo if list(slots) == list(range(lo, lo + R)) else None
        self.tok_slot = self.row_slot[self.tok_row]
        start = torch.tensor(starts, dtype=torch.int64, device=device)[:, None, None]
        n = torch.tensor([n for _, n in spans], dtype=torch.int64, device=device)[:, None, None]
        j = torch.arange(self.n_max, device=device)[None, :, None]
        kp = torch.arange(self.P, device=device)[None, None, :]
        real = j < n
        mask = (kp <= start + j) & real
        mask = mask | (~real & (kp == 0))
        self.mask = mask[:, None]                                  # [R, 1, n_max, P]
        self._qpos, self._kp, self._windowed = (start + j)[:, None], kp[:, None], {}
        self._pad = (~real & (kp == 0))[:, None]

    def mask_for(self, window: int = 0) -> torch.Tensor:
        """The step's mask [R, 1, n_max, P], with a sliding window of ``window`` positions
        (key position > query position - window, transformers' rule; 0 = none) when given.
        Padded query rows keep seeing position 0 only."""
        if not window:
            return self.mask
        m = self._windowed.get(window)
        if m is None:
            m = (self.mask & (self._kp > self._qpos - window)) | self._pad
            self._windowed[window] = m
        return m


#: dtypes whose attention runs in fp32 on the CPU (:func:`attend`)
LOW_PRECISION = (torch.bfloat16, torch.float16)


def attend(cache: KVCache, ab: AttnBatch, layer: int, q: torch.Tensor, k: torch.Tensor,
           v: torch.Tensor, scale: float, *, window: int = 0,
           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, h, dk], k [T, kvh, dk], v [T, kvh, dv] of the step's real tokens -> [T, h, dv].

    Writes k, v at (slot, position) of each token, then attends over every cached position
    (bf16 and fp16 on the CPU without sinks: in fp32, the result cast back; ``window``: only
    the last ``window`` of them, gpt_oss's sliding layers; the cache still keeps them all).
    ``sinks`` [h] (gpt_oss): a learned logit per head joins each softmax and is dropped after
    it (:func:`_sink_attention`)."""
    ck, cv = cache.k[layer], cache.v[layer]                       # [slots, kvh, cap, d] views
    ck[ab.tok_slot, :, ab.tok_pos] = k.to(cache.dtype)
    cv[ab.tok_slot, :, ab.tok_pos] = v.to(cache.dtype)
    if ab.first_slot is not None:                                 # views, no copy
        K = ck[ab.first_slot:ab.first_slot + ab.R, :, :ab.P]      # [R, kvh, P, dk]
        V = cv[ab.first_slot:ab.first_slot + ab.R, :, :ab.P]
    else:
        K, V = ck[ab.row_slot, :, :ab.P], cv[ab.row_slot, :, :ab.P]
    h, out = q.shape[1], q.dtype
    if out in LOW_PRECISION and q.device.type == "cpu" and sinks is None:
        # torch's CPU SDPA runs ~4x slower in bf16 than in fp32 at decode shapes (measured:
        # 32 requests, 12 heads, 40 positions: 1.38 ms vs 0.34 ms a call), and fp32 is the
        # more accurate: attend in fp32, return in the model dtype (the sink path is eager
        # matmuls at transformers' own cast points)
        q, K, V = q.float(), K.float(), V.float()
    mask = ab.mask_for(window)
    if ab.n_max == 1:                      # one token per request (decode): rows are requests
        Q = q.unsqueeze(2)                                        # [R, h, 1, dk]
    else:
        Q = q.new_zeros((ab.R, ab.n_max, h, q.shape[2]))
        Q[ab.tok_row, ab.tok_col] = q
        Q = Q.transpose(1, 2)                                     # [R, h, n_max, dk]
    if sinks is None:
        o = F.scaled_dot_product_attention(Q, K, V, attn_mask=mask, scale=scale,
                                           enable_gqa=K.shape[1] != h)
    else:
        o = _sink_attention(Q, K, V, mask, scale, sinks)
    if ab.n_max == 1:
        return o.squeeze(2).to(out)                               # [T, h, dv]
    return o.transpose(1, 2)[ab.tok_row, ab.tok_col].to(out)      # [T, h, dv]


def _sink_attention(Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, mask: torch.Tensor,
                    scale: float, sinks: torch.Tensor) -> torch.Tensor:
    """Attention with a sink logit per head (gpt_oss, as transformers' eager path): Q [R, h,
    n, dk], K [R, kvh, P, dk], V [R, kvh, P, dv], mask [R, 1, n, P] bool, sinks [h] -> [R, h,
    n, dv]. The sink's column takes part in the softmax (max-subtracted) and is then dropped,
    so the weights of the real keys sum to less than 1."""
    rep = Q.shape[1] // K.shape[1]
    if rep > 1:
        K, V = K.repeat_interleave(rep, dim=1), V.repeat_interleave(rep, dim=1)
    s = torch.matmul(Q, K.transpose(2, 3)) * scale
    s = s.masked_fill(~mask, torch.finfo(s.dtype).min)
    sink = sinks.to(s.dtype).reshape(1, -1, 1, 1).expand(s.shape[0], -1, s.shape[2], 1)
    s = torch.cat([s, sink], dim=-1)
    s = s - s.max(dim=-1, keepdim=True).values
    p = torch.softmax(s, dim=-1)[..., :-1].to(V.dtype)
    return torch.matmul(p, V)
