"""``Decoder``: one EP rank's model of a Hugging Face MoE checkpoint (``cfg.model.model``).

One code path for every family of :mod:`spec`: embeddings -> per layer (RMSNorm, GQA or MLA
attention over the rank's preallocated KV cache, RMSNorm, dense SwiGLU or MoE) -> RMSNorm ->
LM head. Attention is data-parallel (each rank attends over its own requests, all at once);
routed experts are sharded over the EP group as :class:`FusedMoE` slots, filled from the
checkpoint for this rank's physical slots only; shared experts run locally.

The worker-facing API: ``forward_step(batch, *, warmup, pure_decode, return_logits,
return_routing) -> StepResult`` with per-layer slot counters (prefix sums,
``eplb.counters.encode``) that exclude graph-mode padding / filler rows and, with
``eplb_use_decode_only_load``, prefill rows. ``Decoder.reference(cfg)`` is the single-process
model (every logical expert local, no dispatch; counters per logical expert). Without
``--model`` the checkpoint is the one :mod:`default_checkpoint` generated from the config.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from xllm_eplb import kernels
from xllm_eplb.config import Config
from xllm_eplb.eplb import counters as ctr
from xllm_eplb.eplb.placement import initial_phy2log
from xllm_eplb.eplb.placement_file import initial_placement
from xllm_eplb.model import blocks, dense, expert_act
from xllm_eplb.model import dispatch as dsp
from xllm_eplb.model import replica_dispatch as rdp
from xllm_eplb.model.attention import KVCache
from xllm_eplb.model.batch import RankBatch
from xllm_eplb.model.expert_store import DequantScratch
from xllm_eplb.model.loader import (
    CheckpointReader,
    check_experts,
    expert_weights,
    experts_fp8,
    torch_dtype,
)
from xllm_eplb.model.moe import FusedMoE, LogicalMoE
from xllm_eplb.model.params import load_params
from xllm_eplb.model.resolve import resolve_config
from xllm_eplb.model.routing import FamilyRouter, load_trace, trace_probs
from xllm_eplb.model.spec import parse_spec
from xllm_eplb.model.step import Laps, StepResult, sample, token_logprobs
from xllm_eplb.model.step_inputs import step_inputs
from xllm_eplb.model.validate import validate_model_config, validate_phy2log
from xllm_eplb.obs import step_timer
from xllm_eplb.obs.logs import event

log = logging.getLogger(__name__)


class Decoder:
    """One EP rank's model of the checkpoint ``cfg.model.model``. ``phy2log``: int64
    [L_moe, D*S] initial placement (default: xLLM's initial layout).

    ``timer`` (:class:`~xllm_eplb.obs.step_timer.StepTimer`, default the no-op ``NULL``; the
    worker gives its own to :meth:`time_phases`): each ``forward_step`` adds its seconds by
    phase: ``attention`` (input norms, attention, residual), ``router``, ``experts`` (routed
    expert GEMMs and shared experts), ``dispatch`` (replica routing, dispatch / all-to-all /
    combine, counting, the weighted sum), ``sampling`` (token choice, log-probabilities),
    ``other`` (inputs, embedding, dense MLPs, final norm, LM head, counters)."""

    timer: step_timer.StepTimer = step_timer.NULL

    def __init__(self, cfg: Config, ep_rank: int, ep_group=None, phy2log: np.ndarray | None = None,
                 *, device: str | torch.device | None = None, _reference: bool = False,
                 _joining: bool = False):
        self.spec = spec = parse_spec(cfg.model.model)
        cfg = resolve_config(cfg, spec)
        validate_model_config(cfg)
        self.cfg, self.ep_rank, self.ep_group = cfg, int(ep_rank), ep_group
        #: the node's shared-memory all-to-all (``--ep_transport=shm``; the worker's
        #: :meth:`attach_transport`; None: dispatch on ``ep_group``)
        self.ep_a2a = None
        self.reference_mode = _reference
        self._joining = _joining      # an elastic joiner: loads before its group exists
        self.device = torch.device(device or ("cpu" if cfg.runtime.device == "cpu"
                                              else cfg.runtime.device))
        self.dtype = torch_dtype(cfg)
        #: dense products on the fused kernels' linear (``model.dense``; experts: per layer)
        self.fused_dense = dense.resolve(cfg.model.moe_kernel, self.dtype, self.device)
        self.reader = CheckpointReader(cfg.model.model, spec.quant)
        check_experts(spec, self.reader)
        #: the routed experts' FP8 format (slots hold fp8 bytes + scales), None = dense
        self.expert_quant = spec.quant if experts_fp8(spec, self.reader) else None
        #: the experts' FFN variant (gpt_oss: biases + clamped SwiGLU; PLAIN for the others)
        self.expert_act = expert_act.from_spec(spec)
        self.top, self.layers = load_params(spec, self.reader, self.dtype, self.device)
        self.num_layers, self.num_moe_layers = spec.num_layers, len(spec.moe_layers)
        self.moe_index = {i: ml for ml, i in enumerate(spec.moe_layers)}
        self.rotary = blocks.Rotary(spec, blocks.rope_dim(spec))
        self.attn = blocks.attention_fn(spec)
        m = cfg.model
        probs = (trace_probs(load_trace(m.routing_trace), self.num_moe_layers, m.num_experts)
                 if m.routing_mode == "trace" else None)
        self.routers = [FamilyRouter(cfg, spec, ml, self.layers[i]["gate"],
                                     self.layers[i].get("gate_bias"),
                                     None if probs is None else probs[ml])
                        for ml, i in enumerate(spec.moe_layers)]
        self.moe_layers: list[FusedMoE] = []
        self.logical_layers: list[LogicalMoE] = []
        if _reference:
            self.logical_layers = [LogicalMoE(cfg, ml, self.device, source=self._source,
                                              quant=self.expert_quant, act=self.expert_act,
                                              mxfp4_experts=spec.mxfp4)
                                   for ml in range(self.num_moe_layers)]
        else:
            self.moe_layers = self._sharded(cfg, phy2log)
            log.info(event("expert slots", rank=self.ep_rank, layers=len(self.moe_layers),
                           slots=cfg.slots_per_rank, **self.expert_memory(),
                           kernel=self.kernel_name()))
        kvh, kd, vd = blocks.kv_dims(spec)
        self.kv = KVCache(spec.num_layers, kvh, kd, vd, m.max_position_embeddings, self.dtype,
                          self.device, slots=min(cfg.runtime.max_batch_size, 16))  # grows
        self.fused_failure = dsp.fused_precondition_failure(
            cfg.runtime.device, m.dtype, cfg.runtime.enable_graph, True)
        self._fallback_logged = False
        e = cfg.eplb
        if e.moe_capacity_mode != "none" and self.ep_rank == 0 and not _reference:
            log.warning("MoE capacity mode=%s factor=%g fallback_routing=%s outputs_exact=false "
                        "(rows over capacity are %s)", e.moe_capacity_mode,
                        e.moe_capacity_factor, str(e.moe_fallback_routing).lower(),
                        "re-routed or dropped" if e.moe_fallback_routing else "dropped")

    def kernel_name(self) -> str:
        """What runs the matrix products: ``fused:<isa>`` (the C++ kernels) or ``torch``."""
        isas = kernels.isas()
        return f"fused:{isas[0]}" if self.fused_dense and isas else "torch"

    def expert_memory(self) -> dict:
        """This rank's expert slot storage summed over its MoE layers: ``format`` and
        ``bytes`` (FP8: ``fp8_bytes``, ``scale_bytes``, ``dequant`` mode, ``cache_bytes``)."""
        out: dict = {}
        for m in self.moe_layers:
            for k, v in m.store.describe().items():
                out[k] = out.get(k, 0) + v if isinstance(v, int) else v
        return out

    @classmethod
    def reference(cls, cfg: Config, device: str | None = None) -> "Decoder":
        """Single-process reference model (every logical expert local, no dispatch)."""
        return cls(cfg, 0, None, None, device=device, _reference=True)

    def _source(self, ml: int, e: int, out: dict | None = None) -> dict:
        """Logical expert e of MoE layer ml, read from the checkpoint (positioned reads, on
        demand), into ``out`` (the slot's tensors) when given."""
        return expert_weights(self.spec, self.reader, self.spec.moe_layers[ml], e, self.dtype,
                              out)

    def _sharded(self, cfg: Config, phy2log) -> list[FusedMoE]:
        import torch.distributed as dist

        if phy2log is None:
            base = initial_phy2log(cfg.model.num_experts, cfg.eplb.ep_size,
                                   cfg.eplb.redundant_experts_num)
            phy2log = np.tile(base, (self.num_moe_layers, 1))
        phy2log = validate_phy2log(cfg, phy2log)
        if not dist.is_initialized() and not self._joining:
            raise RuntimeError("a sharded Decoder needs an initialised EP process group "
                               "(worker.comm.init_groups); for one process use "
                               "Decoder.reference(cfg)")
        scratch = DequantScratch()        # FP8 per-step buffers, shared by the layers
        return [FusedMoE(cfg, ml, self.ep_rank, phy2log[ml], self.device, source=self._source,
                         quant=self.expert_quant, scratch=scratch, act=self.expert_act,
                         mxfp4_experts=self.spec.mxfp4)
                for ml in range(self.num_moe_layers)]

    # ---- per-request state and dispatch path -------------------------------------------------
    @property
    def slots_per_rank(self) -> int:
        return self.cfg.slots_per_rank

    # ---- an elastic membership change (``worker/membership.py``) -----------------------------
    def reshard(self, ep_rank: int, ep_size: int, table: np.ndarray) -> dict:
        """Become compact rank ``ep_rank`` of ``ep_size`` ranks with the deployed ``table``
        ``[L, ep_size*S]`` (a shrink's survivor, a joiner); returns ``{"checkpoint": slots
        read, "kept": slots kept, "seconds": ...}``.

        Each slot keeps its local id and weights (``eplb/membership_plan.py``); only a slot
        whose logical expert changed is read from the checkpoint, through the layer's own expert
        source (dense or FP8, the same bytes and checksum as at load). Every size-derived part of
        each layer follows (``FusedMoE.reshard``: ``ep_rank``, ``ep_size``, ``global_phy2log``,
        ``log2phy``, the replica-routing plan); dispatch reads ``ep_size`` / ``ep_rank`` from the
        layer every step. The caller replaces the process groups and the EPLB executor and runs
        :meth:`canary`."""
        t0 = time.perf_counter()
        t = np.asarray(table, dtype=np.int64)
        S = self.cfg.slots_per_rank
        if t.shape != (len(self.moe_layers), ep_size * S):
            raise ValueError(f"reshard: table of shape {t.shape}, expected "
                             f"[layers, ep_size*slots]={(len(self.moe_layers), ep_size * S)}")
        read = sum(fm.reshard(ep_rank, ep_size, t[ml]) for ml, fm in enumerate(self.moe_layers))
        self.ep_rank = int(ep_rank)
        return {"checkpoint": read, "kept": len(self.moe_layers) * S - read,
                "seconds": time.perf_counter() - t0}

    def canary(self) -> str | None:
        """The transfer canary over every MoE layer: None when every slot's tag (expert, layer)
        and weight checksum (taken at load) are right, else what is wrong. Each layer's table
        covers every expert (``activate_table`` refuses one with an expert missing)."""
        for fm in self.moe_layers:
            bad = fm.check_tags()
            if bad:
                return (f"EPLB canary: layer {fm.layer_id} slot {bad[0]} holds tag "
                        f"{fm.tag[bad[0]].tolist()}, expected expert "
                        f"{int(fm.local_expert_ids[bad[0]])}")
            bad = fm.check_checksums()
            if bad:
                return (f"EPLB canary: layer {fm.layer_id} slot {bad[0]}: weights differ from "
                        f"the checksum of expert {int(fm.local_expert_ids[bad[0]])}")
        return None

    def time_phases(self, timer: step_timer.StepTimer) -> None:
        """Each ``forward_step`` from now on adds its seconds by phase to ``timer``
        (``step_timer.NULL``: to none)."""
        self.timer = timer

    # ---- communication: the EP group and the dispatch transport of the generation ----------
    def attach_transport(self, a2a) -> None:
        """Dispatch through ``a2a`` from now on (the node's ``ipc.alltoall.ShmAllToAll`` of
        ``worker.transport.open_ep_transport``; None: on ``ep_group``)."""
        self.ep_a2a = a2a

    def detach_transport(self):
        """Stop dispatching through the shared-memory all-to-all -> it (None if there was
        none), for the caller to close; the dispatch runs on ``ep_group`` until the next
        :meth:`attach_transport`."""
        a2a, self.ep_a2a = self.ep_a2a, None
        return a2a

    def join_group(self, ep_group) -> None:
        """Serve on ``ep_group`` from now on (an elastic regroup's new generation)."""
        self.ep_group = ep_group

    def leave_group(self) -> None:
        """Hold no EP group (a failed elastic step: the group's sockets close only once
        nothing holds it); the next :meth:`join_group` gives it one again."""
        self.ep_group = None

    def release(self, req_ids) -> None:
        """Free the KV cache of finished requests."""
        for r in req_ids:
            self.kv.release(int(r))

    def truncate(self, cuts) -> None:
        """Cut requests' KV caches back: ``cuts`` = ``[[req_id, length], ...]``
        (``RankBatch.truncate``, elastic recovery)."""
        for r, n in cuts:
            self.kv.truncate(int(r), int(n))

    def dispatch_mode(self, pure_decode: bool) -> str:
        """The dispatch path of this step; a requested fused path that cannot run here is
        logged once and falls back to plain."""
        e = self.cfg.eplb
        mode, why = dsp.resolve_dispatch_mode(e.expert_parallel_degree, e.enable_fused_mc2,
                                              pure_decode=pure_decode,
                                              precondition_failure=self.fused_failure)
        if why and not self._fallback_logged:
            self._fallback_logged = True
            log.warning("EPLB dispatch fallback requested=fused used=plain reason=%s",
                        why.replace(" ", "_"))
        return mode

    # ---- forward ---------------------------------------------------------------------------
    def forward_step(self, batch: RankBatch, *, warmup: bool = False,
                     pure_decode: bool | None = None, return_logits: bool = False,
                     return_routing: bool = False, peer_rows: list[int] | None = None
                     ) -> StepResult:
        """Run one step of this rank's rows (see the module docstring). A warm-up forward
        keeps no KV cache and is flagged in the result. Phases go to ``self.timer``.
        ``peer_rows``: every EP rank's dispatched rows of this step
        (``step_inputs.dispatched_rows`` of the step's batches; every rank passes them or none
        does): the dispatch then skips its split-size exchange (``dispatch.padded_bounds``)."""
        t0 = time.perf_counter()
        dense.use_fused(self.fused_dense)
        lap = Laps(self.timer)
        self.release(batch.release)
        self.truncate(batch.truncate)
        mode = dsp.PLAIN if self.reference_mode else self.dispatch_mode(bool(pure_decode))
        si = step_inputs(self.cfg, self.kv, batch, self.device)
        n_real, spec = si.n_real, self.spec
        h = self.top["embed"][si.toks]
        cs = self.rotary.tables(si.pos[:n_real], self.dtype)
        stats = dsp.CommStats()
        moe_s, counter_s, counts, routed, expert_cpu = 0.0, 0.0, [], [], []
        moe_cpu = 0.0
        lap("other")
        for i, p in enumerate(self.layers):
            x = blocks.rms_norm(h, p["in_norm"], spec.rms_norm_eps, spec.norm_weight_first)
            if n_real:
                a = self.attn(spec, p, x[:n_real], cs, self.kv, si.ab, i)
                h = torch.cat([h[:n_real] + a, h[n_real:]]) if h.shape[0] > n_real else h + a
            x = blocks.rms_norm(h, p["post_norm"], spec.rms_norm_eps, spec.norm_weight_first)
            lap("attention")
            if i not in self.moe_index:
                h = h + blocks.mlp(x, p["mlp_w13"], p["mlp_w2"])
                lap("other")
                continue
            tm, tc = time.perf_counter(), time.thread_time()
            y, cnt, dt_cnt, ids, cpu = self._moe(self.moe_index[i], p, x, si, mode, stats, lap,
                                                 peer_rows)
            moe_cpu += time.thread_time() - tc
            if return_routing:
                routed.append(ids.cpu().numpy())
            moe_s += time.perf_counter() - tm
            counter_s += dt_cnt
            expert_cpu.append(cpu)
            counts.append(cnt)
            h = h + y
            lap("dispatch")
        self.kv.advance([r.req_id for r in batch.rows],
                        [r.start_pos + len(r.token_ids) for r in batch.rows])
        last = [s + n - 1 for s, n in si.spans]
        hn = blocks.rms_norm(h[last], self.top["norm"], spec.rms_norm_eps,
                             spec.norm_weight_first)
        logits = dense.linear(hn, self.top["lm_head"]).to(torch.float64).cpu()
        lap("other")
        sampled = {r.req_id: sample(logits[j], r.temperature, r.seed, r.start_pos + len(r.token_ids),
                                    r.top_p, r.top_k)
                   for j, r in enumerate(batch.rows)}
        lps = {r.req_id: token_logprobs(logits[j], sampled[r.req_id], r.logprobs)
               for j, r in enumerate(batch.rows) if r.logprobs >= 0}
        lap("sampling")
        if warmup:
            self.release([r.req_id for r in batch.rows])
        tc = time.perf_counter()
        prefix = ctr.encode(torch.stack(counts))
        counter_s += time.perf_counter() - tc
        timings = {"total_s": time.perf_counter() - t0, "moe_s": moe_s,
                   "comm_wait_s": stats.wait_s, "counter_s": counter_s,
                   "route_exchange_s": stats.extra.get("route_exchange_s", 0.0),
                   "route_solve_s": stats.extra.get("route_solve_s", 0.0), "moe_cpu_s": moe_cpu,
                   "dropped": int(stats.extra.get("cap_dropped", 0)),
                   "rerouted": int(stats.extra.get("cap_rerouted", 0)),
                   "a2a_rounds": int(stats.extra.get("a2a_rounds", 0)),
                   "expert_cpu_s": expert_cpu}
        lap("other")
        return StepResult(sampled, prefix, logits if return_logits else None, warmup, mode,
                          timings, routed if return_routing else None,
                          si.counted.cpu().numpy() if return_routing else None, lps)

    def _shared(self, p: dict, x: torch.Tensor, spent: list[float]):
        """The shared expert as a callable (run inside the dispatch, overlapped in the fused
        path), adding its seconds to ``spent[0]``; None without one."""
        if "shared_w13" not in p:
            return None

        def shared():
            t = time.perf_counter()
            y = blocks.mlp(x, p["shared_w13"], p["shared_w2"])
            if "shared_gate" in p:
                y = torch.sigmoid(dense.linear(x, p["shared_gate"])) * y
            spent[0] += time.perf_counter() - t
            return y
        return shared

    def _moe(self, ml: int, p: dict, x, si, mode, stats, lap: Laps, peer_rows=None):
        """One MoE layer: route, dispatch/compute/combine, weight, add the shared expert.
        -> (output [T, H], slot loads int64 [S] (reference: [E]), seconds spent counting,
        logical top-k ids [T, k], thread CPU seconds of the local expert compute)."""
        ids, w = self.routers[ml](x, si.keys)
        lap("router")
        spent = [0.0]
        shared = self._shared(p, x, spent)
        if self.reference_mode:
            c0 = time.thread_time()
            y = self.logical_layers[ml].forward(x, ids)
            cpu = time.thread_time() - c0
            extra = shared() if shared else None
            lap("experts")
            tc = time.perf_counter()
            cnt = torch.bincount(ids[si.counted].reshape(-1),
                                 minlength=self.cfg.model.num_experts)
            dt = time.perf_counter() - tc
        else:
            fm = self.moe_layers[ml]
            fm.reset_compute_clock()
            e = self.cfg.eplb
            nxt = (self.routers[ml].next_choice(x, si.keys, ids)
                   if e.moe_fallback_routing and e.moe_capacity_mode != "none" else None)
            routed = rdp.route_step(fm, ids, self.ep_group, e, stats, nxt)
            y, cnt, extra = dsp.moe_dispatch(fm, x, routed.phys, si.counted, self.ep_group,
                                             mode, stats, overlap=shared, splits=routed.splits,
                                             dropped=e.moe_capacity_mode != "none",
                                             peer_rows=peer_rows, a2a=self.ep_a2a)
            lap("dispatch", inner="experts", inner_s=fm.compute_s + spent[0])
            dt = stats.extra.pop("count_s", 0.0)
            cpu = fm.take_compute_cpu()
        out = (w.unsqueeze(-1) * y).sum(dim=1)
        if extra is not None:
            out = out + extra
        return out, cnt, dt, ids, cpu


def build_model(cfg: Config, ep_rank: int, ep_group=None, *, device=None,
                phy2log: np.ndarray | None = None, joining: bool = False) -> Decoder:
    """The worker's model: a :class:`Decoder` of ``cfg.model.model`` (the launcher has filled
    it with the generated default checkpoint when ``--model`` was empty), starting from
    ``initial_placement(cfg)`` (``--eplb_init_placement`` or xLLM's layout) and loading only this
    rank's slots of it. ``joining``: an elastic joiner builds before its process group exists
    (``WorkerMembership.start_joiner`` -> ``Worker.load_alone``; the group is set at its
    regroup)."""
    if not cfg.model.model:
        raise ValueError("build_model: cfg.model.model is empty; the launcher resolves it "
                         "with model.default_checkpoint.with_default_checkpoint first")
    if phy2log is None:       # an elastic replacement passes the deployed table instead
        phy2log = initial_placement(resolve_config(cfg))
    return Decoder(cfg, ep_rank, ep_group, phy2log, device=device, _joining=joining)
