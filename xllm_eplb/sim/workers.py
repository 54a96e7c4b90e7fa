"""Simulated EP workers for offline replay: the executor's token protocol without weights.

Models what each rank's ``EplbExecutor`` does with an :class:`~xllm_eplb.eplb.info.EplbInfo`:

- a prepare is queued per rank and finishes ``delay`` forwards later (``delay=1``: reported in
  the output of the very forward that carried it); a rank whose delay is ``None`` never
  finishes (a stuck prepare -> the manager times out). Only the latest finished token is held
  and it is reported once (``consume``), as the executor does;
- an activation switches the rank's slot table for the layer *after* the forward (so the
  forward that carried it still ran on the old placement), and its output returns the
  activation token.

Per-slot token counts are produced from a step's logical load ``[layers, experts]``: each
expert's tokens split evenly over its replicas (remainder to the lowest slots), then encoded as
per-rank prefix sums ``[layers, slots]`` exactly like the real worker.
"""

from __future__ import annotations

import numpy as np

from xllm_eplb.eplb import counters as counter_format
from xllm_eplb.eplb.info import NO_LAYER, NO_TOKEN, EplbInfo
from xllm_eplb.eplb.placement import replica_counts


class SimulatedWorkerError(AssertionError):
    """The manager asked for something a real worker would refuse (protocol violation)."""


def slot_counts(logical: np.ndarray, placement: np.ndarray) -> np.ndarray:
    """Token counts per global slot, int64 ``[layers, ranks*slots]``.

    logical ``[layers, experts]`` int64; placement ``[layers, ranks*slots]``. Replicas of an
    expert share its tokens evenly; the first ``load % replicas`` replicas get one more.
    """
    layers, nslots = placement.shape
    num_logical = logical.shape[1]
    rows = np.arange(layers)[:, None]
    flat = placement + rows * num_logical
    cnt = replica_counts(placement, num_logical)
    # rank of each slot among the replicas of its expert (0 for the first occurrence)
    order = np.argsort(flat, axis=1, kind="stable")
    sorted_ids = np.take_along_axis(flat, order, axis=1)
    first = np.zeros_like(sorted_ids, dtype=bool)
    first[:, 0] = True
    first[:, 1:] = sorted_ids[:, 1:] != sorted_ids[:, :-1]
    pos = np.arange(nslots)[None, :].repeat(layers, 0)
    start = np.maximum.accumulate(np.where(first, pos, 0), axis=1)
    rank_in = np.empty_like(order)
    np.put_along_axis(rank_in, order, pos - start, axis=1)
    load = np.take_along_axis(logical, placement, axis=1)
    c = np.take_along_axis(cnt, placement, axis=1)
    return load // c + (rank_in < load % c)


class SimWorkers:
    """``ep_size`` simulated ranks running ``placement [layers, ranks*slots]``.

    ``delays``: per-rank forwards until a prepare finishes (int >= 1, or None = never).
    """

    def __init__(self, placement: np.ndarray, ep_size: int, delays: list[int | None] | int = 1):
        self.placement = np.array(placement, dtype=np.int64, copy=True)
        self.ep_size = ep_size
        self.slots = self.placement.shape[1] // ep_size
        self.delays = [delays] * ep_size if isinstance(delays, int) else list(delays)
        self.step_index = 0
        self._tasks: list[list[tuple[int, int, int, np.ndarray]]] = [[] for _ in range(ep_size)]
        self._ready: list[dict[int, tuple[int, np.ndarray]]] = [{} for _ in range(ep_size)]
        self._report = [NO_TOKEN] * ep_size
        self.activations = 0

    def before_forward(self, info: EplbInfo) -> None:
        """Queue a prepare; check an activation can be honoured (every rank prepared it)."""
        if info.update_layer_id != NO_LAYER:
            for r in range(self.ep_size):
                got = self._ready[r].get(info.activation_token)
                if got is None or got[0] != info.update_layer_id:
                    raise SimulatedWorkerError(
                        f"rank {r}: activation of layer {info.update_layer_id} token "
                        f"{info.activation_token} that this rank never prepared")
        if info.prepare_layer_id != NO_LAYER:
            ids = np.asarray(info.expert_ids, dtype=np.int64)
            if ids.shape != (self.placement.shape[1],) or info.prepare_token <= 0:
                raise SimulatedWorkerError(f"bad prepare: token {info.prepare_token}, "
                                           f"expert_ids shape {ids.shape}")
            for r, d in enumerate(self.delays):
                if d is not None:
                    self._tasks[r].append((self.step_index + d - 1, info.prepare_layer_id,
                                           info.prepare_token, ids))

    def counters(self, logical: np.ndarray, per_slot: np.ndarray | None = None
                 ) -> list[np.ndarray]:
        """This forward's per-rank prefix-sum counters ``[layers, slots]`` for a logical load
        (split evenly over the replicas), or for the given tokens per global slot ``per_slot
        [layers, ranks*slots]`` (replica routing, ``sim/routing.py``)."""
        if per_slot is None:
            per_slot = slot_counts(np.asarray(logical, dtype=np.int64), self.placement)
        pr = counter_format.encode(per_slot.reshape(per_slot.shape[0], self.ep_size, self.slots))
        return [pr[:, r, :] for r in range(self.ep_size)]

    def after_forward(self, info: EplbInfo) -> tuple[list[int], int]:
        """Activate (after the forward), finish due prepares; returns
        ``(prepared_tokens per rank, activation_token)`` for this forward's outputs."""
        if info.update_layer_id != NO_LAYER:
            ids = self._ready[0][info.activation_token][1]
            self.placement[info.update_layer_id] = ids
            self.activations += 1
        tokens = []
        for r in range(self.ep_size):
            due = [t for t in self._tasks[r] if t[0] <= self.step_index]
            self._tasks[r] = [t for t in self._tasks[r] if t[0] > self.step_index]
            for _, layer, token, ids in due:
                self._ready[r][token] = (layer, ids)
                self._report[r] = token                 # only the latest is held
            tokens.append(self._report[r])
            self._report[r] = NO_TOKEN                  # consume: reported once
        self.step_index += 1
        return tokens, int(info.activation_token)
