"""``FusedMoE``: one MoE layer's routed experts on one EP rank, stored per physical local slot.

Storage contract (the EPLB migration path relies on it):

- ``store`` (:mod:`expert_store`): the slots' weight tensors, dense (``w13`` [S, 2I, H] gate
  rows then up rows, ``w2`` [S, H, I]) or FP8 (fp8 bytes + float32 block scales); ``tag``
  [S, 2] int64 = (logical expert id, MoE layer id), ``csum`` [S] float64 =
  :func:`expert_store.slot_checksum` of the slot's weight tensors (scales included) taken when
  they were loaded from the checkpoint — allocated once, never reassigned (stable addresses for
  graph capture); weights move by ``copy_`` / ``index_copy_`` into these tensors.
- ``expert_tensors()`` returns exactly the per-slot tensors that move with an expert (the
  store's tensors, ``tag``, ``csum``; first dim S). The canary (``check_tags``,
  ``check_checksums``) compares the tags with ``local_expert_ids`` and the weights with the
  checksum that travelled with them. ``refresh_slots(slots)`` recomputes what is derived from
  moved slots (the FP8 resident dequantized cache) once their tensors arrived.
- ``source(layer, e, out) -> dict``: where :meth:`load_placement` materialises logical expert
  ``e`` from (the checkpoint reader, ``Decoder._source``); ``out`` is the slot's own tensors
  (``store.slot(s)``), which a source may read straight into (the checkpoint reader does: no
  temporary per-expert copy at load) and return, or ignore and return its own tensors.
- ``local_expert_ids`` torch int64 [S] (updated in place), ``global_phy2log`` host numpy int64
  [D*S] (mirror of the active global slot table), ``log2phy`` torch int64 [E] (updated in place):
  logical id -> the global physical slot this rank sends that expert's tokens to.

Replica choice (``log2phy``): as xLLM, source rank r sends all tokens of logical expert e to the
replica with index ``r % count(e)`` among e's slots in global rank-major order
(``placement.build_log2phy``). Each source rank is deterministic; different source ranks spread
over the replicas, so with D ranks and c replicas each replica serves about D/c source ranks.

Per-step replica choice (``eplb_replica_routing``): ``model/replica_dispatch.py`` uses
``log2phy`` for ``static`` and :meth:`FusedMoE.routing_plan` (cached per active table) for
``spread`` / ``balanced``.

Expert compute time: every ``compute`` call adds its thread CPU seconds (``time.thread_time``,
independent of how the machine's cores are shared between ranks) to ``compute_cpu_s``;
``take_compute_cpu()`` reads and resets it (the decoder does once per layer and step); wall
seconds go to ``compute_s`` (the step timer's ``experts``; the decoder starts both anew per
layer with ``reset_compute_clock()``).
"""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.nn.functional as F

from xllm_eplb.config import Config
from xllm_eplb.eplb import placement
from xllm_eplb.eplb import replica_routing as rr
from xllm_eplb.kernels import fused_experts
from xllm_eplb.model import dense
from xllm_eplb.model.expert_act import PLAIN, ExpertAct
from xllm_eplb.model.expert_store import DequantScratch, Fp8Slots, make_store, slot_checksum
from xllm_eplb.model.fp8 import Fp8Format
from xllm_eplb.model.loader import torch_dtype


