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
``eplb_peak_z`` / ``eplb_step_tokens``. :func:`plan_noise_aware` is its fresh plan from xLLM's
initial layout (offline benchmarks).
"""

from __future__ import annotations

import numpy as np

from xllm_eplb.eplb.placement import initial_phy2log
from xllm_eplb.eplb.policy import make_policy


def noise_weights(load: np.ndarray, tokens_per_step: float, z: float) -> np.ndarray:
    """``m + z sqrt(m)`` with ``m`` the expected per-step count of each expert: float64 [..., E].
    ``load`` [..., E] any non-negative scale (only shares matter); ``tokens_per_step`` = routed
    tokens (top-k occurrences) per step over all ranks."""
    w = np.asarray(load, dtype=np.float64)
    tot = w.sum(axis=-1, keepdims=True)
    m = np.where(tot > 0, w / np.where(tot > 0, tot, 1.0), 0.0) * float(tokens_per_step)
    return m + float(z) * np.sqrt(m)


def plan_noise_aware(load: np.ndarray, ep_size: int, redundant: int, tokens_per_rank: float,
                     z: float = 2.0, top_k: int = 1) -> np.ndarray:
    """Slot table int64 [D*S] for one layer's ``load [E]`` (or ``[L, D*S]`` for ``[L, E]``).

    ``tokens_per_rank`` x ``top_k`` x ``ep_size`` is the step's routed token count (pass routed
    occurrences per rank with ``top_k=1``); ``z`` the sigma multiple (0 = plan on the mean)."""
    w = np.atleast_2d(np.asarray(load, dtype=np.float64))
    if w.ndim != 2:
        raise ValueError(f"noise-aware placement: load of shape {np.shape(load)} is not [E] or "
                         f"[layers, E]")
    if tokens_per_rank <= 0 or z < 0:
        raise ValueError(f"noise-aware placement: tokens_per_rank={tokens_per_rank} must be > 0 "
                         f"and z={z} >= 0")
    layers, e = w.shape
    pol = make_policy("incremental", ep_size, e, redundant, peak_z=z,
                      step_tokens=tokens_per_rank * top_k * ep_size)
    table = pol.plan_table(w, np.tile(initial_phy2log(e, ep_size, redundant), (layers, 1)))
    return table if np.ndim(load) == 2 else table[0]
