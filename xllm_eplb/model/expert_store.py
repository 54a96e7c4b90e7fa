"""The weight tensors of a MoE layer's expert slots, one class per storage format.

A store holds ``n`` slots of one layer and answers four questions; :class:`FusedMoE`, the
migration, the staging buffers and the canary only ever see "the tensors of a slot":

- ``tensors()``: name -> tensor [n, ...], every per-slot weight tensor (what moves, what the
  checksum covers, what the staging buffers mirror);
- ``slot(s)``: name -> the views of slot ``s`` (what a checkpoint source reads into);
- ``weights(slots)`` -> ``(w13 [m, 2I, H], w2 [m, H, I], idx)``: dense compute weights for
  the slot ids ``slots`` [N] int64, ``idx`` [N] indexing into them;
- ``refresh(slots)``: recompute derived state of those slots after their tensors were written
  (a migration, a load).

:class:`DenseSlots`: ``w13`` [n, 2I, H] and ``w2`` [n, H, I] in the model dtype (with
``bias``, gpt_oss: also ``b13`` [n, 2I] and ``b2`` [n, H], :mod:`expert_act`).
:class:`Fp8Slots`: ``w13_q`` float8_e4m3fn [n, 2I, H] (gate rows, up rows), ``w13_s`` float32
[n, 2, ceil(I/bn), ceil(H/bk)] (gate and up keep separate grids: a concatenated grid is shared
only when I % bn == 0), ``w2_q`` [n, H, I], ``w2_s`` [n, ceil(H/bn), ceil(I/bk)]. Compute
dequantizes by transformers' rule (:mod:`fp8`): per step the active slots only, a chunk of a
few experts at a time right before their GEMMs (:meth:`Fp8Slots.dense_range`, used by
``moe.grouped_ffn``; memory: the fp8 footprint plus a :class:`DequantScratch` of one chunk,
``CHUNK_BYTES``, shared by the layers of a rank), or, with ``cache``, a resident dequantized
copy of every slot, refreshed by ``refresh`` (more memory, no per-step work). Both give
identical weights and outputs. ``weights`` / ``dense`` of a per-step store dequantize a whole
stack of slots at once (the single-process reference, tests).
"""

from __future__ import annotations

import torch

from xllm_eplb.model import fp8, mxfp4

#: the per-step FP8 path's chunk budget (bytes of a chunk's dequantization buffers): on a
#: 2-core EPYC (L2 1 MiB per core, L3 32 MiB) two 768 x 384 experts (~10 MiB) ran the
#: dequantization passes ~2-4x faster than the whole active stack, four (~20 MiB) no faster
CHUNK_BYTES = 12 << 20


