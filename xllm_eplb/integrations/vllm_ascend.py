"""vllm-ascend (legacy dynamic-EPLB path): ``XllmAscendPolicy``, its ``EplbPolicy`` interface.

``rebalance_experts(current_expert_table [L, D, S], expert_workload)`` -> ``(change, priority,
new_table [L, D, S])``: the workload is per slot, ``[L, D, S]`` (an expert's load is the sum over
its slots) or, from FlashLB's slot (policy type 3), a window ``[T, L, D, S]`` (summed over the
steps); ``change`` is 1 when any layer's table changed, ``priority`` orders the layers by
improvement (new peak / old peak, ascending: the most improved first, as vllm-ascend's own
policies do). vllm-ascend's worker reverts a layer unless every expert is present, no device
holds an expert twice and every expert that stays on a device keeps its exact slot; the tables
here obey all three (``S <= E``; ``S > E`` cannot obey the second and is refused).

Use: ``PolicyFactory`` maps integers to classes; put ``XllmAscendPolicy`` where the chosen
``eplb_policy_type`` is built, e.g. ``XllmAscendPolicy(config, fallback=DefaultEplb(config))``.
On a failure it logs one line and answers ``fallback``'s plan, or "no change" without one
(what the worker does with an invalid plan); ``strict=True`` or ``XLLM_EPLB_STRICT=1`` raises
instead.
"""

from __future__ import annotations

import numpy as np

from xllm_eplb.eplb.balance import rank_loads_from_phy2log
from xllm_eplb.integrations.core import LayoutError, log, plan_physical, strict_mode, to_numpy

__all__ = ["XllmAscendPolicy", "logical_load"]


def logical_load(table: np.ndarray, workload: np.ndarray, num_logical: int) -> np.ndarray:
    """Per-expert load [L, E]: each slot's workload added to its expert. table, workload
    [L, D, S] (int64 kept for integer counts)."""
    layers = table.shape[0]
    w = np.asarray(workload)
    out = np.zeros((layers, num_logical), dtype=np.int64 if w.dtype.kind in "iub" else np.float64)
    li = np.repeat(np.arange(layers), table[0].size)
    np.add.at(out, (li, table.reshape(-1)), w.reshape(-1))
    return out


class XllmAscendPolicy:
    """``config``: vllm-ascend's ``DynamicConfig`` (kept, unused); ``policy``: one of
    incremental (default), balanced, greedy, node_aware (None: ``XLLM_EPLB_POLICY``);
    ``fallback``: a vllm-ascend policy object used when planning fails; ``strict``: raise
    instead (None: ``XLLM_EPLB_STRICT``)."""

    def __init__(self, config=None, *, policy: str | None = None, fallback=None,
                 strict: bool | None = None):
        self.config, self.policy, self.fallback = config, policy, fallback
        self.strict = strict

    def rebalance_experts(self, current_expert_table, expert_workload):
        try:
            return self._plan(current_expert_table, expert_workload)
        except Exception as e:
            if strict_mode(self.strict):
                raise
            log.warning("xllm-eplb: %s: %s; %s", type(e).__name__, e,
                        "using the fallback policy" if self.fallback else "keeping the table")
            if self.fallback is not None:
                return self.fallback.rebalance_experts(current_expert_table, expert_workload)
            cur = to_numpy(current_expert_table)
            return 0, np.arange(cur.shape[0]), current_expert_table

    def _plan(self, current_expert_table, expert_workload):
        cur = to_numpy(current_expert_table).astype(np.int64)
        load = to_numpy(expert_workload)
        if load.ndim == 4 and load.shape[1:] == cur.shape:
            load = load.sum(axis=0)          # FlashLB's slot (type 3): a window [T, L, D, S]
        if cur.ndim != 3 or load.shape != cur.shape:
            raise LayoutError(f"tables of shapes {cur.shape} and {load.shape}: need "
                              f"[layers, devices, slots] and a workload of that shape or "
                              f"[steps, layers, devices, slots]")
        layers, num_d, s = cur.shape
        num_e = int(cur.max()) + 1
        if s > num_e:
            raise LayoutError(f"{s} slots per device exceed the {num_e} experts (vllm-ascend "
                              f"allows one replica of an expert per device)")
        w = logical_load(cur, load, num_e)
        old = cur.reshape(layers, -1)
        new = plan_physical(w, num_d * s, num_d, kind=self.policy, old=old, rank_repeats=False)
        before = rank_loads_from_phy2log(old, w, num_d).max(axis=1)
        after = rank_loads_from_phy2log(new, w, num_d).max(axis=1)
        ratio = np.where(before > 0, after / np.where(before > 0, before, 1.0), 1.0)
        priority = np.argsort(ratio, kind="stable")
        change = int((new != old).any())
        table = new.reshape(layers, num_d, s)
        if hasattr(current_expert_table, "detach"):
            import torch

            table = torch.from_numpy(table).to(current_expert_table.dtype)
        return change, priority, table
