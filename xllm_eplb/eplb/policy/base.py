"""`EplbPolicy`: a placement policy is a pure function of (logical load, deployed placement).

A policy holds its sizes and its own tuning options only: no placement, no round state. What is
deployed and what is in flight belong to the manager; which candidates are published is the
gate's decision (:mod:`xllm_eplb.eplb.gate`).
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod

import numpy as np

from xllm_eplb.eplb.placement import (
    PlacementError,
    check_slot_layout,
    initial_phy2log_any,
    slots_per_rank,
)
from xllm_eplb.errors import ConfigError


class EplbPolicy(ABC):
    """Sizes: ``D`` = ``ep_size`` ranks, ``S`` = ``slots`` per rank, ``E`` = ``num_logical``
    experts; tables are rank-major ``[L, D*S]`` int64. Subclasses take their tuning options as
    keyword-only ``__init__`` arguments (the factory checks option names against them).

    ``slots`` (positional, after ``redundant``): plan any layout with ``D * slots >= E`` and
    ``slots <= E`` (an expert count the ranks do not divide; the integrations' case), bypassing
    the engine's layout rules; ``redundant`` is then informational only."""

    name: str = "abstract"

    def __init__(self, ep_size: int, num_logical: int, redundant: int,
                 slots: int | None = None):
        if slots is None:                  # the engine's layout rules (config.layout_rules)
            try:
                self.slots = slots_per_rank(num_logical, ep_size, redundant)
            except PlacementError as e:
                raise ConfigError(str(e)) from None
            if self.slots > num_logical:
                raise ConfigError(f"redundant_experts_num={redundant}: {self.slots} slots per "
                                  f"rank exceed the {num_logical} experts (one replica of an "
                                  f"expert per rank)")
        else:                              # any layout (the integrations): D*S >= E, S <= E
            self.slots = int(slots)
            try:                           # the placement toolkit's rule for any layout
                check_slot_layout(num_logical, ep_size * self.slots, ep_size)
            except PlacementError as e:
                raise ConfigError(f"layout ep_size={ep_size} x slots={slots}: {e}") from None
            if not 1 <= self.slots <= num_logical:
                raise ConfigError(f"layout ep_size={ep_size} x slots={slots}: needs 1 <= slots "
                                  f"<= num_experts={num_logical} (one replica of an expert per "
                                  f"rank)")
        self.ep_size, self.num_logical, self.redundant = ep_size, num_logical, redundant
        self.num_slots = ep_size * self.slots

    def initial_row(self) -> np.ndarray:
        """The table a layer with nothing deployed (``-1`` row) starts from, int64 [D*S]:
        xLLM's initial layout under the engine's rules, else every expert once in contiguous
        blocks (``initial_phy2log_any``)."""
        return initial_phy2log_any(self.num_logical, self.ep_size, self.slots)

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        """The tuning options this policy accepts (its keyword-only ``__init__`` arguments)."""
        params = inspect.signature(cls.__init__).parameters.values()
        return tuple(p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY)

    @abstractmethod
    def plan(self, logical: np.ndarray, deployed: np.ndarray) -> list[np.ndarray | None]:
        """logical [L, E] (int counts or a float estimate), deployed int64 [L, D*S] (``-1``
        rows: nothing deployed) -> per layer a candidate int64 [D*S], or None to keep the
        deployed row. Must not modify its inputs."""

    def plan_table(self, logical: np.ndarray, deployed: np.ndarray) -> np.ndarray:
        """:meth:`plan` as a whole table: int64 [L, D*S], the deployed row where it keeps one
        (no gate; for offline planning and benchmarks)."""
        rows = self.plan(logical, deployed)
        return np.stack([np.asarray(deployed[lay] if r is None else r, dtype=np.int64)
                         for lay, r in enumerate(rows)])
