"""Noise-aware placement: plan replica counts and ranks for the per-step peak, not the mean.

A step's count of expert ``e`` is a sample: with ``N`` routed tokens per step (``D x tokens per
rank x top-k``) and share ``q_e`` of the layer's load, it has mean ``m_e = N q_e`` and, close to
Poisson, standard deviation ``sqrt(m_e)``. Under ``balanced`` replica routing
(``eplb/replica_routing.py``) the step's peak is mostly set by the ranks' single-replica experts,
whose noise no routing can move; replicated experts absorb theirs. Planning on
``w_e = m_e + z sqrt(m_e)`` (mean + z sigma) charges every expert for its noise: relative to the
mean, cold and medium experts weigh more and the hottest ones less, so the redundant slots go to
more distinct experts (more of the noisy load becomes movable) and the packing keeps room for the
noise of what stays fixed.

Registered as an option of the ``incremental`` policy: ``make_policy("incremental", ...,
peak_z=z, step_tokens=N)`` plans every layer (fresh or deployed) on ``w``; config:
``eplb_peak_z`` / ``eplb_step_tokens``. This module only computes the weights (it imports no
policy, so ``incremental`` can import it).
"""

from __future__ import annotations

import numpy as np


def noise_weights(load: np.ndarray, tokens_per_step: float, z: float) -> np.ndarray:
    """``m + z sqrt(m)`` with ``m`` the expected per-step count of each expert: float64 [..., E].
    ``load`` [..., E] any non-negative scale (only shares matter); ``tokens_per_step`` = routed
    tokens (top-k occurrences) per step over all ranks."""
    w = np.asarray(load, dtype=np.float64)
    tot = w.sum(axis=-1, keepdims=True)
    m = np.where(tot > 0, w / np.where(tot > 0, tot, 1.0), 0.0) * float(tokens_per_step)
    return m + float(z) * np.sqrt(m)
