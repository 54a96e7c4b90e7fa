"""`node_aware`: hierarchical placement for multi-node EP domains (off by default).

DeepSeek-EPLB-style, per layer:
1. pack expert *groups* onto nodes (LPT, equal number of groups per node), so every replica of an
   expert lives on one node and cross-node weight traffic stays inside it;
2. inside each node, give its redundant slots to the experts with the largest per-replica load
   (at most one replica per GPU);
3. pack each node's replicas onto its GPUs (LPT, one replica of an expert per GPU), then swap
   local search restricted to GPUs of the same node, then slot stabilisation.

NOTE: with ``num_groups`` contiguous groups this reproduces DeepSeek's topology, but on real
DeepSeek loads the load of an expert trends with its id, so contiguous groups are a trap; the
default ``num_groups = num_logical`` (one expert per group) lets step 1 balance experts freely.
``hierarchical`` stays a legacy alias of ``balanced`` (xLLM config), hence the distinct name.
"""

from __future__ import annotations

import numpy as np

from xllm_eplb.eplb.placement import replica_counts
from xllm_eplb.eplb.policy.base import EplbPolicy
from xllm_eplb.eplb.policy.localsearch import swap_search
from xllm_eplb.eplb.policy.packing import (
    cyclic_fallback,
    pack_sequences,
    select_replicas_max_load,
    stabilize_slots,
)
from xllm_eplb.errors import ConfigError


def check_topology(num_logical: int, ep_size: int, slots: int, num_nodes: int,
                   num_groups: int) -> None:
    rules = [
        (num_nodes >= 1 and ep_size % num_nodes == 0, f"eplb_num_nodes={num_nodes} must divide "
         f"ep_size={ep_size}"),
        (num_groups >= 1 and num_logical % num_groups == 0, f"num_groups={num_groups} must "
         f"divide num_experts={num_logical}"),
        (num_groups % num_nodes == 0, f"num_groups={num_groups} must be a multiple of "
         f"eplb_num_nodes={num_nodes}"),
        ((ep_size // max(num_nodes, 1)) * slots >= num_logical // max(num_nodes, 1),
         "each node needs at least as many slots as experts"),
        (slots <= num_logical // max(num_nodes, 1), f"{slots} slots per GPU need as many "
         f"distinct experts per node, a node has {num_logical // max(num_nodes, 1)}"),
    ]
    for ok, msg in rules:
        if not ok:
            raise ConfigError(f"node_aware policy: {msg}")


def plan_node_aware(loads, ep_size: int, slots: int, num_nodes: int, num_groups: int,
                    prev=None, max_iters: int = 2000):
    """loads [L, E] -> int64 [L, D*S] (rank-major; node n owns ranks n*D/N .. (n+1)*D/N-1).

    Does not need E divisible by D (DeepSeek's README example has 12 experts on 8 GPUs x 2)."""
    w = np.asarray(loads, dtype=np.float64)
    layers, num_e = w.shape
    check_topology(num_e, ep_size, slots, num_nodes, num_groups)
    gsize, gpn = num_e // num_groups, ep_size // num_nodes           # experts/group, GPUs/node
    per_node_groups = num_groups // num_nodes
    gload = w.reshape(layers, num_groups, gsize).sum(axis=2)
    order = np.lexsort((np.broadcast_to(np.arange(num_groups), gload.shape), -gload), axis=1)
    gtab, _ = pack_sequences(order, np.take_along_axis(gload, order, 1), num_nodes,
                             per_node_groups, num_groups)            # [L, N * groups/node]
    gtab = np.sort(gtab.reshape(layers, num_nodes, per_node_groups), axis=2)
    experts = (gtab[..., None] * gsize + np.arange(gsize)).reshape(layers * num_nodes, -1)
    wl = np.take_along_axis(np.repeat(w, num_nodes, axis=0), experts, 1)   # [L*N, E/N]
    e_loc = experts.shape[1]
    cnt = select_replicas_max_load(wl, gpn * slots - e_loc, gpn)
    items = np.stack([np.repeat(np.arange(e_loc), c) for c in cnt])
    per = np.take_along_axis(wl, items, 1) / np.take_along_axis(cnt, items, 1)
    srt = np.argsort(-per, axis=1, kind="stable")
    items = np.take_along_axis(items, srt, 1)
    local, ok = pack_sequences(items, np.take_along_axis(per, srt, 1), gpn, slots, e_loc)
    for i in np.nonzero(~ok)[0]:
        fb = cyclic_fallback(wl[i], cnt[i], gpn, slots)
        if fb is None:   # cannot happen when check_topology holds; keep the table well-formed
            raise ValueError(f"node_aware: no placement for node subproblem {i}")
        local[i] = fb
    table = np.take_along_axis(experts, local, 1).reshape(layers, ep_size, slots)
    counts = replica_counts(table.reshape(table.shape[0], -1), num_e)
    groups = np.arange(ep_size) // gpn
    ideal = w.sum(axis=1) / ep_size
    swap_search(table, w, counts, ideal * (1 + 1e-9), np.zeros(layers), max_iters,
                groups=groups)
    out = table.reshape(layers, -1)
    if prev is not None:
        out = stabilize_slots(out, np.asarray(prev, dtype=np.int64), ep_size)
    return out


class NodeAwarePolicy(EplbPolicy):
    """Options: ``num_nodes`` (ranks split evenly into nodes), ``num_groups`` (expert groups
    placed node-locally, 0 = one group per expert)."""

    name = "node_aware"

    def __init__(self, ep_size, num_logical, redundant, slots=None, *, num_nodes: int = 1,
                 num_groups: int = 0):
        super().__init__(ep_size, num_logical, redundant, slots)
        self.num_nodes = int(num_nodes)
        self.num_groups = int(num_groups) or num_logical
        check_topology(num_logical, ep_size, self.slots, self.num_nodes, self.num_groups)

    def plan(self, logical, deployed):
        out = plan_node_aware(logical, self.ep_size, self.slots, self.num_nodes,
                              self.num_groups, deployed)
        return list(out)
