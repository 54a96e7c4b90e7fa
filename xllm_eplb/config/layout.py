"""The slot arithmetic every layer shares, written once (pure, no imports): how many slots a
rank has, and the N-1 rule of an elastic shrink or rejoin. ``config.rules`` validates flags
with it, ``eplb/placement.py`` and ``eplb/membership_plan.py`` plan with it, ``Config`` derives
``slots_per_rank`` from it."""

from __future__ import annotations


def rank_slots(num_experts: int, ep_size: int, redundant: int) -> int:
    """Slots per rank: ``num_experts // ep_size + redundant`` (the layout rules,
    ``config.layout_rules``, say when it is a valid layout)."""
    return num_experts // ep_size + redundant


def survivors_hold_all(ep_size: int, slots: int, num_experts: int) -> bool:
    """The N-1 rule: ``ep_size - 1`` ranks of ``slots`` slots each can hold every expert,
    ``(ep_size - 1) x slots >= num_experts`` (False for ``ep_size < 2``: nobody survives)."""
    return ep_size >= 2 and (ep_size - 1) * slots >= num_experts


def elastic_redundancy_needed(num_experts: int, ep_size: int) -> int:
    """The smallest ``--redundant_experts_num`` under which ``ep_size``-1 ranks hold every
    expert (the N-1 rule, :func:`survivors_hold_all`)."""
    if ep_size < 2:
        return 0
    return max(0, -(-num_experts // (ep_size - 1)) - num_experts // ep_size)