class FusedMoE:
    """Routed experts of MoE layer ``layer_id`` (MoE-local, 0..L-1) on rank ``ep_rank``.

    ``phy2log``: the global slot table of this layer, int64 [D*S]; its slice
    ``[ep_rank*S, (ep_rank+1)*S)`` is materialised from ``source``. ``scratch``: the FP8
    per-step path's buffers (``expert_store.DequantScratch``; the decoder shares one between
    its layers; default: the layer's own). ``act``: the experts' FFN variant
    (:mod:`expert_act`; gpt_oss: biases in the store and a clamped SwiGLU);
    ``mxfp4_experts``: gpt_oss's MXFP4 slots (``expert_store.Mxfp4Slots``).
    """

    def __init__(self, cfg: Config, layer_id: int, ep_rank: int, phy2log: np.ndarray,
                 device: torch.device | str = "cpu", *, source, quant: Fp8Format | None = None,
                 scratch: DequantScratch | None = None, act: ExpertAct = PLAIN,
                 mxfp4_experts: bool = False):
        m = cfg.model
        self.cfg = cfg
        self.source = source
        self.layer_id = int(layer_id)
        self.ep_rank = int(ep_rank)
        self.ep_size = int(cfg.eplb.ep_size)
        self.num_logical = int(m.num_experts)
        self.slots_per_rank = placement.slots_per_rank(self.num_logical, self.ep_size,
                                                       cfg.eplb.redundant_experts_num)
        S, H, inter = self.slots_per_rank, m.hidden_size, m.moe_intermediate_size
        dt = torch_dtype(cfg)
        self.device = torch.device(device)
        #: the routed experts run the fused C++ kernel (``model.dense.resolve``), else torch
        self.fused = dense.resolve(cfg.model.moe_kernel, dt, self.device)
        self.act = act
        self.store = make_store(S, H, inter, dt, self.device, fmt=quant,
                                cache=cfg.model.fp8_dequant_cache, scratch=scratch,
                                bias=act.bias, mxfp4_experts=mxfp4_experts)
        self.tag = torch.empty((S, 2), dtype=torch.int64, device=self.device)
        self.csum = torch.empty(S, dtype=torch.float64, device=self.device)
        self.local_expert_ids = torch.empty(S, dtype=torch.int64, device=self.device)
        self.log2phy = torch.empty(self.num_logical, dtype=torch.int64, device=self.device)
        self.global_phy2log = np.empty(self.ep_size * S, dtype=np.int64)
        self.compute_cpu_s = self.compute_s = 0.0
        self._plan: rr.RoutingPlan | None = None
        self.load_placement(phy2log)

    # ---- placement -------------------------------------------------------------------------
    def local_slice(self, phy2log: np.ndarray) -> np.ndarray:
        S = self.slots_per_rank
        return np.asarray(phy2log, dtype=np.int64)[self.ep_rank * S:(self.ep_rank + 1) * S]

    def load_placement(self, phy2log: np.ndarray) -> None:
        """Materialise every local slot of ``phy2log`` [D*S] from ``source`` and
        activate the table (model construction and tests; EPLB moves weights by copy)."""
        p = np.asarray(phy2log, dtype=np.int64)
        if p.shape != (self.ep_size * self.slots_per_rank,):
            raise ValueError(f"layer {self.layer_id}: phy2log has shape {p.shape}, expected "
                             f"({self.ep_size * self.slots_per_rank},)")
        first: dict[int, int] = {}
        for s, e in enumerate(self.local_slice(p).tolist()):
            # a second local replica: copy, do not re-read
            self.load_slot(s, e, first.get(e))
            first.setdefault(e, s)
        self.store.refresh(range(self.slots_per_rank))
        self.activate_table(p)

    def load_slot(self, s: int, e: int, copy_of: int | None = None) -> None:
        """Local slot ``s`` takes logical expert ``e``'s weights: read from ``source`` (the
        checkpoint, same bytes as at load), or copied from local slot ``copy_of``; its tag and
        checksum follow. The caller refreshes the store's derived state (``store.refresh``)."""
        dst = self.store.slot(s)
        w = self.store.slot(copy_of) if copy_of is not None else self.source(self.layer_id, e,
                                                                             dst)
        for name, t in dst.items():
            if w[name].data_ptr() != t.data_ptr():
                t.copy_(w[name])
        self.csum[s] = slot_checksum(dst)
        self.tag[s, 0] = e
        self.tag[s, 1] = self.layer_id

    def reshard(self, ep_rank: int, ep_size: int, table: np.ndarray) -> int:
        """Elastic membership change (``Decoder.reshard``): this layer becomes compact rank
        ``ep_rank`` of ``ep_size`` under the deployed row ``table`` [ep_size*S]; a local slot
        keeps its weights unless its logical expert changed (then read from ``source``). Every
        size-derived field follows (``ep_rank``, ``ep_size``, ``global_phy2log``, ``log2phy``,
        the routing plan). Returns the slots read."""
        S = self.slots_per_rank
        old = self.local_expert_ids.cpu().numpy().copy()
        new = np.asarray(table, dtype=np.int64)[ep_rank * S:(ep_rank + 1) * S]
        changed = [s for s in range(S) if new[s] != old[s]]
        for s in changed:
            self.load_slot(s, int(new[s]))
        if changed:
            self.store.refresh(changed)
        self.ep_rank, self.ep_size = int(ep_rank), int(ep_size)
        self.global_phy2log = np.empty(ep_size * S, dtype=np.int64)
        self._plan = None
        self.activate_table(table)
        return len(changed)

    def activate_table(self, phy2log: np.ndarray) -> None:
        """Switch the id tables (not the weights) to ``phy2log`` [D*S], all in place."""
        p = np.asarray(phy2log, dtype=np.int64)
        l2p = placement.build_log2phy(p, self.num_logical, self.ep_rank)
        if (l2p < 0).any():
            raise ValueError(f"layer {self.layer_id}: logical expert {int(np.argmax(l2p < 0))} "
                             f"has no replica")
        self.global_phy2log[:] = p
        self.local_expert_ids.copy_(torch.as_tensor(self.local_slice(p)))
        self.log2phy.copy_(torch.as_tensor(l2p))

    def routing_plan(self) -> rr.RoutingPlan:
        """The per-step replica routing precomputation of the active table
        (``replica_routing.prepare``), rebuilt whenever ``global_phy2log`` changed: a live
        migration switches the table in place, so the cache is checked against it on every call
        ([D*S] compare, microseconds)."""
        p = self._plan
        if p is None or not np.array_equal(p.phy2log, self.global_phy2log):
            p = self._plan = rr.prepare(self.global_phy2log.copy(), self.num_logical,
                                        self.ep_size)
        return p

    def expert_tensors(self) -> dict[str, torch.Tensor]:
        """The per-slot tensors that move with an expert: name -> tensor [S, ...]."""
        return {**self.store.tensors(), "tag": self.tag, "csum": self.csum}

    def refresh_slots(self, slots) -> None:
        """Recompute the state derived from the tensors of ``slots`` (after a move wrote them)."""
        self.store.refresh(slots)

    @property
    def w13(self) -> torch.Tensor:
        """Dense slots' gate/up weights [S, 2I, H] (dense storage only)."""
        return self.store.w13

    @property
    def w2(self) -> torch.Tensor:
        """Dense slots' down weights [S, H, I] (dense storage only)."""
        return self.store.w2

    def check_tags(self) -> list[int]:
        """Canary: local slots whose tag is not (local_expert_ids[s], layer_id); [] if all good."""
        want = torch.stack([self.local_expert_ids,
                            torch.full_like(self.local_expert_ids, self.layer_id)], dim=1)
        return torch.nonzero((self.tag != want).any(dim=1)).flatten().tolist()

    def check_checksums(self) -> list[int]:
        """Canary for real weights: local slots whose weights no longer match the checksum
        that was taken at load and moved with them; [] if all good."""
        return [s for s in range(self.slots_per_rank)
                if slot_checksum(self.store.slot(s)) != float(self.csum[s])]

    # ---- compute ---------------------------------------------------------------------------
    def route(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """Logical top-k ids [T, k] -> global physical slot ids [T, k] via ``log2phy``."""
        return self.log2phy[topk_ids]

    def compute(self, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Expert outputs (unweighted): row n of ``x`` [N, H] through local slot ``slots[n]``
        [N] int64 in [0, S) -> [N, H] (:func:`grouped_ffn`). Adds its thread CPU seconds to
        ``compute_cpu_s`` and its wall seconds to ``compute_s``."""
        c0, t0 = time.thread_time(), time.perf_counter()
        try:
            return self._compute(x, slots)
        finally:
            self.compute_cpu_s += time.thread_time() - c0
            self.compute_s += time.perf_counter() - t0

    def reset_compute_clock(self) -> None:
        """Start ``compute_cpu_s`` and ``compute_s`` anew at 0 (per layer and step)."""
        self.compute_cpu_s = self.compute_s = 0.0

    def take_compute_cpu(self) -> float:
        """Thread CPU seconds of ``compute`` since the last call (then reset to 0)."""
        s, self.compute_cpu_s = self.compute_cpu_s, 0.0
        return s

    def _compute(self, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        st = self.store
        if st.kind == "fp8" and st.cache is None:          # per step, chunk by chunk
            if self.fused:
                return fused_chunks(x, slots, st)
            return grouped_ffn(x, None, None, slots, chunks=st)
        w13, w2, idx = st.weights(slots)
        bias = None if self.act is PLAIN else st.biases(slots)
        if self.fused:
            return kernel_ffn(x, idx, w13, w2, bias, self.act)
        if self.act is PLAIN:
            return grouped_ffn(x, w13, w2, idx)
        return grouped_ffn(x, w13, w2, idx, bias=bias, act=self.act)

    def count(self, slots: torch.Tensor, counted: torch.Tensor) -> torch.Tensor:
        """Per-slot load of received rows: int64 [S] (rows with ``counted`` 0 excluded)."""
        out = torch.zeros(self.slots_per_rank, dtype=torch.int64, device=slots.device)
        return out.index_add_(0, slots, counted.to(torch.int64))


def grouped_ffn(x: torch.Tensor, w13: torch.Tensor | None, w2: torch.Tensor | None,
                idx: torch.Tensor, chunks: Fp8Slots | None = None, *,
                bias: tuple[torch.Tensor, torch.Tensor] | None = None,
                act: ExpertAct = PLAIN) -> torch.Tensor:
    """Row n of ``x`` [N, H] through expert ``idx[n]`` of ``w13`` [M, 2I, H], ``w2``
    [M, H, I] -> [N, H]. Rows are sorted by expert; then either one padded batched GEMM pair
    over the experts ``lo..hi`` the rows touch (:func:`_padded_ffn`: no per-expert Python,
    the weights read in place, in parallel over experts) or one GEMM pair per active expert,
    whichever :func:`_use_padded` expects to be cheaper.

    ``chunks`` (the FP8 per-step path: an :class:`Fp8Slots` without cache; ``w13`` and ``w2``
    None, M its slots): the experts are dequantized ``chunks.chunk`` at a time
    (``dense_range``), each chunk's GEMMs right after its dequantization, so the dense chunk
    is read back from cache and only the fp8 bytes come from memory. The same choice and
    GEMM shapes per expert as over the dequantized stack, batched GEMMs over 2+ experts: the
    same outputs as the resident cache.

    ``bias`` (``b13`` [M, 2I], ``b2`` [M, H], indexed like ``w13``) and ``act``: the gpt_oss
    variant (:mod:`expert_act`), dense weights only."""
    if x.shape[0] == 0:
        return torch.empty_like(x)
    order = torch.argsort(idx, stable=True)
    sidx = idx[order]
    counts = torch.bincount(sidx, minlength=w13.shape[0] if chunks is None else chunks.n)
    lo, hi = int(sidx[0]), int(sidx[-1]) + 1
    cl = counts[lo:hi].tolist()
    out = torch.empty_like(x)
    if _use_padded(cl):
        out[order] = _padded_ffn(x[order], sidx, counts, w13, w2, lo, hi, max(cl), chunks,
                                 bias, act)
        return out
    xs = x[order]
    ys = torch.empty_like(xs)
    start, run, w = 0, (0, 0), (w13, w2)
    for j, c in enumerate(cl):
        if not c:
            continue
        if chunks is None:
            k = lo + j
        else:                   # dequantize the run of active experts from j, chunk-sized
            if not run[0] <= j < run[1]:
                end = j + 1
                while end < len(cl) and end - j < chunks.chunk and cl[end]:
                    end += 1
                run, w = (j, end), chunks.dense_range(lo + j, lo + end)
            k = j - run[0]
        b = None if bias is None else (bias[0][k], bias[1][k])
        ys[start:start + c] = expert_ffn(xs[start:start + c], w[0][k], w[1][k], b, act)
        start += c
    out[order] = ys
    return out


#: relative cost of one expert's GEMM pair (2 threads, CPU; measured on 768 x 384 experts):
#: a single-row GEMV reads the weights at ~full bandwidth, a small-M GEMM runs ~2x slower
#: single-threaded per expert; a batched GEMM over experts runs them in parallel; large M is
#: compute-bound at about ``ROW_COST`` per row either way
ROW_COST, LOOP_GEMV, LOOP_GEMM, BMM_GEMV, BMM_GEMM = 0.16, 2.0, 3.5, 1.0, 1.6


def _use_padded(counts: list[int]) -> bool:
    """Padded batched GEMMs over every expert between the first and last active one (their
    rows padded to the largest count) when that costs less than one GEMM pair per active
    expert (counts: rows per expert over that span)."""
    n_max = max(counts)
    loop = sum(max(LOOP_GEMV if c == 1 else LOOP_GEMM, ROW_COST * c) for c in counts if c)
    pad = len(counts) * max(BMM_GEMV if n_max == 1 else BMM_GEMM, ROW_COST * n_max)
    return pad <= loop


def _padded_ffn(xs: torch.Tensor, sidx: torch.Tensor, counts: torch.Tensor,
                w13: torch.Tensor | None, w2: torch.Tensor | None, lo: int, hi: int, n_max: int,
                chunks: Fp8Slots | None = None, bias=None, act: ExpertAct = PLAIN
                ) -> torch.Tensor:
    """Rows ``xs`` [N, H] sorted by expert ``sidx`` [N] (``counts`` rows per expert) through
    experts ``lo..hi-1``: scattered into [hi-lo, n_max, H] (zero padding), two ``bmm`` over
    the experts' weights as stored (views, no copy), or chunk by chunk of ``chunks``'
    dequantized experts (chunks of 2+, skipping those without rows), gathered back -> [N, H]."""
    first = torch.cumsum(counts, 0) - counts                 # first sorted row of each expert
    rank = torch.arange(xs.shape[0], device=xs.device) - first[sidx]
    e = sidx - lo
    xp = xs.new_zeros((hi - lo, n_max, xs.shape[1]))
    xp[e, rank] = xs
    if chunks is None:
        b = None if bias is None else (bias[0][lo:hi], bias[1][lo:hi])
        return _bmm_ffn(xp, w13[lo:hi], w2[lo:hi], bias=b, act=act)[e, rank]
    yp = torch.empty_like(xp)
    cl = counts[lo:hi].tolist()
    for a, b in chunk_spans(hi - lo, chunks.chunk):
        if any(cl[a:b]):
            _bmm_ffn(xp[a:b], *chunks.dense_range(lo + a, lo + b), out=yp[a:b])
    return yp[e, rank]


def kernel_ffn(x: torch.Tensor, idx: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
               bias: tuple[torch.Tensor, torch.Tensor] | None, act: ExpertAct) -> torch.Tensor:
    """:func:`grouped_ffn`'s contract on the fused kernel: row n of ``x`` [N, H] through expert
    ``idx[n]`` of ``w13`` [M, 2I, H] / ``w2`` [M, H, I], with the variant's biases (``b13``
    [M, 2I], ``b2`` [M, H]) and activation (:class:`ExpertAct`)."""
    b13, b2 = (None, None) if bias is None else (bias[0].contiguous(), bias[1].contiguous())
    return fused_experts(x, idx, w13.contiguous(), w2.contiguous(), b13, b2,
                         act="swiglu_clamp" if act.limit else "silu", alpha=act.alpha,
                         limit=act.limit)


def fused_chunks(x: torch.Tensor, slots: torch.Tensor, chunks: Fp8Slots) -> torch.Tensor:
    """The FP8 per-step path on the fused kernel: the slots ``slots`` [N] use, dequantized
    ``chunks.chunk`` at a time (``dense_range``), each chunk's rows through one kernel call
    right after its dequantization -> [N, H] (row for row what the kernel gives over the
    resident cache: its outputs do not depend on which rows share a call)."""
    out = torch.empty_like(x)
    if x.shape[0] == 0:
        return out
    counts = torch.bincount(slots, minlength=chunks.n).tolist()
    active = [s for s, c in enumerate(counts) if c]
    lo, hi = active[0], active[-1] + 1
    for a, b in chunk_spans(hi - lo, chunks.chunk):
        a, b = a + lo, b + lo
        if not any(counts[a:b]):
            continue
        rows = torch.nonzero((slots >= a) & (slots < b)).flatten()
        w13, w2 = chunks.dense_range(a, b)
        out[rows] = fused_experts(x[rows], slots[rows] - a, w13.contiguous(), w2.contiguous())
    return out


def chunk_spans(n: int, c: int) -> list[tuple[int, int]]:
    """``0..n`` cut into spans of ``c`` (>= 2), the last one 1 longer rather than 1 alone
    (one expert alone: see ``Fp8Slots.chunk``)."""
    b = list(range(0, n, c)) + [n]
    if len(b) > 2 and b[-1] - b[-2] == 1:
        del b[-2]
    return list(zip(b[:-1], b[1:], strict=True))


def _bmm_ffn(xp: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
             out: torch.Tensor | None = None, bias=None, act: ExpertAct = PLAIN
             ) -> torch.Tensor:
    """SwiGLU over experts: xp [M, n, H], w13 [M, 2I, H], w2 [M, H, I] -> [M, n, H]
    (``bias``: ``b13`` [M, 2I], ``b2`` [M, H]; ``act``: the activation variant)."""
    if act is PLAIN:
        g, u = torch.bmm(xp, w13.transpose(1, 2)).chunk(2, dim=-1)
        return torch.bmm(F.silu(g) * u, w2.transpose(1, 2), out=out)
    h = torch.bmm(xp, w13.transpose(1, 2))
    if bias is not None:
        h = h + bias[0][:, None, :]
    y = torch.bmm(act.glu(*h.chunk(2, dim=-1)), w2.transpose(1, 2), out=out)
    return y if bias is None else y.add_(bias[1][:, None, :])


def expert_ffn(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, bias=None,
               act: ExpertAct = PLAIN) -> torch.Tensor:
    """SwiGLU FFN: x [N, H], w13 [2I, H], w2 [H, I] -> [N, H] (``bias``: ``b13`` [2I],
    ``b2`` [H]; ``act``: the activation variant)."""
    h = x @ w13.t()
    if act is PLAIN:
        g, u = h.chunk(2, dim=-1)
        return (F.silu(g) * u) @ w2.t()
    if bias is not None:
        h = h + bias[0]
    y = act.glu(*h.chunk(2, dim=-1)) @ w2.t()
    return y if bias is None else y + bias[1]


class LogicalMoE:
    """Single-process reference: every logical expert of one layer, no placement, no dispatch
    (the fused kernel or the torch path, as ``--moe_kernel`` and the dtype decide).

    ``w13`` [E, 2inter, H], ``w2`` [E, H, I]; same weights as any FusedMoE slot holding the
    expert (FP8 experts: read into an FP8 store of E slots and dequantized once, by the same
    rule).
    """

    def __init__(self, cfg: Config, layer_id: int, device: torch.device | str = "cpu", *,
                 source, quant: Fp8Format | None = None, act: ExpertAct = PLAIN,
                 mxfp4_experts: bool = False):
        m = cfg.model
        E = m.num_experts
        store = make_store(E, m.hidden_size, m.moe_intermediate_size, torch_dtype(cfg), device,
                           fmt=quant, bias=act.bias, mxfp4_experts=mxfp4_experts)
        for e in range(E):
            dst = store.slot(e)
            w = source(layer_id, e, dst)
            for name, t in dst.items():
                if w[name].data_ptr() != t.data_ptr():
                    t.copy_(w[name])
        self.layer_id = layer_id
        self.num_logical = E
        ids = torch.arange(E, device=torch.device(device))
        self.w13, self.w2 = store.dense(ids) if quant is not None else store.weights(ids)[:2]
        self.act, self.bias = act, store.biases(ids)
        self.fused = dense.resolve(cfg.model.moe_kernel, self.w13.dtype, device)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], topk_ids [T, k] logical -> expert outputs [T, k, H] (unweighted)."""
        T, k = topk_ids.shape
        xr = x.repeat_interleave(k, dim=0)
        ids = topk_ids.reshape(-1)
        if self.fused:
            y = kernel_ffn(xr, ids, self.w13, self.w2, self.bias, self.act)
        else:
            y = grouped_ffn(xr, self.w13, self.w2, ids, bias=self.bias, act=self.act)
        return y.reshape(T, k, -1)
