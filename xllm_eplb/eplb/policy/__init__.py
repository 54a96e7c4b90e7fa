"""Placement policies and their factory.

``make_policy(kind, ep_size, num_logical, redundant, min_improvement, **opts)``: ``kind`` is
case-insensitive; xLLM's legacy names map to ``balanced``; an unknown kind logs ONE warning and
falls back to ``greedy`` (xLLM rule: never crash the rebalance loop).
"""

from __future__ import annotations

from xllm_eplb.config import POLICY_KINDS, normalize_policy_kind
from xllm_eplb.eplb.policy.base import EplbPolicyBase, IEplbPolicy

__all__ = ["IEplbPolicy", "EplbPolicyBase", "make_policy", "normalize_kind", "POLICY_KINDS"]


def normalize_kind(kind: str | None) -> str:
    """Canonical policy kind (the one rule lives in ``xllm_eplb.config.normalize_policy_kind``:
    case-insensitive, legacy names -> balanced, unknown -> greedy with one warning)."""
    return normalize_policy_kind("" if kind is None else kind)


def make_policy(kind: str, ep_size: int, num_logical: int, redundant: int,
                min_improvement: float = 0.05, **opts) -> IEplbPolicy:
    """Build the policy for ``kind`` (see module doc). Options: incremental takes
    ``budget_slots`` (cross-rank copies per round over all layers, 0 = auto), ``budget_bytes`` +
    ``slot_bytes``, ``move_cost``, ``target_slack``; node_aware takes ``num_nodes`` and
    ``num_groups``. Options a policy does not use are ignored."""
    k = normalize_kind(kind)
    if k == "balanced":
        from xllm_eplb.eplb.policy.balanced import BalancedPolicy as cls
    elif k == "incremental":
        from xllm_eplb.eplb.policy.incremental import IncrementalPolicy as cls
    elif k == "node_aware":
        from xllm_eplb.eplb.policy.node_aware import NodeAwarePolicy as cls
    else:
        from xllm_eplb.eplb.policy.greedy import GreedyPolicy as cls
    return cls(ep_size, num_logical, redundant, min_improvement, **opts)
