"""Model EPLB hooks: prepare, transfer and activate a new placement of one MoE layer in place.

Per rank, per layer move (the order of xLLM's DeepSeek V4 path; the old weights and tables
serve until step 3):

1. ``prepare_expert_weight(layer, expert_ids)`` — background thread, host-only: the pending
   local slot table, pending ``log2phy``, changed slots, local sources and the P2P plan.
2. ``start_expert_weight_transfer(layer)`` — main thread, before the forward: post the layer's
   batched send/recv plan, then fill staging from resident sources (``materialize_expert_weight``).
3. ``update_expert_weight(layer)`` — main thread, after the forward: wait for P2P, copy staging
   into the active tensors (per changed slot when fewer than ceil(S/2) slots changed, one
   whole-tensor copy otherwise), switch ``log2phy``, ``local_expert_ids`` and the host mirror.
   Active tensors are never replaced (stable addresses); the canary checks every slot's tag.

The forward between 2 and 3 still runs on the old weights and tables.

What moves is exactly ``expert_tensors()`` of the layer, whatever the storage format (dense
weights, or FP8 bytes + their block scales), plus the slot's tag and checksum: per transfer one
message per tensor (paired, in one global order; fp8 travels as its uint8 bytes). Step 3 waits
for every message of the layer before it copies anything, so a slot is activated only when its
weights *and* scales have both arrived; derived state (the FP8 resident dequantized cache) is
recomputed from them (``refresh_slots``) before the tables switch.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from xllm_eplb.eplb import placement
from xllm_eplb.obs.logs import event
from xllm_eplb.worker.p2p import (
    BatchedTransfer,
    P2PPlan,
    plan_messages,
    plan_p2p,
    warmup_group,
)
from xllm_eplb.worker.staging import StagingBuffers

log = logging.getLogger(__name__)


class EplbCanaryError(RuntimeError):
    """A slot holds weights of another expert/layer than its table says (a migration bug)."""


@dataclass
class MoveStats:
    """The numbers of one layer's move on one rank (``update_expert_weight``'s result, also its
    ``update_expert_weight`` log line). Times in ms, sizes in slots, operations and bytes."""

    layer: int
    rank: int
    dispatch_mode: str
    tensor_count: int
    changed_slots: int
    activation_mode: str            # "full" (one whole-tensor copy) or "slots"
    recv_slots: int
    send_slots: int
    p2p_operations: int
    p2p_bytes: int
    materialize_ms: float
    post_ms: float
    transfer_ms: float              # waiting for the P2P transfer to finish
    activation_ms: float
    total_ms: float
    # --- multi-node (#14) ---
    cross_node_bytes: int = 0       # received from ranks on other nodes (0 on one node)
    # --- quantized slots (#24) ---
    slot_bytes: int = 0             # one slot's moved bytes: every expert tensor (fp8 scales too)


@dataclass
class PendingLayer:
    """A prepared, not yet activated move of one layer on this rank."""

    new_global: np.ndarray          # int64 [D*S]
    plan: P2PPlan
    full: bool                      # whole-tensor activation (changed >= ceil(S/2))
    log2phy: torch.Tensor           # int64 [E], the routing map after activation
    started: bool = False
    materialize_ms: float = 0.0     # staging filled from resident slots
    post_ms: float = 0.0            # the P2P plan posted

    def start(self) -> None:
        """Its transfer begins (``start_expert_weight_transfer``; a prepare may no longer
        replace it)."""
        self.started = True

    def staged(self, post_ms: float, materialize_ms: float) -> None:
        """Its transfer is posted and staging filled, after these milliseconds each."""
        self.post_ms, self.materialize_ms = post_ms, materialize_ms


def full_activation(changed: int, slots_per_rank: int) -> bool:
    """xLLM's rule: one whole-tensor copy when changed >= ceil(S/2), else per-slot copies."""
    return changed >= (slots_per_rank + 1) // 2


