"""Placement policies and their factory.

``make_policy(kind, ep_size, num_logical, redundant, **opts)``: ``kind`` is case-insensitive;
xLLM's legacy names map to ``balanced``; an unknown kind logs ONE warning and falls back to
``greedy`` (xLLM rule: never crash the rebalance loop). An option the chosen policy does not take
is a :class:`~xllm_eplb.errors.ConfigError` naming it and the known ones.
"""

from __future__ import annotations

from xllm_eplb.config import POLICY_KINDS, EplbConfig, normalize_policy_kind
from xllm_eplb.eplb.policy.base import EplbPolicy
from xllm_eplb.errors import ConfigError

__all__ = ["EplbPolicy", "make_policy", "normalize_kind", "policy_from_config", "POLICY_KINDS"]


def normalize_kind(kind: str | None) -> str:
    """Canonical policy kind (the one rule lives in ``xllm_eplb.config.normalize_policy_kind``:
    case-insensitive, legacy names -> balanced, unknown -> greedy with one warning)."""
    return normalize_policy_kind("" if kind is None else kind)


def policy_class(kind: str) -> type[EplbPolicy]:
    """The class for a canonical ``kind`` (imported on demand)."""
    if kind == "balanced":
        from xllm_eplb.eplb.policy.balanced import BalancedPolicy as cls
    elif kind == "incremental":
        from xllm_eplb.eplb.policy.incremental import IncrementalPolicy as cls
    elif kind == "node_aware":
        from xllm_eplb.eplb.policy.node_aware import NodeAwarePolicy as cls
    else:
        from xllm_eplb.eplb.policy.greedy import GreedyPolicy as cls
    return cls


def make_policy(kind: str, ep_size: int, num_logical: int, redundant: int,
                **opts) -> EplbPolicy:
    """Build the policy for ``kind`` (see module doc) with its tuning options ``opts``.

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
    - ``peak_z`` + ``step_tokens``: noise-aware placement (``policy/noise_aware.py``): plan on
      each expert's expected per-step count + ``peak_z`` standard deviations, with
      ``step_tokens`` routed tokens per forward step over all ranks (``peak_z`` 0 = off;
      ``peak_z`` > 0 needs ``step_tokens`` > 0);
    - ``cold_slack``: a deployed layer whose peak exceeds ``(1 + cold_slack) x`` its lower bound
      is planned like a fresh layer from that table (a host engine's strict initial layout;
      0 = off, the default; the integrations use 0.25);
    - also ``move_cost``, ``target_slack``, ``must_slack``, ``count_slack``, ``max_iters``
      (see ``IncrementalPolicy``).

    node_aware (``NodeAwarePolicy``): ``num_nodes`` (ranks split evenly into nodes, default 1)
    and ``num_groups`` (expert groups placed node-locally, 0 = one group per expert).
    balanced and greedy take no options.
    """
    k = normalize_kind(kind)
    cls = policy_class(k)
    known = cls.option_names()
    unknown = sorted(set(opts) - set(known))
    if unknown:
        names = ", ".join(repr(u) for u in unknown)
        rule = f"known: {', '.join(known)}" if known else "it takes no options"
        raise ConfigError(f"{k} policy: unknown option{'s' * (len(unknown) > 1)} {names} "
                          f"({rule})")
    return cls(ep_size, num_logical, redundant, **opts)


def policy_from_config(cfg: EplbConfig, num_logical: int,
                       slots: int | None = None) -> EplbPolicy:
    """The policy ``cfg.eplb_policy_kind`` names, with the config options that kind takes
    (incremental: ``eplb_migration_budget_slots``, ``eplb_peak_z``, ``eplb_step_tokens``;
    node_aware: ``eplb_num_nodes``). ``slots``: plan ``ep_size x slots`` as given, a layout the
    flag rules cannot express (an elastic shrink's ``E % (N-1) != 0``; ``EplbPolicy``)."""
    k = normalize_kind(cfg.eplb_policy_kind)
    opts = {"incremental": dict(budget_slots=int(cfg.eplb_migration_budget_slots),
                                peak_z=float(cfg.eplb_peak_z),
                                step_tokens=float(cfg.eplb_step_tokens)),
            "node_aware": dict(num_nodes=int(cfg.eplb_num_nodes))}.get(k, {})
    if slots is None:
        return make_policy(k, int(cfg.ep_size), num_logical, int(cfg.redundant_experts_num),
                           **opts)
    return policy_class(k)(int(cfg.ep_size), num_logical, int(cfg.redundant_experts_num),
                           int(slots), **opts)
