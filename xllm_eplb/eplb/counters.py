"""The slot-counter wire format: one owner for the prefix sums workers report.

A worker reports, per forward, ``counters [layers, slots_per_rank]`` int64 where row ``l`` is the
prefix sum over its local slots of the tokens each slot served in that forward (the form a
grouped-GEMM group list has). The last column is therefore the rank's token total per layer.
"""

from __future__ import annotations

import numpy as np


def encode(per_slot) -> np.ndarray:
    """Per-slot counts ``[layers, slots]`` (numpy or torch) -> prefix sums int64 ``[layers, slots]``."""
    a = per_slot.cpu().numpy() if hasattr(per_slot, "cpu") else np.asarray(per_slot)
    return np.cumsum(a.astype(np.int64, copy=False), axis=-1)


def decode(prefix: np.ndarray) -> np.ndarray:
    """Prefix sums ``[..., slots]`` -> per-slot counts int64 (same shape)."""
    return np.diff(np.asarray(prefix, dtype=np.int64), axis=-1, prepend=0)


def totals(prefix: np.ndarray) -> np.ndarray:
    """Prefix sums ``[..., slots]`` -> tokens per row ``[...]`` (the last column)."""
    return np.asarray(prefix, dtype=np.int64)[..., -1]
