"""The peer engines' EPLB test cases as inputs (facts from their published tests and PRs,
written here in our words), the host defaults to compare against, and the measures their tests
apply. Shared by ``tests/test_peer_cases.py`` and ``scripts/bench_peer_cases.py``; no host
package is imported.

A case is a layout (``replicas`` slots on ``ranks`` ranks, ``groups`` / ``nodes`` for the
hierarchical policies) and a load table ``[L, E]``. Its host default is the policy the peer
ships: DeepSeek's algorithm (:mod:`xllm_eplb.integrations.deepseek_ref`; vLLM's
``DefaultEplbPolicy``, SGLang's ``deepseek`` and vllm-ascend's ``DefaultEplb`` are ports of it)
or TensorRT-LLM's replication + placement (:func:`trtllm_plan`, written from its description:
replicas one at a time to the largest load per replica, then each replica, heaviest first, onto
the least-loaded rank with a free slot; an expert may repeat on a rank).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from xllm_eplb.eplb.balance import rank_loads_from_phy2log


@dataclass(frozen=True)
class PeerCase:
    """``loads`` int or float [L, E]; ``max_diff``: the peer's bound on the largest minus the
    smallest rank load (TensorRT-LLM's placement cases), ``bar``: its bound on peak/ideal
    (vllm-ascend's mean over layers of max/mean device load)."""

    name: str
    host: str                     # deepseek | trtllm: the host default's algorithm
    source: str                   # where the case comes from
    loads: np.ndarray
    replicas: int
    ranks: int
    groups: int = 1
    nodes: int = 1
    max_diff: float | None = None
    bar: float | None = None


def pareto_loads(layers: int, experts: int, seed: int, shape: float = 1.5) -> np.ndarray:
    """Heavy-tailed integer token counts [L, E]: ``(pareto(shape) + 1) * 100``."""
    rng = np.random.default_rng(seed)
    return np.rint((rng.pareto(shape, (layers, experts)) + 1) * 100).astype(np.int64)


def ascend_loads(seed: int = 0, layers: int = 58) -> np.ndarray:
    """vllm-ascend's policy fixture folded to experts: 256 experts, per-slot ``rand**10 * 999 +
    1`` on a 32 x 9 table (each slot's load added to its expert)."""
    from xllm_eplb.testing.peer_fixtures import ascend_fixture

    tab, load = ascend_fixture(seed, layers=layers)
    out = np.zeros((layers, 256))
    np.add.at(out, (np.repeat(np.arange(layers), tab[0].size), tab.reshape(-1)),
              load.reshape(-1))
    return out


def _a(rows) -> np.ndarray:
    return np.asarray(rows, dtype=np.int64)


def cases(layers: int = 4) -> list[PeerCase]:
    """Every peer case; ``layers``: the layer count of the synthetic large ones (the fixtures
    of 58 layers keep it only where the peer's shape is the point)."""
    c = [
        # vLLM tests/distributed/test_eplb_algo.py (DeepSeek's README example first)
        PeerCase("vllm_basic_readme", "deepseek", "vLLM test_eplb_algo",
                 _a([[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                     [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]]), 16, 8, 4, 2),
        PeerCase("vllm_single_gpu", "deepseek", "vLLM test_eplb_algo", _a([[10, 20, 30, 40]]),
                 4, 1),
        PeerCase("vllm_equal_weights", "deepseek", "vLLM test_eplb_algo", _a([[50] * 8]), 8, 4,
                 2, 2),
        PeerCase("vllm_extreme_imbalance", "deepseek", "vLLM test_eplb_algo",
                 _a([[1000, 1, 1, 1, 1, 1, 1, 1]]), 12, 4, 2, 2),
        PeerCase("vllm_multiple_layers", "deepseek", "vLLM test_eplb_algo",
                 _a([[10, 20, 30, 40, 50, 60], [60, 50, 40, 30, 20, 10], [25] * 6]), 8, 4, 2, 2),
        PeerCase("vllm_parameter_validation", "deepseek", "vLLM test_eplb_algo",
                 _a([[10, 20, 30, 40]]), 8, 4, 3, 2),
        PeerCase("vllm_small_hierarchical", "deepseek", "vLLM test_eplb_algo",
                 _a([[100, 50, 200, 75, 150, 25, 300, 80]]), 12, 4, 4, 2),
        PeerCase("vllm_global_fallback", "deepseek", "vLLM test_eplb_algo",
                 _a([[10, 20, 30, 40, 50, 60]]), 8, 4, 3, 2),
        PeerCase("vllm_device_compatibility", "deepseek", "vLLM test_eplb_algo",
                 _a([[10, 20, 30, 40]]), 6, 2, 2, 1),
        PeerCase("vllm_additional_large", "deepseek", "vLLM test_eplb_algo",
                 _a([[50, 100, 75, 120, 90, 60, 80, 110, 40, 70, 95, 85, 65, 55, 45, 35]]), 24,
                 8, 8, 4),
        PeerCase("vllm_additional_monotone", "deepseek", "vLLM test_eplb_algo",
                 _a([[200, 150, 100, 50, 25, 12], [12, 25, 50, 100, 150, 200]]), 10, 2, 3, 1),
        PeerCase("vllm_four_experts_two_ranks", "deepseek", "vLLM coverage PR",
                 _a([[8, 3, 2, 4]]), 6, 2),
        # vLLM's coverage PR: DeepSeek-V2-Lite geometry, uniform load
        PeerCase("vllm_v2lite_uniform_ep4", "deepseek", "vLLM coverage PR",
                 np.full((1, 64), 100, np.int64), 88, 4),
        PeerCase("vllm_v2lite_uniform_ep8", "deepseek", "vLLM coverage PR",
                 np.full((1, 64), 100, np.int64), 88, 8),
        # vLLM's MLB PR fixture shape: 58 layers x 256 experts on EP8 x 36 slots
        PeerCase("vllm_mlb_ep8x36", "deepseek", "vLLM MLB PR (shape; loads ours)",
                 pareto_loads(58, 256, 7), 288, 8),
        # SGLang: R = 2E on 16 GPUs
        PeerCase("sglang_r2e_ep16", "deepseek", "SGLang EPLB (R = 2E)",
                 pareto_loads(layers, 256, 3), 512, 16),
        # TensorRT-LLM moeLoadBalancerTest.cpp placement cases (their replica counts are an
        # input there; we plan ours) and the replication case without loads
        PeerCase("trtllm_equal", "trtllm", "TensorRT-LLM placement", _a([[1, 1, 1, 1]]), 4, 2,
                 max_diff=0.001),
        PeerCase("trtllm_varied", "trtllm", "TensorRT-LLM placement", _a([[1, 3, 2, 1]]), 6, 2,
                 max_diff=0.01),
        PeerCase("trtllm_complex", "trtllm", "TensorRT-LLM placement",
                 _a([[10, 5, 2, 15, 8]]), 9, 3, max_diff=2.0),
        PeerCase("trtllm_extreme", "trtllm", "TensorRT-LLM placement", _a([[1, 100, 10]]), 4, 2,
                 max_diff=9.0),
        PeerCase("trtllm_one_replica_each", "trtllm", "TensorRT-LLM placement",
                 _a([[2, 3, 4, 5, 6, 7]]), 6, 2, max_diff=1.0),
        PeerCase("trtllm_zero_loads", "trtllm", "TensorRT-LLM replication",
                 _a([[0, 0, 0, 0]]), 6, 2),
        PeerCase("trtllm_ep72x4", "trtllm", "TensorRT-LLM (72 ranks x 4 slots)",
                 pareto_loads(layers, 256, 5), 288, 72),
        # heavy-tailed loads at wide EP (DeepSeek's algorithm as the host)
        PeerCase("pareto_ep128x3", "deepseek", "DeepSeek EPLB (EP128 x 3)",
                 pareto_loads(layers, 256, 11), 384, 128),
        PeerCase("pareto_ep72x4", "deepseek", "DeepSeek EPLB (EP72 x 4)",
                 pareto_loads(layers, 256, 13), 288, 72),
        # vllm-ascend tests/ut/eplb policy fixture: 58 x 32 x 9, bar 1.10 (FlashLB), 1.08
        # (SwiftBalancer) on the mean over layers of max/mean device load
        PeerCase("ascend_policy_fixture", "deepseek", "vllm-ascend test_policy_factory",
                 ascend_loads(0, 58), 288, 32, bar=1.08),
    ]
    return c


def trtllm_plan(loads: np.ndarray, replicas: int, ranks: int) -> np.ndarray:
    """TensorRT-LLM's replication + placement (see the module doc) -> int64 [L, R]."""
    w = np.asarray(loads, dtype=np.float64)
    layers, num_e = w.shape
    slots = replicas // ranks
    out = np.empty((layers, replicas), np.int64)
    for i in range(layers):
        cnt = np.ones(num_e, np.int64)
        for _ in range(replicas - num_e):
            cnt[int(np.argmax(w[i] / cnt))] += 1
        items = np.repeat(np.arange(num_e), cnt)
        per = w[i][items] / cnt[items]
        load, free = np.zeros(ranks), np.full(ranks, slots)
        row = np.empty((ranks, slots), np.int64)
        for k in np.argsort(-per, kind="stable"):
            d = int(np.argmin(np.where(free > 0, load, np.inf)))
            row[d, slots - free[d]] = items[k]
            free[d] -= 1
            load[d] += per[k]
        out[i] = row.reshape(-1)
    return out


def host_plan(case: PeerCase) -> np.ndarray:
    """The host default's table for ``case``, int64 [L, R]."""
    if case.host == "trtllm":
        return trtllm_plan(case.loads, case.replicas, case.ranks)
    from xllm_eplb.integrations import deepseek_ref

    return np.asarray(deepseek_ref.rebalance_experts(case.loads, case.replicas, case.groups,
                                                     case.nodes, case.ranks)[0], np.int64)


def imbalance(table: np.ndarray, loads: np.ndarray, ranks: int) -> float:
    """Peak over ideal over all layers: sum of the largest rank loads / sum of the mean rank
    loads (each expert's load split evenly over its replicas); 1.0 for all-zero loads."""
    r = rank_loads_from_phy2log(np.asarray(table), np.asarray(loads, np.float64), ranks)
    mean = r.mean(axis=1).sum()
    return 1.0 if mean <= 0 else float(r.max(axis=1).sum() / mean)


def mean_imbalance(table: np.ndarray, loads: np.ndarray, ranks: int) -> float:
    """vllm-ascend's measure: the mean over layers of max / mean rank load."""
    r = rank_loads_from_phy2log(np.asarray(table), np.asarray(loads, np.float64), ranks)
    m = r.mean(axis=1)
    return float(np.where(m > 0, r.max(axis=1) / np.where(m > 0, m, 1.0), 1.0).mean())


def max_diff(table: np.ndarray, loads: np.ndarray, ranks: int) -> float:
    """TensorRT-LLM's measure: the largest (max - min rank load) over the layers."""
    r = rank_loads_from_phy2log(np.asarray(table), np.asarray(loads, np.float64), ranks)
    return float((r.max(axis=1) - r.min(axis=1)).max())
