"""Which kernels run the model's matrix products, and the dense ones (``linear``).

``--moe_kernel=fused`` (default): the routed experts run the fused C++ op of
:mod:`xllm_eplb.kernels` (one call per MoE layer) and every dense product (attention
projections, dense and shared MLPs, router gate, LM head) its batch-invariant ``linear``, when
the library is built and the model's dtype and device are ones it computes (float32, bfloat16
on the CPU); otherwise, and with ``--moe_kernel=torch``, torch's own ops (the reference path:
``F.linear``, ``bmm``). :func:`resolve` decides once per model and logs one line when a fused
request falls back, with the reason.

NOTE: the dense choice is per process (:func:`use_fused`), set by the :class:`Decoder` at the
start of each step, so the attention and MLP blocks keep their signatures; one process runs one
rank's model at a time.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from xllm_eplb import kernels
from xllm_eplb.obs.logs import event

log = logging.getLogger(__name__)

_fused = False
_logged: set[str] = set()


def resolve(requested: str, dtype: torch.dtype, device: torch.device | str) -> bool:
    """True when ``requested`` ('fused' or 'torch') runs the fused kernels for this dtype and
    device; a fused request that cannot logs why (once per reason and process)."""
    if requested == "torch":
        return False
    why = kernels.supports(dtype, device)
    if why and why not in _logged:
        _logged.add(why)
        log.info(event("moe kernel", requested=requested, using="torch", reason=why))
    return not why


def use_fused(on: bool) -> None:
    """Run this process's dense products with the fused kernels' ``linear`` (or not)."""
    global _fused
    _fused = bool(on)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` [..., K] @ ``w`` [O, K]^T (+ ``b``): the fused kernels' linear when selected and
    the dtypes allow it, else ``F.linear``."""
    if _fused and x.dtype == w.dtype and x.dtype in kernels.DTYPES and x.device.type == "cpu":
        return kernels.linear(x, w, b)
    return F.linear(x, w, b)