class DenseSlots:
    """Slots in the model dtype."""

    kind = "dense"

    def __init__(self, n: int, hidden: int, inter: int, dtype: torch.dtype,
                 device: torch.device, bias: bool = False):
        self.w13 = torch.empty((n, 2 * inter, hidden), dtype=dtype, device=device)
        self.w2 = torch.empty((n, hidden, inter), dtype=dtype, device=device)
        self.b13 = torch.empty((n, 2 * inter), dtype=dtype, device=device) if bias else None
        self.b2 = torch.empty((n, hidden), dtype=dtype, device=device) if bias else None

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"w13": self.w13, "w2": self.w2}
        if self.b13 is not None:
            out.update(b13=self.b13, b2=self.b2)
        return out

    def slot(self, s: int) -> dict[str, torch.Tensor]:
        return {k: t[s] for k, t in self.tensors().items()}

    def weights(self, slots: torch.Tensor):
        return self.w13, self.w2, slots

    def biases(self, slots: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(``b13`` [n, 2I], ``b2`` [n, H]) of every slot (indexed like :meth:`weights`), or
        None without expert biases."""
        return None if self.b13 is None else (self.b13, self.b2)

    def refresh(self, slots) -> None:
        """Nothing is derived from dense slots."""

    def describe(self) -> dict:
        return {"format": self.kind, "bytes": _nbytes(self.tensors())}


class DequantScratch:
    """Grow-only buffers the per-step FP8 path dequantizes into (no allocation, no page faults
    per step). One may be shared by every layer of a rank: a layer's weights are used by its
    ``compute`` before any other layer asks for its own."""

    def __init__(self) -> None:
        self._bufs: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype,
            device: torch.device) -> torch.Tensor:
        """A [shape] view of buffer ``name`` (grown, never shrunk; contents undefined)."""
        n = 1
        for d in shape:
            n *= int(d)
        b = self._bufs.get(name)
        if b is None or b.numel() < n or b.dtype != dtype or b.device != device:
            b = self._bufs[name] = torch.empty(n, dtype=dtype, device=device)
        return b[:n].view(shape)


class Fp8Slots:
    """Slots as fp8 bytes plus float32 block scales (see the module docstring)."""

    kind = "fp8"

    def __init__(self, n: int, hidden: int, inter: int, dtype: torch.dtype,
                 device: torch.device, fmt: fp8.Fp8Format, cache: bool = False,
                 scratch: DequantScratch | None = None):
        self.fmt, self.dtype = fmt, dtype
        self.n, self.inter = n, inter
        self.scratch = scratch if scratch is not None else DequantScratch()
        g13, g2 = fp8.grid((inter, hidden), fmt.block), fp8.grid((hidden, inter), fmt.block)
        self.w13_q = torch.empty((n, 2 * inter, hidden), dtype=fp8.FP8, device=device)
        self.w13_s = torch.empty((n, 2, *g13), dtype=torch.float32, device=device)
        self.w2_q = torch.empty((n, hidden, inter), dtype=fp8.FP8, device=device)
        self.w2_s = torch.empty((n, *g2), dtype=torch.float32, device=device)
        self.cache = None
        if cache:
            self.cache = (torch.empty((n, 2 * inter, hidden), dtype=dtype, device=device),
                          torch.empty((n, hidden, inter), dtype=dtype, device=device))

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"w13_q": self.w13_q, "w13_s": self.w13_s, "w2_q": self.w2_q, "w2_s": self.w2_s}

    def slot(self, s: int) -> dict[str, torch.Tensor]:
        return {k: t[s] for k, t in self.tensors().items()}

    def dense_into(self, s: int, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """Dequantize slot ``s`` into ``w13`` [2I, H] (gate and up, each with its own grid)
        and ``w2`` [H, I]: one expert matrix at a time, so the fp32 temporary stays one
        matrix (in the scratch's work buffers)."""
        b, dt, inter = self.fmt.block, self.dtype, self.inter
        n = self.w2_q[0].numel()                 # the largest matrix: gate, up and down alike
        work = (self.scratch.get("i16", (n,), torch.int16, w2.device),
                self.scratch.get("f32", (n,), torch.float32, w2.device))
        fp8.dequantize(self.w13_q[s, :inter], self.w13_s[s, 0], b, dt, out=w13[:inter], work=work)
        fp8.dequantize(self.w13_q[s, inter:], self.w13_s[s, 1], b, dt, out=w13[inter:], work=work)
        fp8.dequantize(self.w2_q[s], self.w2_s[s], b, dt, out=w2, work=work)

    def dense(self, ids: torch.Tensor, scratch: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized (w13 [m, 2I, H], w2 [m, H, I]) of slots ``ids`` [m] (sorted, distinct):
        new tensors, or with ``scratch`` views of the scratch buffers (valid until the next
        scratch use). All slots at once: a few whole-stack passes, not a few per matrix."""
        m, dev, sc = ids.numel(), ids.device, self.scratch
        s13, s2 = (m, *self.w13_q.shape[1:]), (m, *self.w2_q.shape[1:])
        if scratch:
            w13, w2 = sc.get("w13", s13, self.dtype, dev), sc.get("w2", s2, self.dtype, dev)
        else:
            w13 = torch.empty(s13, dtype=self.dtype, device=dev)
            w2 = torch.empty(s2, dtype=self.dtype, device=dev)
        if m == 0:
            return w13, w2
        lo = int(ids[0])
        if int(ids[-1]) - lo + 1 == m:           # a range of slots (all of them, in a decode)
            q13, q2 = self.w13_q[lo:lo + m], self.w2_q[lo:lo + m]
        else:
            q13 = torch.index_select(self.w13_q.view(torch.uint8), 0, ids,
                                     out=sc.get("q13", s13, torch.uint8, dev)).view(fp8.FP8)
            q2 = torch.index_select(self.w2_q.view(torch.uint8), 0, ids,
                                    out=sc.get("q2", s2, torch.uint8, dev)).view(fp8.FP8)
        n = q13.numel()
        work = (sc.get("i16", (n,), torch.int16, dev), sc.get("f32", (n,), torch.float32, dev))
        H, b, dt = q13.shape[-1], self.fmt.block, self.dtype
        fp8.dequantize(q13.view(m, 2, self.inter, H), self.w13_s[ids], b, dt,
                       out=w13.view(m, 2, self.inter, H), work=work)
        fp8.dequantize(q2, self.w2_s[ids], b, dt, out=w2, work=work)
        return w13, w2

    @property
    def chunk(self) -> int:
        """Experts per chunk of the per-step path (:meth:`dense_range`): as many as keep the
        chunk's buffers (int16 bits, float32, the model dtype) within ``CHUNK_BYTES``, at
        least 2 (a batched GEMM over 2+ experts gives each expert's rows the bits it gives
        over the whole stack; over 1 it may split the GEMM across threads and round apart)."""
        per = self.w2_q[0].numel() * 3 * (2 + 4 + (0 if self.dtype == torch.float32
                                                   else self.dtype.itemsize))
        return max(2, min(self.n, CHUNK_BYTES // per))

    def dense_range(self, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized (w13 [b-a, 2I, H], w2 [b-a, H, I]) of slots ``a..b-1``: views of the
        scratch's chunk buffers, valid until the next call (the per-step path dequantizes a
        chunk right before its GEMMs, so it is read back from cache, not memory)."""
        c, dev, sc, b_ = b - a, self.w13_q.device, self.scratch, self.fmt.block
        n = c * self.w13_q[0].numel() + c * self.w2_q[0].numel()
        q13 = self.w13_q[a:b].view(c, 2, self.inter, -1)
        w13, w2 = fp8.dequantize_parts(
            [(q13, fp8.scale_factors(self.w13_s[a:b])),
             (self.w2_q[a:b], fp8.scale_factors(self.w2_s[a:b]))], b_,
            sc.get("chunk_f32", (n,), torch.float32, dev), sc.get("chunk_i16", (n,), torch.int16, dev))
        w13 = w13.view(c, 2 * self.inter, -1)
        if self.dtype != torch.float32:         # the rule's one cast, into the model dtype
            out = sc.get("chunk_out", (n,), self.dtype, dev)
            w13 = out[:w13.numel()].view(w13.shape).copy_(w13)
            w2 = out[w13.numel():n].view(w2.shape).copy_(w2)
        return w13, w2

    def weights(self, slots: torch.Tensor):
        if self.cache is not None:
            return self.cache[0], self.cache[1], slots
        ids, idx = torch.unique(slots, return_inverse=True)
        w13, w2 = self.dense(ids, scratch=True)
        return w13, w2, idx

    def biases(self, slots=None) -> None:
        """FP8 experts have no biases."""
        return None

    def refresh(self, slots) -> None:
        """Re-dequantize the resident cache of ``slots`` (after a load or a move)."""
        if self.cache is None:
            return
        for s in slots:
            self.dense_into(int(s), self.cache[0][int(s)], self.cache[1][int(s)])

    def describe(self) -> dict:
        t = self.tensors()
        out = {"format": self.kind, "bytes": _nbytes(t),
               "fp8_bytes": _nbytes({k: v for k, v in t.items() if k.endswith("_q")}),
               "scale_bytes": _nbytes({k: v for k, v in t.items() if k.endswith("_s")}),
               "dequant": "cache" if self.cache is not None else "per_step"}
        if self.cache is not None:
            out["cache_bytes"] = _nbytes({"w13": self.cache[0], "w2": self.cache[1]})
        return out


class Mxfp4Slots:
    """gpt_oss's MXFP4 experts as stored (:mod:`mxfp4`): ``w13_b`` uint8 [n, 2I, H/32, 16]
    (gate rows, then up rows), ``w13_e`` uint8 [n, 2I, H/32] (e8m0 scales), ``w2_b`` [n, H,
    I/32, 16], ``w2_e`` [n, H, I/32], and the biases ``b13`` [n, 2I], ``b2`` [n, H] in the
    model dtype. Compute dequantizes the step's active slots only (:meth:`weights`; memory:
    the MXFP4 bytes plus the active experts' dense copy during the layer), by the rule of
    transformers' ``convert_moe_packed_tensors``."""

    kind = "mxfp4"

    def __init__(self, n: int, hidden: int, inter: int, dtype: torch.dtype,
                 device: torch.device):
        G, g, u8 = hidden // mxfp4.BLOCK, inter // mxfp4.BLOCK, torch.uint8
        self.n, self.dtype = n, dtype
        self.w13_b = torch.empty((n, 2 * inter, G, 16), dtype=u8, device=device)
        self.w13_e = torch.empty((n, 2 * inter, G), dtype=u8, device=device)
        self.w2_b = torch.empty((n, hidden, g, 16), dtype=u8, device=device)
        self.w2_e = torch.empty((n, hidden, g), dtype=u8, device=device)
        self.b13 = torch.empty((n, 2 * inter), dtype=dtype, device=device)
        self.b2 = torch.empty((n, hidden), dtype=dtype, device=device)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"w13_b": self.w13_b, "w13_e": self.w13_e, "w2_b": self.w2_b,
                "w2_e": self.w2_e, "b13": self.b13, "b2": self.b2}

    def slot(self, s: int) -> dict[str, torch.Tensor]:
        return {k: t[s] for k, t in self.tensors().items()}

    def weights(self, slots: torch.Tensor):
        """The dequantized weights of the distinct slots of ``slots`` [N]: (w13 [m, 2I, H],
        w2 [m, H, I], idx [N] into them)."""
        ids, idx = torch.unique(slots, return_inverse=True)
        return (mxfp4.dequantize(self.w13_b[ids], self.w13_e[ids], self.dtype),
                mxfp4.dequantize(self.w2_b[ids], self.w2_e[ids], self.dtype), idx)

    def biases(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The biases of the distinct slots of ``slots``, indexed like :meth:`weights`."""
        ids = torch.unique(slots)
        return self.b13[ids], self.b2[ids]

    def refresh(self, slots) -> None:
        """Nothing is derived from MXFP4 slots (dequantized per step)."""

    def describe(self) -> dict:
        t = self.tensors()
        return {"format": self.kind, "bytes": _nbytes(t),
                "mxfp4_bytes": _nbytes({k: v for k, v in t.items() if k.endswith(("_b", "_e"))}),
                "dequant": "per_step"}


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def make_store(n: int, hidden: int, inter: int, dtype: torch.dtype, device, *,
               fmt: fp8.Fp8Format | None, cache: bool = False,
               scratch: DequantScratch | None = None, bias: bool = False,
               mxfp4_experts: bool = False):
    """The store of ``n`` slots: :class:`Fp8Slots` for FP8 experts (``fmt``; ``scratch``:
    the per-step path's buffers, shared by a rank's layers), :class:`Mxfp4Slots` for gpt_oss's
    MXFP4 experts (``mxfp4_experts``), else dense (``bias``: with expert biases)."""
    device = torch.device(device)
    if mxfp4_experts:
        return Mxfp4Slots(n, hidden, inter, dtype, device)
    if fmt is None:
        return DenseSlots(n, hidden, inter, dtype, device, bias)
    if bias:
        raise ValueError("FP8 experts with biases are not supported")
    return Fp8Slots(n, hidden, inter, dtype, device, fmt, cache, scratch)


def slot_checksum(tensors: dict[str, torch.Tensor]) -> float:
    """Identity of one slot's tensors (every weight tensor, scales included), from their
    bytes: per tensor (sorted names), the position-weighted sum of its 16-bit words modulo the
    prime 2^31 - 1, chained. Any single changed word changes it (weights and words are both
    below the prime), as do swapped or shifted experts; exact in a float64. Works in blocks of
    64 Ki words, so the temporaries stay small at load and in every canary check."""
    h = 0
    for name in sorted(tensors):
        h = (h * 1_000_003 + _tensor_sum(tensors[name])) % _P
    return float(h)


_P = (1 << 31) - 1
_BLOCK = 1 << 16


def _tensor_sum(t: torch.Tensor) -> int:
    b = t.contiguous().reshape(-1).view(torch.uint8)
    words = b.view(torch.int16) if b.numel() % 2 == 0 else b
    ramp = torch.arange(1, _BLOCK + 1, dtype=torch.int64, device=t.device)
    acc = 0
    for i in range(0, words.numel(), _BLOCK):
        w = words[i:i + _BLOCK].to(torch.int64)
        acc = (acc + int((w * ramp[:w.numel()]).sum()) * (i // _BLOCK + 1)) % _P
    return acc
