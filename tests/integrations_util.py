"""Facts for the integration tests: the peers' published test cases (inputs only, written here)
and the invariants their callers assume."""

from __future__ import annotations

import importlib
import importlib.util

import numpy as np


def import_host(package: str, *modules: str):
    """The modules of a host engine, or None when the package is not installed or one of them
    does not import here (a CPU machine without the host's own dependencies)."""
    try:
        if importlib.util.find_spec(package) is None:
            return None
        return [importlib.import_module(m) for m in modules]
    except Exception:
        return None

# DeepSeek EPLB README example (also vLLM's test_basic_rebalance)
DS_WEIGHT = [[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
             [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]]
DS_PHY2LOG = [[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
              [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]]
DS_MAX_GPU_LOAD = [156.0, 179.5]

# (weight, num_replicas, num_groups, num_nodes, num_gpus): vLLM tests/distributed/
# test_eplb_algo.py (every case its default policy plans) and the extra layouts
PEER_CASES = {
    "deepseek_readme": (DS_WEIGHT, 16, 4, 2, 8),
    "single_gpu": ([[10, 20, 30, 40]], 4, 1, 1, 1),
    "equal_weights": ([[50] * 8], 8, 2, 2, 4),
    "extreme_imbalance": ([[1000, 1, 1, 1, 1, 1, 1, 1]], 12, 2, 2, 4),
    "multiple_layers": ([[10, 20, 30, 40, 50, 60], [60, 50, 40, 30, 20, 10], [25] * 6], 8, 2, 2,
                        4),
    "groups_not_dividing_nodes": ([[10, 20, 30, 40]], 8, 3, 2, 4),
    "small_hierarchical": ([[100, 50, 200, 75, 150, 25, 300, 80]], 12, 4, 2, 4),
    "global_fallback": ([[10, 20, 30, 40, 50, 60]], 8, 3, 2, 4),
    "device_compat": ([[10, 20, 30, 40]], 6, 2, 1, 2),
    "large_distributed": ([[50, 100, 75, 120, 90, 60, 80, 110, 40, 70, 95, 85, 65, 55, 45, 35]],
                          24, 8, 4, 8),
    "decreasing_increasing": ([[200, 150, 100, 50, 25, 12], [12, 25, 50, 100, 150, 200]], 10, 3,
                              1, 2),
    "five_experts_three_ranks": ([[5, 40, 3, 17, 9]], 6, 1, 1, 3),
    "more_slots_than_experts": ([[1, 2, 3, 4]], 32, 1, 1, 2),
    "all_zero_layer": ([[0] * 8, [3, 1, 4, 1, 5, 9, 2, 6]], 12, 1, 1, 4),
}
# layouts every planner refuses: (weight, R, groups, nodes, gpus)
BAD_CASES = {
    "replicas_not_multiple_of_gpus": ([[10, 20, 30, 40]], 7, 2, 2, 4),
    "fewer_replicas_than_experts": ([[10, 20, 30, 40]], 2, 1, 1, 2),
}


def per_rank_repeats(phy2log: np.ndarray, ranks: int) -> int:
    """The most replicas of one expert on one rank, over every layer."""
    return max(int(np.bincount(r).max()) for row in np.asarray(phy2log)
               for r in row.reshape(ranks, -1))


def unavoidable_repeats(num_logical: int, slots: int) -> int:
    """Replicas of one expert a rank must hold at least: ceil(slots / experts)."""
    return -(-slots // num_logical)


def gpu_loads(phy2log, weight, ranks: int) -> np.ndarray:
    """Per-rank load with each expert's load split evenly over its replicas: [L, ranks]."""
    from xllm_eplb.eplb.balance import rank_loads_from_phy2log

    return rank_loads_from_phy2log(np.asarray(phy2log), np.asarray(weight, float), ranks)


def kept_slots_ok(old: np.ndarray, new: np.ndarray, ranks: int) -> bool:
    """vllm-ascend's / vLLM's retained-slot rule: on every rank, each expert that stays keeps
    (one of) its old slot(s)."""
    for o_row, n_row in zip(np.asarray(old), np.asarray(new), strict=True):
        for o, n in zip(o_row.reshape(ranks, -1), n_row.reshape(ranks, -1), strict=True):
            for e in set(o.tolist()) & set(n.tolist()):
                if not (n[o == e] == e).any():
                    return False
    return True
