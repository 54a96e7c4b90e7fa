"""`EplbAggregator`: per-rank prefix-sum slot counters -> physical and logical load windows.

Each worker reports, per forward, ``counters [layers, slots_per_rank]`` int64 where row ``l`` is
the prefix sum over its local slots of the tokens routed to each slot in that forward (the form a
grouped-GEMM group list has). Differencing along the slot axis recovers per-slot counts.

The window holds two views, both int64 token counts:

- physical ``[layers, ranks, slots]``: measured load of every physical slot;
- logical ``[layers, experts]``: each slot's count added to the logical expert the slot held
  *under the placement that was active when the sample was taken* (replicas sum).

Samples are tagged with the placement epoch they were measured under; a sample whose epoch is
not the window's current epoch is dropped (it was read against another placement).
:meth:`commit` (an activation) zeroes the window and bumps the epoch;
:meth:`decay` (after each policy round) halves it, as xLLM does (``int64(x * 0.5)``).
"""

from __future__ import annotations

import logging

import numpy as np

from xllm_eplb.eplb import counters as counter_format
from xllm_eplb.eplb.placement import logical_loads
from xllm_eplb.obs.logs import event

log = logging.getLogger(__name__)

#: xLLM's ``kLoadDecay``: the window is multiplied by this after every completed policy round
ROUND_DECAY = 0.5


class CounterShapeError(ValueError):
    """A worker output whose counters cannot be decoded (wrong shape, count or dtype)."""


def decode_counters(counters: list[np.ndarray], num_layers: int, slots_per_rank: int,
                    ep_size: int) -> np.ndarray:
    """Prefix sums -> per-slot deltas.

    counters: ``ep_size`` arrays of ``[layers, slots_per_rank]`` integers (rank order).
    Returns int64 ``[layers, ranks, slots]``. Raises :class:`CounterShapeError` naming the rank,
    the shape and the expected shape; negative deltas (a prefix sum that decreases) are rejected
    too, they cannot be token counts.
    """
    if len(counters) != ep_size:
        raise CounterShapeError(f"got counters from {len(counters)} ranks, expected "
                                f"ep_size={ep_size}")
    want = (num_layers, slots_per_rank)
    for r, c in enumerate(counters):
        shape = getattr(c, "shape", None)
        if shape != want:
            raise CounterShapeError(f"rank {r}: counters of shape {shape}, expected "
                                    f"[layers, slots]={want}")
        if c.dtype.kind not in "iu":
            raise CounterShapeError(f"rank {r}: counters of dtype {c.dtype}, expected integers")
    stacked = np.stack(counters, axis=1).astype(np.int64, copy=False)   # [L, D, S]
    deltas = counter_format.decode(stacked)
    if deltas.min(initial=0) < 0:
        lay, rank, slot = np.unravel_index(int(np.argmin(deltas)), deltas.shape)
        raise CounterShapeError(f"rank {rank} layer {lay}: prefix sum decreases at slot {slot} "
                                f"(counters must be non-decreasing along the slot axis)")
    return deltas


class EplbAggregator:
    """The engine's load window (see module docstring).

    ``physical`` int64 ``[layers, ranks, slots]``, ``logical`` int64 ``[layers, experts]``,
    ``placement_epoch`` (the placement epoch the window belongs to: +1 per commit),
    ``sample_count`` (samples in the window since the last commit; decay keeps it).
    """

    def __init__(self, num_layers: int, ep_size: int, slots_per_rank: int, num_logical: int):
        self.num_layers = num_layers
        self.ep_size = ep_size
        self.slots_per_rank = slots_per_rank
        self.num_logical = num_logical
        self.physical = np.zeros((num_layers, ep_size, slots_per_rank), dtype=np.int64)
        self.logical = np.zeros((num_layers, num_logical), dtype=np.int64)
        self.placement_epoch = 0
        self.sample_count = 0
        self.dropped_stale = 0

    def decode(self, counters: list[np.ndarray]) -> np.ndarray:
        """Validate and decode one step's counters -> deltas ``[layers, ranks, slots]``."""
        return decode_counters(counters, self.num_layers, self.slots_per_rank, self.ep_size)

    def add(self, deltas: np.ndarray, placement: np.ndarray, epoch: int) -> np.ndarray | None:
        """Aggregate one decoded sample measured under ``placement [layers, ranks*slots]``.

        Returns the sample's logical load ``[layers, experts]``, or None when the sample's
        epoch is stale (dropped, not aggregated).
        """
        if epoch != self.placement_epoch:
            self._drop(epoch)
            return None
        logical = logical_loads(deltas, placement, self.num_logical)
        self.accumulate(deltas, logical, epoch)
        return logical

    def accumulate(self, deltas: np.ndarray, logical: np.ndarray, epoch: int) -> bool:
        """Add an already scattered sample (``deltas [L, D, S]``, ``logical [L, E]``); False
        (dropped) when its epoch is stale. Lets callers do the heavy part unlocked."""
        if epoch != self.placement_epoch:
            self._drop(epoch)
            return False
        self.physical += deltas
        self.logical += logical
        self.sample_count += 1
        return True

    def _drop(self, epoch: int) -> None:
        self.dropped_stale += 1
        log.debug(event("EPLB stale load sample dropped", sample_epoch=epoch,
                        window_epoch=self.placement_epoch))

    def commit(self) -> int:
        """An activation was committed: zero the window, start a new placement epoch; returns it."""
        self.physical[...] = 0
        self.logical[...] = 0
        self.sample_count = 0
        self.placement_epoch += 1
        return self.placement_epoch

    def decay(self, factor: float = ROUND_DECAY) -> None:
        """After a policy round: ``x = int64(x * factor)`` on both views (truncation, as xLLM)."""
        self.physical = (self.physical * factor).astype(np.int64)
        self.logical = (self.logical * factor).astype(np.int64)

    @property
    def empty(self) -> bool:
        """True when the window holds no measurement (the policy must not run on it)."""
        return self.sample_count == 0


def aggregate(logical: np.ndarray, physical: np.ndarray | None, placement: np.ndarray,
              counters: list[np.ndarray]) -> None:
    """Stateless form (xLLM's ``EplbAggregator::aggregate``): add one step's counters, in place.

    logical ``[layers, experts]``; physical ``[layers, ranks, slots]`` or None;
    placement ``[layers, ranks*slots]``; counters: one ``[layers, slots]`` per rank.
    """
    layers, num_logical = logical.shape
    ep_size = len(counters)
    slots = placement.shape[1] // ep_size
    deltas = decode_counters(counters, layers, slots, ep_size)
    logical += logical_loads(deltas, np.asarray(placement, dtype=np.int64), num_logical)
    if physical is not None:
        physical += deltas
