"""`EplbInfo`: the control message the engine puts into every forward input (which layer to
prepare with which token and expert ids, which layer to activate; docs/architecture.md)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

NO_LAYER = -1
NO_TOKEN = -1


@dataclass
class EplbInfo:
    """Engine -> workers, once per forward step.

    ``expert_ids`` is the *global* physical slot table of ``prepare_layer_id``
    (``[ep_size * slots_per_rank]`` int64, rank-major), empty when there is no prepare.
    ``activation_token`` equals the prepare token of the attempt that every rank reported ready.
    """

    prepare_layer_id: int = NO_LAYER
    prepare_token: int = NO_TOKEN
    expert_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    update_layer_id: int = NO_LAYER
    activation_token: int = NO_TOKEN

    @property
    def empty(self) -> bool:
        return self.prepare_layer_id == NO_LAYER and self.update_layer_id == NO_LAYER

    def to_dict(self) -> dict:
        return {
            "prepare_layer_id": int(self.prepare_layer_id),
            "prepare_token": int(self.prepare_token),
            "expert_ids": np.ascontiguousarray(self.expert_ids, dtype=np.int64).tobytes(),
            "update_layer_id": int(self.update_layer_id),
            "activation_token": int(self.activation_token),
        }

    @classmethod
    def from_dict(cls, d: dict) -> "EplbInfo":
        return cls(
            prepare_layer_id=int(d["prepare_layer_id"]),
            prepare_token=int(d["prepare_token"]),
            expert_ids=np.frombuffer(d["expert_ids"], dtype=np.int64).copy(),
            update_layer_id=int(d["update_layer_id"]),
            activation_token=int(d["activation_token"]),
        )
