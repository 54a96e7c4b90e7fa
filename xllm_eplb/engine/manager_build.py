"""The engine's EPLB manager: the one at start, and the one rebuilt when the membership changes
size (``Engine.resize``: an elastic shrink or grow)."""

from __future__ import annotations

import dataclasses
import logging

from xllm_eplb.config import Config, layout_error
from xllm_eplb.errors import ConfigError
from xllm_eplb.obs.logs import event

log = logging.getLogger(__name__)


def make_manager(cfg: Config, placement):
    """The manager of ``cfg`` on the deployed ``placement`` (None with EPLB off)."""
    if not cfg.eplb.enable_eplb:
        return None
    from xllm_eplb.eplb.manager import EplbManager

    return EplbManager(cfg.eplb, cfg.num_moe_layers, cfg.model.num_experts, runner="thread",
                       initial=placement, expect_timings=True)


def resized_manager(cfg: Config, ep_size: int, table, old, metrics):
    """The manager of a world of ``ep_size`` ranks with ``table`` deployed (``old`` closed, its
    counters inherited; None when EPLB is off). ``num_experts`` need not divide by the ranks:
    the manager then takes the slots per rank as given and the policy plans that layout
    (``EplbPolicy(..., slots)``); a policy that cannot leaves the ranks serving the table
    without rebalancing (logged)."""
    if old is not None:
        old.close()
    if not cfg.eplb.enable_eplb:
        return None
    from xllm_eplb.eplb.manager import EplbManager

    E, S, D = cfg.model.num_experts, cfg.slots_per_rank, ep_size
    e = dataclasses.replace(cfg.eplb, ep_size=D, redundant_experts_num=max(0, S - E // D))
    try:
        planner = planner_for(e, E, S) if layout_error(E, D, S - E // D) else None
        mgr = EplbManager(e, cfg.num_moe_layers, E, runner="thread", initial=table,
                          expect_timings=True, slots=S, planner=planner)
    except (ConfigError, ValueError) as err:
        log.warning(event("EPLB elastic rebalancing off", ep_size=D, slots_per_rank=S,
                          num_experts=E, why=str(err)))
        metrics.enabled.set(0)
        return None
    if old is not None:
        mgr.inherit_counters(old)
    metrics.enabled.set(1)
    return mgr


def planner_for(e, num_experts: int, slots: int):
    """``--eplb_policy_kind`` with its options for ``e.ep_size`` ranks of ``slots`` slots, a
    layout the flag rules cannot express (E % ep_size != 0)."""
    from xllm_eplb.eplb.gate import Planner
    from xllm_eplb.eplb.policy import policy_from_config

    policy = policy_from_config(e, num_experts, slots=slots)
    return Planner(policy, e.eplb_min_peak_load_improvement, e.eplb_plan_on)
