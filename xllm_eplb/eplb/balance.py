"""The one place that computes balancedness and peak/ideal (ARCHITECTURE: decisions taken)."""

from __future__ import annotations

import numpy as np

from xllm_eplb.eplb.placement import replica_counts


def rank_loads_from_phy2log(phy2log: np.ndarray, logical: np.ndarray, ep_size: int) -> np.ndarray:
    """Estimated per-rank load when each expert's load splits evenly over its replicas.

    phy2log: [layers, ep_size*slots] or [ep_size*slots]; logical: [layers, E] or [E].
    Returns float64 [layers, ep_size] (or [ep_size]).
    """
    p = np.atleast_2d(np.asarray(phy2log, dtype=np.int64))
    lg = np.atleast_2d(np.asarray(logical, dtype=np.float64))
    layers, nslots = p.shape
    cnt = replica_counts(p, lg.shape[1]).astype(np.float64)
    per_slot = np.take_along_axis(lg, p, 1) / np.take_along_axis(cnt, p, 1)
    out = per_slot.reshape(layers, ep_size, nslots // ep_size).sum(axis=2)
    return out if np.ndim(phy2log) == 2 else out[0]


def balancedness(rank_loads: np.ndarray) -> np.ndarray:
    """mean rank load / max rank load per layer; rank_loads [..., ep_size]. 1.0 when all zero."""
    r = np.asarray(rank_loads, dtype=np.float64)
    mx = r.max(axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        b = np.where(mx > 0, r.mean(axis=-1) / np.where(mx > 0, mx, 1.0), 1.0)
    return b


def peak_over_ideal(rank_loads: np.ndarray) -> np.ndarray:
    """max rank load / (total / ep_size) per layer; 1.0 when all zero."""
    return 1.0 / balancedness(rank_loads)
