"""DeepSeek EPLB's interface with this project's placement inside.

Drop-in for ``eplb.rebalance_experts`` (deepseek-ai/EPLB) and the copies of it in SGLang and
older vLLM::

    from xllm_eplb.integrations.deepseek import rebalance_experts
    phy2log, log2phy, logcnt = rebalance_experts(weight, num_replicas, num_groups, num_nodes,
                                                 num_gpus)

Same arguments and return values: ``phy2log [L, R]``, ``log2phy [L, E, X]`` (-1-padded,
left-packed, X = the largest replica count), ``logcnt [L, E]``, int64 on the CPU (torch tensors
for a torch ``weight``, numpy arrays otherwise). Differences: the policy (``policy=`` or
``XLLM_EPLB_POLICY``: incremental (default), balanced, greedy, node_aware), the optional
``old_phy2log`` (the deployed ``[L, R]`` map: migration-aware re-planning that keeps retained
experts in their slots), and replicas of one expert share a GPU only where the layout forces it
or, on a small layout, where that lowers the peak (see :mod:`xllm_eplb.integrations.core`).
``num_groups`` / ``num_nodes`` shape the plan only for node_aware (hierarchical under DeepSeek's
rule ``num_groups % num_nodes == 0``); the other policies plan globally. A layout DeepSeek refuses (``num_replicas % num_gpus``, ``num_gpus % num_nodes``,
``R < E``) raises :class:`~xllm_eplb.integrations.core.LayoutError` (an AssertionError, as
DeepSeek's asserts); any other failure logs one line and returns DeepSeek's own algorithm's plan
(:mod:`xllm_eplb.integrations.deepseek_ref`), or raises with ``strict=True`` /
``XLLM_EPLB_STRICT=1``.
"""

from __future__ import annotations

import numpy as np

from xllm_eplb.integrations import deepseek_ref
from xllm_eplb.integrations.core import (
    LayoutError,
    as_loads,
    log,
    plan_physical,
    strict_mode,
    to_numpy,
)
from xllm_eplb.integrations.maps import logical_maps

__all__ = ["rebalance_experts"]


def rebalance_experts(weight, num_replicas: int, num_groups: int, num_nodes: int,
                      num_gpus: int, *, policy: str | None = None, old_phy2log=None,
                      strict: bool | None = None):
    """See the module doc. -> (phy2log, log2phy, logcnt)."""
    w = as_loads(weight)
    if num_nodes < 1 or num_gpus % num_nodes:
        raise LayoutError(f"num_gpus={num_gpus} must be a multiple of num_nodes={num_nodes}")
    try:
        phy2log = plan_physical(w, num_replicas, num_gpus, kind=policy, old=old_phy2log,
                                num_nodes=num_nodes, num_groups=num_groups)
        log2phy, logcnt = logical_maps(phy2log, w.shape[1])
    except (LayoutError, ValueError):
        raise
    except Exception as e:                        # never fail the caller's rebalance loop
        if strict_mode(strict):
            raise
        log.warning("xllm-eplb: policy failed (%s: %s); using DeepSeek's algorithm",
                    type(e).__name__, e)
        phy2log, log2phy, logcnt = deepseek_ref.rebalance_experts(w, num_replicas, num_groups,
                                                                  num_nodes, num_gpus)
    return _like(weight, phy2log), _like(weight, log2phy), _like(weight, logcnt)


def _like(weight, a: np.ndarray):
    """int64 CPU torch tensor when ``weight`` is a torch tensor, else the numpy array."""
    if hasattr(weight, "detach"):
        import torch

        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))
    return np.ascontiguousarray(a, dtype=np.int64)


def plan_numpy(weight, num_replicas, num_groups, num_nodes, num_gpus, **kw):
    """The triple as numpy arrays whatever ``weight`` is (for tests and benchmarks)."""
    return tuple(to_numpy(x) for x in rebalance_experts(to_numpy(weight), num_replicas,
                                                        num_groups, num_nodes, num_gpus, **kw))
