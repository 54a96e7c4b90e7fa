"""`EplbAggregator`: per-rank prefix-sum slot counters -> physical and logical load windows.

Each worker reports, per forward, ``counters [layers, slots_per_rank]`` int64 where row ``l`` is
the prefix sum over its local slots of the tokens routed to each slot in that forward (the form a
grouped-GEMM group list has). Differencing along the slot axis recovers per-slot counts.

The window holds two views, both int64 token counts:

- physical ``[layers, ranks, slots]``: measured load of every physical slot;
- logical ``[layers, experts]``: each slot's count added to the logical expert the slot held
  *under the placement that was active when the sample was taken* (replicas sum).

Samples are tagged with the placement generation they were measured under; a sample whose
generation is not the window's current generation is dropped (it was read against another
placement). :meth:`commit` (an activation) zeroes the window and bumps the generation;
:meth:`decay` (after each policy round) halves it, as xLLM does (``int64(x * 0.5)``).
"""

from __future__ import annotations

import logging

import numpy as np

from xllm_eplb.eplb import counters as counter_format
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


def scatter_logical(deltas: np.ndarray, placement: np.ndarray, num_logical: int) -> np.ndarray:
    """Per-slot deltas ``[layers, ranks, slots]`` + ``placement [layers, ranks*slots]`` ->
    logical load int64 ``[layers, experts]`` (replicas of one expert sum)."""
    layers = deltas.shape[0]
    flat = deltas.reshape(layers, -1)
    idx = placement + (np.arange(layers, dtype=np.int64) * num_logical)[:, None]
    # NOTE: bincount works in float64; exact for counts below 2**53 tokens per window.
    out = np.bincount(idx.ravel(), weights=flat.ravel(), minlength=layers * num_logical)
    return np.rint(out).astype(np.int64).reshape(layers, num_logical)


class EplbAggregator:
    """The engine's load window (see module docstring).

    ``physical`` int64 ``[layers, ranks, slots]``, ``logical`` int64 ``[layers, experts]``,
    ``generation`` (placement generation the window belongs to), ``sample_count`` (samples in
    the window since the last commit; decay keeps it).
    """

    def __init__(self, num_layers: int, ep_size: int, slots_per_rank: int, num_logical: int):
        self.num_layers = num_layers
        self.ep_size = ep_size
        self.slots_per_rank = slots_per_rank
        self.num_logical = num_logical
        self.physical = np.zeros((num_layers, ep_size, slots_per_rank), dtype=np.int64)
        self.logical = np.zeros((num_layers, num_logical), dtype=np.int64)
        self.generation = 0
        self.sample_count = 0
        self.dropped_stale = 0

    def decode(self, counters: list[np.ndarray]) -> np.ndarray:
        """Validate and decode one step's counters -> deltas ``[layers, ranks, slots]``."""
        return decode_counters(counters, self.num_layers, self.slots_per_rank, self.ep_size)

    def add(self, deltas: np.ndarray, placement: np.ndarray, generation: int) -> np.ndarray | None:
        """Aggregate one decoded sample measured under ``placement [layers, ranks*slots]``.

        Returns the sample's logical load ``[layers, experts]``, or None when the sample's
        generation is stale (dropped, not aggregated).
        """
        if generation != self.generation:
            self._drop(generation)
            return None
        logical = scatter_logical(deltas, placement, self.num_logical)
        self.accumulate(deltas, logical, generation)
        return logical

    def accumulate(self, deltas: np.ndarray, logical: np.ndarray, generation: int) -> bool:
        """Add an already scattered sample (``deltas [L, D, S]``, ``logical [L, E]``); False
        (dropped) when its generation is stale. Lets callers do the heavy part unlocked."""
        if generation != self.generation:
            self._drop(generation)
            return False
        self.physical += deltas
        self.logical += logical
        self.sample_count += 1
        return True

    def _drop(self, generation: int) -> None:
        self.dropped_stale += 1
        log.debug(event("EPLB stale load sample dropped", sample_generation=generation,
                        window_generation=self.generation))

    def commit(self) -> int:
        """An activation was committed: zero the window, start a new generation; returns it."""
        self.physical[...] = 0
        self.logical[...] = 0
        self.sample_count = 0
        self.generation += 1
        return self.generation

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
    logical += scatter_logical(deltas, np.asarray(placement, dtype=np.int64), num_logical)
    if physical is not None:
        physical += deltas
