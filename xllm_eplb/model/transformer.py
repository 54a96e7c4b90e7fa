"""``MoETransformer``: the small DeepSeek-style decoder one worker (one EP rank) runs.

Data-parallel attention (each rank attends only over its own requests, KV cache per request) and
expert-parallel MoE layers (routed experts sharded over the EP group as :class:`FusedMoE`, plus
an optional shared expert computed locally). The first ``first_k_dense_replace`` layers are
dense. The LM head is tied to the embedding.

``forward_step(batch)`` returns a :class:`StepResult` whose ``counters`` are this step's per-layer
slot loads as prefix sums along the slot axis, int64 [L_moe, S], written fresh for every layer
every step (xLLM's stale-row hazard does not exist here). Not counted: graph-mode padding rows,
the filler row of an empty rank in graph mode, and (``eplb_use_decode_only_load``) prefill rows.

``MoETransformer.reference(cfg)`` builds the single-process reference: same weights, every
logical expert local, no dispatch; its counters are per logical expert, [L_moe, E].
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from xllm_eplb.config import Config
from xllm_eplb.eplb import counters as counter_format
from xllm_eplb.eplb.placement import initial_phy2log
from xllm_eplb.model import dispatch as dsp
from xllm_eplb.model import replica_dispatch as rdp
from xllm_eplb.model.batch import RankBatch
from xllm_eplb.model.layers import KVCache, attention, positions_encoding, rms_norm, sample, swiglu
from xllm_eplb.model.moe import FusedMoE, LogicalMoE
from xllm_eplb.model.rank_model import RankModel
from xllm_eplb.model.routing import Router, load_trace, trace_probs
from xllm_eplb.model.validate import validate_model_config, validate_phy2log
from xllm_eplb.model.weights import param

log = logging.getLogger(__name__)


@dataclass
class StepResult:
    """sampled: req_id -> next token; counters: int64 [L_moe, S] prefix sums (reference:
    [L_moe, E]); logits: [rows, V] float64 at each row's last position (when asked for);
    warmup: the forward was a warm-up (the engine ignores its counters); mode: dispatch path;
    timings: seconds (total_s, moe_s, comm_wait_s, counter_s: float wall clock; expert_cpu_s:
    list [L_moe] of this rank's local expert compute thread CPU time per MoE layer, from
    ``FusedMoE.compute``, reference: ``LogicalMoE.forward``); routed (when asked for): per MoE
    layer the logical top-k ids int64 [T, k] of every row incl. padding, and counted bool [T]."""

    sampled: dict[int, int]
    counters: np.ndarray
    logits: torch.Tensor | None = None
    warmup: bool = False
    mode: str = dsp.PLAIN
    timings: dict = field(default_factory=dict)
    routed: list | None = None
    counted: np.ndarray | None = None


def graph_bucket(n: int, max_batch: int) -> int:
    """Decode graph bucket for n rows: next power of two >= max(n, 1), capped at max_batch."""
    b = 1
    while b < max(n, 1):
        b *= 2
    return max(n, min(b, max_batch))


def _bf16_supported(device: torch.device) -> bool:
    if device.type == "cuda":
        return bool(torch.cuda.is_bf16_supported())
    return True


class MoETransformer(RankModel):
    """One EP rank's model. ``phy2log``: int64 [L_moe, D*S] initial placement (default: xLLM's
    initial layout). ``ep_group``: the EP process group (None = default world group)."""

    def __init__(self, cfg: Config, ep_rank: int, ep_group=None, phy2log: np.ndarray | None = None,
                 *, device: str | torch.device | None = None, _reference: bool = False):
        validate_model_config(cfg)
        m = cfg.model
        self.cfg, self.ep_rank, self.ep_group = cfg, int(ep_rank), ep_group
        self.reference_mode = _reference
        self.device = torch.device(device or ("cpu" if cfg.runtime.device == "cpu"
                                              else cfg.runtime.device))
        self.num_layers, self.first_dense = m.num_layers, m.first_k_dense_replace
        self.num_moe_layers = cfg.num_moe_layers
        self.p = {k: param(cfg, k).to(self.device) for k in self._param_names()}
        probs = (trace_probs(load_trace(m.routing_trace), self.num_moe_layers, m.num_experts)
                 if m.routing_mode == "trace" else None)
        self.routers = [Router(cfg, ml, self.p[f"layers.{self._dec(ml)}.gate"],
                               self.p[f"layers.{self._dec(ml)}.gate_bias"],
                               None if probs is None else probs[ml])
                        for ml in range(self.num_moe_layers)]
        self.moe_layers: list[FusedMoE] = []
        self.logical_layers: list[LogicalMoE] = []
        if _reference:
            self.logical_layers = [LogicalMoE(cfg, ml, self.device)
                                   for ml in range(self.num_moe_layers)]
        else:
            import torch.distributed as dist
            if phy2log is None:
                base = initial_phy2log(m.num_experts, cfg.eplb.ep_size,
                                       cfg.eplb.redundant_experts_num)
                phy2log = np.tile(base, (self.num_moe_layers, 1))
            phy2log = validate_phy2log(cfg, phy2log)
            if not dist.is_initialized():
                raise RuntimeError("a sharded MoETransformer needs an initialised EP process "
                                   "group (worker.comm.init_groups); for one process use "
                                   "MoETransformer.reference(cfg)")
            self.moe_layers = [FusedMoE(cfg, ml, ep_rank, phy2log[ml], self.device)
                               for ml in range(self.num_moe_layers)]
        self.kv = KVCache(m.num_layers)
        self.fused_failure = dsp.fused_precondition_failure(
            cfg.runtime.device, m.dtype, cfg.runtime.enable_graph, _bf16_supported(self.device))
        self._fallback_logged = False

    @classmethod
    def reference(cls, cfg: Config, device: str | None = None) -> "MoETransformer":
        """Single-process reference model (every logical expert local, no dispatch)."""
        return cls(cfg, 0, None, None, device=device, _reference=True)

    # ---- helpers ---------------------------------------------------------------------------
    def _dec(self, ml: int) -> int:
        return self.first_dense + ml

    def _param_names(self) -> list[str]:
        from xllm_eplb.model.weights import param_shapes
        return [k for k in param_shapes(self.cfg) if ".experts." not in k]

    # ---- forward ---------------------------------------------------------------------------
    def _inputs(self, batch: RankBatch, pure_decode: bool):
        """Flatten rows: tokens, positions, keys [T, 3], counted [T] bool, row spans, padding."""
        toks, pos, keys, counted, spans = [], [], [], [], []
        decode_only = self.cfg.eplb.eplb_use_decode_only_load
        for r in batch.rows:
            n = len(r.token_ids)
            if n == 0:
                raise ValueError(f"request {r.req_id}: empty token_ids")
            have = self.kv.length(r.req_id)
            if r.start_pos != have:
                raise ValueError(f"request {r.req_id}: start_pos={r.start_pos} but the KV cache "
                                 f"holds {have} positions")
            if r.start_pos + n > self.cfg.model.max_position_embeddings:
                raise ValueError(f"request {r.req_id}: {r.start_pos + n} positions exceed "
                                 f"max_position_embeddings={self.cfg.model.max_position_embeddings}")
            spans.append((len(toks), n))
            toks += list(r.token_ids)
            pos += list(range(r.start_pos, r.start_pos + n))
            keys += [(r.req_id, r.start_pos + j, t) for j, t in enumerate(r.token_ids)]
            counted += [not (decode_only and r.is_prefill)] * n
        n_real = len(toks)
        if self.cfg.runtime.enable_graph and (batch.is_empty or batch.is_pure_decode):
            # NOTE: graph mode pads decode batches to a bucket; an empty rank runs one filler
            # row. Padding/filler rows are routed and dispatched but never counted.
            n_pad = graph_bucket(n_real, self.cfg.runtime.max_batch_size) - n_real
            toks += [0] * n_pad
            pos += [0] * n_pad
            keys += [(-1, j, 0) for j in range(n_pad)]
            counted += [False] * n_pad
        d = self.device
        return (torch.tensor(toks, dtype=torch.int64, device=d),
                torch.tensor(pos, dtype=torch.int64, device=d),
                torch.tensor(keys, dtype=torch.int64, device=d).reshape(-1, 3),
                torch.tensor(counted, dtype=torch.bool, device=d), spans, n_real)

    def forward_step(self, batch: RankBatch, *, warmup: bool = False,
                     pure_decode: bool | None = None, return_logits: bool = False,
                     return_routing: bool = False) -> StepResult:
        """Run one step of this rank's rows. ``pure_decode``: the engine's step-level flag (every
        non-empty rank batch is pure decode); None counts as False (plain path for mode 2).
        A warm-up forward keeps no KV cache and is flagged in the result."""
        t0 = time.perf_counter()
        self.release(batch.release)
        mode = dsp.PLAIN if self.reference_mode else self.dispatch_mode(bool(pure_decode))
        toks, pos, keys, counted, spans, n_real = self._inputs(batch, bool(pure_decode))
        p, H = self.p, self.cfg.model.hidden_size
        h = p["embed"][toks] + positions_encoding(pos, H, p["embed"].dtype).to(self.device)
        stats = dsp.CommStats()
        moe_s, counter_s, counters, routed, expert_cpu = 0.0, 0.0, [], [], []
        for i in range(self.num_layers):
            pre = f"layers.{i}."
            xn = rms_norm(h, p[pre + "attn_norm"])
            a = torch.zeros_like(h)
            for r, (s, n) in zip(batch.rows, spans, strict=True):
                a[s:s + n] = attention(xn[s:s + n], p[pre + "wqkv"], p[pre + "wo"],
                                       self.cfg.model.num_attention_heads, self.kv, i,
                                       r.req_id, r.start_pos)
            h = h + a
            xn = rms_norm(h, p[pre + "ffn_norm"])
            if i < self.first_dense:
                h = h + swiglu(xn, p[pre + "mlp.w13"], p[pre + "mlp.w2"])
                continue
            tm = time.perf_counter()
            y, cnt, dt_cnt, ids, cpu = self._moe(i - self.first_dense, xn, keys, counted, mode,
                                                 stats)
            if return_routing:
                routed.append(ids.cpu().numpy())
            moe_s += time.perf_counter() - tm
            counter_s += dt_cnt
            expert_cpu.append(cpu)
            counters.append(cnt)
            h = h + y
        hn = rms_norm(h, p["final_norm"])
        last = [s + n - 1 for s, n in spans]
        logits = (hn[last] @ p["embed"].t()).to(torch.float64).cpu() / H ** 0.5
        sampled = {r.req_id: sample(logits[j], r.temperature, r.seed, r.start_pos + len(r.token_ids),
                                    r.top_p, r.top_k)
                   for j, r in enumerate(batch.rows)}
        if warmup:
            self.release([r.req_id for r in batch.rows])
        tc = time.perf_counter()
        ctr = counter_format.encode(torch.stack(counters))
        counter_s += time.perf_counter() - tc
        timings = {"total_s": time.perf_counter() - t0, "moe_s": moe_s,
                   "comm_wait_s": stats.wait_s, "counter_s": counter_s,
                   "route_exchange_s": stats.extra.get("route_exchange_s", 0.0),
                   "route_solve_s": stats.extra.get("route_solve_s", 0.0),
                   "dropped": int(stats.extra.get("cap_dropped", 0)),
                   "rerouted": int(stats.extra.get("cap_rerouted", 0)),
                   "expert_cpu_s": expert_cpu}
        return StepResult(sampled, ctr, logits if return_logits else None, warmup, mode, timings,
                          routed if return_routing else None,
                          counted.cpu().numpy() if return_routing else None)

    def _moe(self, ml: int, xn, keys, counted, mode, stats):
        """One MoE layer: route, dispatch/compute/combine, weight, add the shared expert.
        -> (output [T, H], slot loads int64 [S] (reference: [E]), seconds spent on counting,
        logical top-k ids [T, k], thread CPU seconds of the local expert compute)."""
        pre = f"layers.{self._dec(ml)}."
        ids, w = self.routers[ml](xn, keys)
        shared = None
        if self.cfg.model.n_shared_experts:
            def shared():
                return swiglu(xn, self.p[pre + "shared.w13"], self.p[pre + "shared.w2"])
        if self.reference_mode:
            c0 = time.thread_time()
            y = self.logical_layers[ml].forward(xn, ids)
            cpu = time.thread_time() - c0
            tc = time.perf_counter()
            cnt = torch.bincount(ids[counted].reshape(-1), minlength=self.cfg.model.num_experts)
            dt = time.perf_counter() - tc
            extra = shared() if shared else None
        else:
            fm = self.moe_layers[ml]
            fm.compute_cpu_s = 0.0                 # count only this layer's dispatch
            e = self.cfg.eplb
            nxt = (self.routers[ml].next_choice(xn, keys, ids)
                   if e.moe_fallback_routing and e.moe_capacity_mode != "none" else None)
            routed = rdp.route_step(fm, ids, self.ep_group, e, stats, nxt)
            y, cnt, extra = dsp.moe_dispatch(fm, xn, routed.phys, counted, self.ep_group, mode,
                                             stats, overlap=shared, splits=routed.splits,
                                             dropped=e.moe_capacity_mode != "none")
            dt = stats.extra.pop("count_s", 0.0)
            cpu = fm.take_compute_cpu()
        out = (w.unsqueeze(-1) * y).sum(dim=1)
        if extra is not None:
            out = out + extra
        return out, cnt, dt, ids, cpu
