"""Staging buffers for EPLB layer moves, reserved once after the weights load.

One staging tensor per distinct (expert-tensor name, shape, dtype) across the MoE layers, each
shaped like a whole layer's tensor ``[S, ...]``: the largest possible move of one layer (every
slot, redundant slots included) fits, and since only one layer moves at a time, all layers
share them. A layer move then allocates nothing large: receives land in staging slots, sends
read the active slots directly.
"""

from __future__ import annotations

import logging

import torch

from xllm_eplb.obs.logs import event

log = logging.getLogger(__name__)


class StagingBuffers:
    """``get(name, like)`` -> the reserved tensor matching ``like`` ([S, ...], same dtype)."""

    def __init__(self, layers: list, rank: int = 0):
        """layers: objects with ``expert_tensors() -> dict[str, Tensor [S, ...]]``."""
        self._bufs: dict[tuple, torch.Tensor] = {}
        for layer in layers:
            for name, t in layer.expert_tensors().items():
                key = self._key(name, t)
                if key not in self._bufs:
                    # NOTE: written (zeroed) once so the pages are committed now, not mid-move.
                    self._bufs[key] = torch.zeros_like(t, memory_format=torch.contiguous_format)
        self.nbytes = sum(b.numel() * b.element_size() for b in self._bufs.values())
        self.tensors = len(self._bufs)
        if self._bufs:
            log.info(event("EPLB staging reservation warmed", bytes=self.nbytes,
                           tensors=self.tensors, rank=rank, layers=len(layers)))

    @staticmethod
    def _key(name: str, t: torch.Tensor) -> tuple:
        return (name, tuple(t.shape), t.dtype, str(t.device))

    def get(self, name: str, like: torch.Tensor) -> torch.Tensor:
        try:
            return self._bufs[self._key(name, like)]
        except KeyError:
            raise RuntimeError(f"no staging buffer reserved for tensor {name!r} of shape "
                               f"{tuple(like.shape)} {like.dtype}") from None

    def data_ptrs(self) -> dict[tuple, int]:
        """Storage address of every buffer (tests: unchanged across moves)."""
        return {k: b.data_ptr() for k, b in self._bufs.items()}
