"""SGLang: the ``sglang.srt.plugins`` entry point that puts this project's policy behind
``sglang.srt.eplb.eplb_algorithms.rebalance_experts``.

SGLang's EPLB manager calls ``rebalance_experts(tokens_per_expert [steps, L, E],
num_physical_experts, num_local_physical_experts, num_groups (may be None), num_nodes,
algorithm)`` through the module attribute and uses the returned DeepSeek triple as it is
(``log2phy`` left-packed and consistent with ``phy2log``). ``L`` counts every decoder layer:
dense layers arrive as all-zero rows and get a valid table. The current placement is not passed;
:func:`current_map` reads it from SGLang's ``get_global_expert_location_metadata()`` (None at the
first start), so a re-plan keeps retained experts in their slots.

:func:`register` (only when ``XLLM_EPLB_POLICY`` is set) registers an AROUND hook with SGLang's
``HookRegistry``: it has the original function, so any failure logs one line and returns
SGLang's own algorithm's result. ``--eplb-algorithm`` is then ignored. ``SGLANG_PLUGINS``
filters plugins by entry-point name (``xllm_eplb``).
"""

from __future__ import annotations

import numpy as np

from xllm_eplb.integrations.core import env_kind, log, plan_physical, strict_mode, to_numpy
from xllm_eplb.integrations.maps import logical_maps

TARGET = "sglang.srt.eplb.eplb_algorithms.rebalance_experts"
__all__ = ["TARGET", "current_map", "rebalance_experts", "register"]


def current_map():
    """SGLang's deployed ``physical_to_logical_map_cpu`` [L, P], or None (no server state)."""
    try:
        from sglang.srt.eplb.expert_location import get_global_expert_location_metadata

        md = get_global_expert_location_metadata()
    except Exception:
        return None
    return None if md is None else getattr(md, "physical_to_logical_map_cpu", None)


def rebalance_experts(tokens_per_expert, num_physical_experts: int,
                      num_local_physical_experts: int, num_groups=None, num_nodes: int = 1,
                      algorithm=None, *, old=None, policy: str | None = None):
    """SGLang's signature -> (phy2log [L, P], log2phy [L, E, X], logcnt [L, E]) int64 CPU torch
    tensors. ``algorithm`` is ignored; ``old`` defaults to :func:`current_map`."""
    import torch

    t = to_numpy(tokens_per_expert)
    w = t.sum(axis=0) if t.ndim == 3 else t
    if num_local_physical_experts < 1 or num_physical_experts % num_local_physical_experts:
        from xllm_eplb.integrations.core import LayoutError

        raise LayoutError(f"num_physical_experts={num_physical_experts} must be a multiple of "
                          f"num_local_physical_experts={num_local_physical_experts}")
    gpus = num_physical_experts // num_local_physical_experts
    old = current_map() if old is None else old
    phy2log = plan_physical(w, num_physical_experts, gpus, kind=policy, old=old,
                            num_nodes=num_nodes, num_groups=num_groups)
    log2phy, logcnt = logical_maps(phy2log, w.shape[1])
    return tuple(torch.from_numpy(np.ascontiguousarray(a)) for a in (phy2log, log2phy, logcnt))


def around(original_fn, *args, **kwargs):
    """The AROUND hook: our plan, or SGLang's on any failure (one log line); with
    ``XLLM_EPLB_STRICT=1`` a failure raises."""
    try:
        return rebalance_experts(*args, **kwargs)
    except Exception as e:
        if strict_mode():
            raise
        log.warning("xllm-eplb: %s: %s; using SGLang's EPLB algorithm", type(e).__name__, e)
        return original_fn(*args, **kwargs)


def register() -> None:
    """The ``sglang.srt.plugins`` entry point: hook only when ``XLLM_EPLB_POLICY`` is set."""
    kind = env_kind()
    if kind is None:
        return
    try:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    except Exception as e:
        log.warning("xllm-eplb: SGLang's plugin HookRegistry is not importable (%s); SGLang "
                    "keeps its EPLB algorithm", e)
        return
    HookRegistry.register(TARGET, around, HookType.AROUND)
    log.info("xllm-eplb: SGLang %s -> xllm-eplb %s", TARGET, kind)