class ModelEplbHooks:
    """EPLB hooks over the FusedMoE layers of one rank (``model.moe_layers``, indexed by the
    MoE-local layer id). ``eplb_group``: the dedicated EPLB process group (ranks = EP ranks).

    ``canary``: check tags after every activation (None -> ``cfg.eplb.eplb_canary``; tests pass
    True). ``warmup``: one 1-element send/recv with every peer now (collective: all ranks).
    """

    def __init__(self, model, eplb_group, cfg, *, canary: bool | None = None,
                 warmup: bool = True):
        self.layers = list(model.moe_layers)
        if not self.layers:
            raise ValueError("ModelEplbHooks: the model has no MoE layers")
        first = self.layers[0]
        self.rank = int(first.ep_rank)
        self.ep_size = int(first.ep_size)
        self.slots_per_rank = int(first.slots_per_rank)
        self.num_logical = int(first.num_logical)
        self.group = eplb_group
        self.canary = bool(cfg.eplb.eplb_canary if canary is None else canary)
        #: EP ranks per node: a transfer whose source is on another node crosses nodes
        self.ranks_per_node = self.ep_size // max(1, int(cfg.runtime.nnodes))
        mode = getattr(model, "dispatch_mode", None)   # activations run at decode boundaries
        self.dispatch_mode = str(mode(True)) if callable(mode) else "plain"
        self._names = {i: sorted(layer.expert_tensors()) for i, layer in enumerate(self.layers)}
        self.staging = StagingBuffers(self.layers, self.rank)
        self.transfer = BatchedTransfer(eplb_group, cfg.eplb.eplb_p2p_chunk_bytes,
                                        cfg.eplb.eplb_p2p_max_inflight_bytes)
        self._lock = threading.Lock()
        self._pending: dict[int, PendingLayer] = {}
        self._ok: dict[int, bool] = {}
        self._errors: dict[int, str] = {}
        #: P2P plan buckets summed over successful prepares (global counts, as every rank sees)
        self.bucket_totals = {"unchanged": 0, "same_rank": 0, "cross_rank": 0}
        self._peer_global = self._peer_map(eplb_group)
        if warmup and self.ep_size > 1:
            warmup_group(eplb_group, self.rank, self._peer_global,
                         device=first.local_expert_ids.device)

    def _peer_map(self, group) -> list[int]:
        """EPLB-group rank -> global rank (torch's isend/irecv address peers globally)."""
        if group is None or group == dist.GroupMember.WORLD:
            return list(range(self.ep_size))
        return [dist.get_global_rank(group, r) for r in range(self.ep_size)]

    def _layer(self, layer: int):
        if not 0 <= layer < len(self.layers):
            raise ValueError(f"EPLB layer_id={layer} outside [0, {len(self.layers)})")
        return self.layers[layer]

    # ---- 1. prepare (background thread, host-only) ------------------------------------------
    def prepare_expert_weight(self, layer: int, expert_ids) -> bool:
        """Build the pending state of ``layer`` for global table ``expert_ids`` [D*S].
        Returns (and records for :meth:`last_prepare_ok`) success; failures are logged."""
        t0 = time.perf_counter()
        try:
            pending = self._build_pending(layer, np.asarray(expert_ids, dtype=np.int64))
        except Exception as exc:  # noqa: BLE001 - any failure means "not ready"
            return self._fail(layer, f"{type(exc).__name__}: {exc}")
        p = pending.plan
        with self._lock:
            started = self._is_started(layer)
            if not started:
                self._pending[layer] = pending
                self._ok[layer] = True
                self.bucket_totals["unchanged"] += p.unchanged
                self.bucket_totals["same_rank"] += p.same_rank
                self.bucket_totals["cross_rank"] += p.cross_rank
        if started:
            return self._fail(layer, f"layer {layer} started a transfer during the prepare")
        log.debug(event("prepare_expert_weight plan", layer=layer, rank=self.rank,
                        changed_slots=len(p.changed), recv_slots=len(p.recv),
                        send_slots=len(p.send), unchanged=p.unchanged, same_rank=p.same_rank,
                        cross_rank=p.cross_rank,
                        duration_ms=(time.perf_counter() - t0) * 1e3))
        return True

    def _fail(self, layer: int, error: str) -> bool:
        """Record a failed prepare (the executor logs it, with the token, as ERROR)."""
        with self._lock:
            if not self._is_started(layer):
                self._pending.pop(layer, None)
            self._ok[layer] = False
            self._errors[layer] = error
        log.debug(event("prepare_expert_weight rejected", layer=layer, rank=self.rank,
                        error=error))
        return False

    def last_prepare_error(self, layer: int) -> str:
        """Why the latest prepare of ``layer`` failed ("" if it succeeded)."""
        with self._lock:
            return "" if self._ok.get(layer, False) else self._errors.get(layer, "not prepared")

    def _is_started(self, layer: int) -> bool:
        p = self._pending.get(layer)
        return p is not None and p.started

    def _build_pending(self, layer: int, new: np.ndarray) -> PendingLayer:
        moe = self._layer(layer)
        want = self.ep_size * self.slots_per_rank
        if new.shape != (want,):
            raise ValueError(f"expert_ids has shape {new.shape}, expected ({want},) = "
                             f"ep_size*slots_per_rank")
        with self._lock:
            if self._is_started(layer):
                raise RuntimeError(f"layer {layer} has a transfer in flight")
        placement.validate_phy2log(new, self.num_logical, self.ep_size,
                                   what=f"layer {layer} pending placement",
                                   allow_rank_duplicates=True)
        old = np.array(moe.global_phy2log, dtype=np.int64, copy=True)
        plan = plan_p2p(old, new, self.rank, self.slots_per_rank)
        l2p = placement.build_log2phy(new, self.num_logical, self.rank)
        return PendingLayer(new_global=new.copy(), plan=plan,
                            full=full_activation(len(plan.changed), self.slots_per_rank),
                            log2phy=torch.as_tensor(l2p, dtype=torch.int64))

    def last_prepare_ok(self, layer: int) -> bool:
        with self._lock:
            return self._ok.get(layer, False)

    # ---- 2. start transfer (main thread, before the forward) ---------------------------------
    def start_expert_weight_transfer(self, layer: int) -> None:
        """Post the layer's P2P plan and fill staging from resident slots (every rank calls
        this at the same step, even with nothing to send)."""
        moe = self._layer(layer)
        with self._lock:
            pending = self._pending.get(layer)
            if pending is None or not self._ok.get(layer, False):
                raise RuntimeError(f"start_expert_weight_transfer: layer {layer} is not prepared")
            if pending.started:
                raise RuntimeError(f"start_expert_weight_transfer: layer {layer} already started")
            pending.start()
        t0 = time.perf_counter()
        plan = pending.plan
        tensors = moe.expert_tensors()
        names = self._names[layer]
        # NOTE: post first: receives land in slots with no local source, so the local copies
        # below touch other staging slots and overlap with the transfer.
        staging = {n: self.staging.get(n, tensors[n]) for n in names}
        self.transfer.start(plan_messages(plan, {n: tensors[n] for n in names}, staging,
                                          self._peer_global))
        t1 = time.perf_counter()
        slots = range(self.slots_per_rank) if pending.full else plan.changed.tolist()
        for name in names:
            active, stage = tensors[name], self.staging.get(name, tensors[name])
            for d in slots:
                src = int(plan.local_sources[d])
                if src >= 0:
                    stage[d].copy_(active[src])
        pending.staged((t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3)
        log.info(event("materialize_expert_weight", layer=layer, rank=self.rank,
                        mode="full" if pending.full else "slots",
                        duration_ms=pending.materialize_ms))

    # ---- 3. update (main thread, after the forward) ------------------------------------------
    def update_expert_weight(self, layer: int) -> MoveStats:
        """Wait for P2P, activate in place, switch the tables; returns the move's numbers."""
        moe = self._layer(layer)
        with self._lock:
            pending = self._pending.get(layer)
        if pending is None or not pending.started:
            raise RuntimeError(f"update_expert_weight: layer {layer} has no started transfer")
        wait_s = self.transfer.wait()
        ops, nbytes = self.transfer.last_ops, self.transfer.last_bytes     # this move's
        t0 = time.perf_counter()
        plan = pending.plan
        tensors = moe.expert_tensors()
        for name in self._names[layer]:
            active, stage = tensors[name], self.staging.get(name, tensors[name])
            if pending.full:
                active.copy_(stage)
            else:
                for s in plan.changed.tolist():
                    active[s].copy_(stage[s])
        # every tensor of every changed slot has arrived: now derived state (the FP8
        # dequantized cache) follows, then the tables switch
        refresh = getattr(moe, "refresh_slots", None)
        if refresh is not None:
            refresh(plan.changed.tolist())
        self._switch_tables(moe, pending)
        activation_ms = (time.perf_counter() - t0) * 1e3
        if self.canary:
            self.check_canary(layer)
        with self._lock:
            self._pending.pop(layer, None)
        stats = MoveStats(layer=layer, rank=self.rank, dispatch_mode=self.dispatch_mode,
                          tensor_count=len(self._names[layer]), changed_slots=len(plan.changed),
                          activation_mode="full" if pending.full else "slots",
                          recv_slots=len(plan.recv), send_slots=len(plan.send),
                          p2p_operations=ops, p2p_bytes=nbytes,
                          materialize_ms=pending.materialize_ms, post_ms=pending.post_ms,
                          transfer_ms=wait_s * 1e3, activation_ms=activation_ms,
                          total_ms=pending.materialize_ms + pending.post_ms + wait_s * 1e3
                          + activation_ms, cross_node_bytes=self._cross_node_bytes(plan, tensors,
                                                                                   layer),
                          slot_bytes=self._slot_bytes(tensors, layer))
        log.info(event("update_expert_weight", **dataclasses.asdict(stats)))
        return stats

    def _slot_bytes(self, tensors: dict, layer: int) -> int:
        """Bytes of one slot of every expert tensor (weights, scales, tag, checksum)."""
        return sum(tensors[n][0].numel() * tensors[n][0].element_size()
                   for n in self._names[layer])

    def _cross_node_bytes(self, plan, tensors: dict, layer: int) -> int:
        """Bytes this rank received from ranks on other nodes in ``plan`` (one slot of every
        expert tensor per received transfer)."""
        slot_bytes = self._slot_bytes(tensors, layer)
        k = self.ranks_per_node
        return slot_bytes * sum(1 for t in plan.recv if t.src_rank // k != self.rank // k)

    def _switch_tables(self, moe, pending: PendingLayer) -> None:
        """Routing map, local ids and host mirror, all in place."""
        moe.log2phy.copy_(pending.log2phy)
        moe.local_expert_ids.copy_(torch.as_tensor(pending.plan.new_local))
        moe.global_phy2log[:] = pending.new_global

    def check_canary(self, layer: int) -> None:
        """Raise :class:`EplbCanaryError` unless every local slot's tag is (id, layer) and its
        weights match the checksum taken when they were loaded (it moves with them)."""
        moe = self._layer(layer)
        want = torch.stack([moe.local_expert_ids,
                            torch.full_like(moe.local_expert_ids, moe.layer_id)], dim=1)
        bad = torch.nonzero((moe.tag != want).any(dim=1)).flatten().tolist()
        if bad:
            s = bad[0]
            raise EplbCanaryError(
                f"EPLB canary: layer {layer} rank {self.rank} slot {s} holds tag "
                f"{moe.tag[s].tolist()}, expected [{int(moe.local_expert_ids[s])}, "
                f"{moe.layer_id}] ({len(bad)} bad slots)")
        check = getattr(moe, "check_checksums", None)
        bad = check() if check is not None else []
        if bad:
            raise EplbCanaryError(
                f"EPLB canary: layer {layer} rank {self.rank} slot {bad[0]} holds weights whose "
                f"checksum differs from the one taken at load for expert "
                f"{int(moe.local_expert_ids[bad[0]])} ({len(bad)} bad slots)")
