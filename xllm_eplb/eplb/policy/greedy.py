"""`greedy`: xLLM's historical GreedyEplbPolicy, layer-vectorised.

Replicas: repeatedly the expert with the largest working load ``w`` (ties: lowest id) gets one more
copy and ``w <- trunc(w * c / (c + 1))``. Placement: phase 1 puts the redundant copies (origin id
order), phase 2 every expert by ``w`` descending (ties: id); each item goes to the least-loaded
rank with a free slot (ties: lowest rank), first free slot; a dead end skips the layer.
No slot stabilisation (it churns slots, as in xLLM).

Deviation from xLLM (documented): one replica of an expert per rank is enforced here too, so the
replica count is capped at ``ep_size`` and a rank already holding the expert is not a candidate.
"""

from __future__ import annotations

import numpy as np

from xllm_eplb.eplb.policy.base import EplbPolicy
from xllm_eplb.eplb.policy.packing import pack_sequences


def plan_greedy(loads: np.ndarray, ep_size: int, slots: int):
    """loads [L, E] -> list of [D*S] or None per layer."""
    items, eff, ok = greedy_items(loads, ep_size, slots)
    table, packed = pack_sequences(items, eff, ep_size, slots, np.shape(loads)[1])
    return [table[i] if ok[i] and packed[i] else None for i in range(table.shape[0])]


def greedy_items(loads: np.ndarray, ep_size: int, slots: int):
    """The replicas and the placement order: (items int64 [L, D*S], eff float64 [L, D*S] the
    working load of each item, ok [L] (False where the replica cap was hit))."""
    w = np.asarray(loads, dtype=np.float64).copy()
    layers, num_e = w.shape
    extra = ep_size * slots - num_e
    rows = np.arange(layers)
    copies = np.zeros((layers, num_e), dtype=np.int64)
    ok = np.ones(layers, dtype=bool)
    for _ in range(extra):
        key = np.where(copies + 1 >= ep_size, -np.inf, w)
        m = np.argmax(key, axis=1)
        ok &= np.isfinite(key[rows, m])
        c = 1 + copies[rows, m]
        copies[rows, m] += 1
        w[rows, m] = np.trunc(w[rows, m] * c / (c + 1.0))
    phase1 = np.stack([np.repeat(np.arange(num_e), copies[i]) for i in range(layers)])
    phase2 = np.lexsort((np.broadcast_to(np.arange(num_e), w.shape), -w), axis=1)
    items = np.concatenate([phase1.reshape(layers, extra), phase2], axis=1)
    return items, np.take_along_axis(w, items, 1), ok


class GreedyPolicy(EplbPolicy):
    """Ignores the deployed table (xLLM's greedy policy re-packs every round)."""

    name = "greedy"

    def plan(self, logical, deployed):
        return plan_greedy(logical, self.ep_size, self.slots)
