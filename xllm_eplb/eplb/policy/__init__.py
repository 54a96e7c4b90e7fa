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
    """Build the policy for ``kind`` (see module doc). Options a policy does not use are ignored.

    incremental (``IncrementalPolicy``):

    - ``budget_slots``: moved slots per round over all layers (0 = auto, cost-based);
    - ``budget_bytes`` + ``slot_bytes``: the same budget in bytes (wins when both are set);
    - ``trigger_slack``: a deployed layer is re-planned only when its peak exceeds
      ``(1 + trigger) x`` its lower bound (in [0, 1), default 0.02);
    - ``settle_slack``: ...and then fixed only down to ``(1 + settle) x`` the bound
      (``<= trigger_slack``, default 0.009);
    - ``noise_z``: sampling-noise floor of both slacks, ``noise_z / sqrt(ideal rank load)``
      (0 = no floor, default 2.5);
    - ``rewrite_moves``: single-slot replica rewrites besides swaps (None = automatic, only on
      deployed layers where one replica exceeds the target);
    - also ``move_cost``, ``target_slack``, ``must_slack``, ``count_slack``, ``max_iters``
      (see ``IncrementalPolicy``).

    node_aware (``NodeAwarePolicy``): ``num_nodes`` (ranks split evenly into nodes, default 1)
    and ``num_groups`` (expert groups placed node-locally, 0 = one group per expert).
    """
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
