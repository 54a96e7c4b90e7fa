"""Per-step replica routing in offline replay: a step's counts split over source ranks, then
routed to the replicas by ``eplb/replica_routing.py`` (static / spread / balanced).

Without a routing mode the replay keeps its aggregate model (each expert's step total split
evenly over its replicas, ``sim/workers.slot_counts``). With one, every step needs the routed
counts per source rank, ``[layers, D, E]``: from the trace when it carries ``sources``, else a
seeded multinomial split of each expert's count over the ``D`` ranks (each routed token comes
from a uniformly drawn source rank; :func:`split_sources`).
"""

from __future__ import annotations

import numpy as np

from xllm_eplb.eplb import replica_routing as rr


def split_sources(load: np.ndarray, ep_size: int, rng: np.random.Generator) -> np.ndarray:
    """``load [layers, E]`` int64 -> int64 ``[layers, D, E]`` whose sum over ``D`` is ``load``:
    each count split multinomially, with equal probabilities, over the ``ep_size`` ranks."""
    a = np.asarray(load, dtype=np.int64)
    p = np.full(ep_size, 1.0 / ep_size)
    return np.moveaxis(rng.multinomial(a, p), -1, 1).astype(np.int64)


class Router:
    """Slot loads of one step under ``mode`` for any placement ``[layers, D*S]``; keeps one
    :class:`~xllm_eplb.eplb.replica_routing.RoutingPlan` per (layer, slot table) it has seen
    (placements change rarely; the plan is rebuilt only when a layer's table changes)."""

    def __init__(self, mode: str, num_logical: int, ep_size: int):
        if mode not in rr.MODES:
            raise ValueError(f"replica routing: mode {mode!r} is not one of "
                             f"{', '.join(rr.MODES)}")
        self.mode, self.num_logical, self.ep_size = mode, num_logical, ep_size
        self._plans: dict[tuple[int, bytes], rr.RoutingPlan] = {}

    def plan(self, layer: int, row: np.ndarray) -> rr.RoutingPlan:
        key = (layer, np.asarray(row, dtype=np.int64).tobytes())
        got = self._plans.get(key)
        if got is None:
            if len(self._plans) > 4096:              # bounded: old placements are not reused
                self._plans.clear()
            got = self._plans[key] = rr.prepare(row, self.num_logical, self.ep_size)
        return got

    def slot_counts(self, sources: np.ndarray, placement: np.ndarray) -> np.ndarray:
        """``sources [layers, D, E]`` routed counts per source rank, ``placement [layers,
        D*S]`` -> int64 ``[layers, D*S]`` tokens each slot serves this step."""
        return np.stack([rr.slot_loads(sources[lay], self.plan(lay, placement[lay]), self.mode)
                         for lay in range(placement.shape[0])])
