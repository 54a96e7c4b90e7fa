"""DeepSeek's interface (`xllm_eplb.integrations.deepseek`) on the peers' published cases, the
reference implementation of DeepSeek's algorithm, and the fresh-plan contract."""

import numpy as np
import pytest
import torch
from integrations_util import (
    BAD_CASES,
    DS_MAX_GPU_LOAD,
    DS_PHY2LOG,
    DS_WEIGHT,
    PEER_CASES,
    gpu_loads,
    per_rank_repeats,
    unavoidable_repeats,
)

from xllm_eplb.integrations import deepseek_ref
from xllm_eplb.integrations.core import KINDS, LayoutError, plan_physical
from xllm_eplb.integrations.deepseek import rebalance_experts
from xllm_eplb.integrations.maps import check_triple


def test_reference_reproduces_deepseeks_published_example():
    p, l2p, cnt = deepseek_ref.rebalance_experts(np.array(DS_WEIGHT), 16, 4, 2, 8)
    assert p.tolist() == DS_PHY2LOG
    assert check_triple(p, l2p, cnt, 12) == []
    assert gpu_loads(p, DS_WEIGHT, 8).max(axis=1).tolist() == DS_MAX_GPU_LOAD


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", sorted(PEER_CASES))
def test_every_case_deepseek_plans_is_planned_consistently(case, kind):
    w, r, groups, nodes, gpus = PEER_CASES[case]
    ref = deepseek_ref.rebalance_experts(np.array(w), r, groups, nodes, gpus)  # DeepSeek plans it
    p, l2p, cnt = rebalance_experts(torch.tensor(w), r, groups, nodes, gpus, policy=kind)
    for t in (p, l2p, cnt):
        assert isinstance(t, torch.Tensor) and t.dtype == torch.int64 and t.device.type == "cpu"
    e = len(w[0])
    assert p.shape == (len(w), r) and cnt.shape == (len(w), e) and l2p.shape[:2] == (len(w), e)
    assert check_triple(p.numpy(), l2p.numpy(), cnt.numpy(), e) == []
    assert (cnt >= 1).all() and (cnt.sum(dim=1) == r).all()
    # replicas of one expert share a GPU where the layout forces it, or where that lowers the
    # peak below the plan with one replica per GPU
    if per_rank_repeats(p.numpy(), gpus) > unavoidable_repeats(e, r // gpus):
        strict = plan_physical(np.array(w), r, gpus, kind=kind, num_nodes=nodes,
                               num_groups=groups, rank_repeats=False)
        assert (gpu_loads(p.numpy(), w, gpus).max(axis=1)
                < gpu_loads(strict, w, gpus).max(axis=1)).any()
    assert ref[0].shape == tuple(p.shape)


@pytest.mark.parametrize("kind", KINDS)
def test_readme_example_no_worse_than_deepseeks_published_placement(kind):
    p, _, _ = rebalance_experts(np.array(DS_WEIGHT), 16, 4, 2, 8, policy=kind)
    peaks = gpu_loads(p, DS_WEIGHT, 8).max(axis=1)
    assert (peaks <= np.array(DS_MAX_GPU_LOAD) + 1e-9).all(), peaks


def test_peer_facts_equal_and_hot_experts():
    _, _, cnt = rebalance_experts(np.array([[50] * 8]), 8, 2, 2, 4)
    assert (cnt == 1).all()                          # vLLM test_equal_weights
    _, _, cnt = rebalance_experts(np.array([[1000, 1, 1, 1, 1, 1, 1, 1]]), 12, 2, 2, 4)
    assert cnt[0, 0] > cnt[0, 1]                     # vLLM test_extreme_weight_imbalance
    _, _, cnt = rebalance_experts(np.array([[100, 50, 200, 75, 150, 25, 300, 80]]), 12, 4, 2, 4)
    assert cnt[0, 6] >= 2                            # vLLM test_small_scale_hierarchical


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_layouts_deepseek_refuses_raise_assertion(case):
    w, r, groups, nodes, gpus = BAD_CASES[case]
    with pytest.raises(AssertionError, match="num_replicas"):
        rebalance_experts(np.array(w), r, groups, nodes, gpus)
    with pytest.raises(LayoutError):
        rebalance_experts(torch.tensor(w), r, groups, nodes, gpus)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("loads", ["uniform", "zero"])
def test_fresh_plan_contract_uniform_and_zero(kind, loads):
    w = np.full((3, 8), 50 if loads == "uniform" else 0)
    p, l2p, cnt = rebalance_experts(w, 8, 2, 2, 4, policy=kind)     # vLLM test_equal_weights
    assert isinstance(p, np.ndarray) and (p >= 0).all()
    assert check_triple(p, l2p, cnt, 8) == []
    p, l2p, cnt = rebalance_experts(w, 16, 1, 1, 4, policy=kind)    # with redundancy
    assert check_triple(p, l2p, cnt, 8) == []


def test_old_map_keeps_retained_slots_and_moves_little():
    rng = np.random.default_rng(1)
    a = (rng.random((4, 64)) ** 4 * 1000).astype(np.int64) + 1
    p0, _, _ = rebalance_experts(a, 80, 1, 1, 16)
    b = (a * rng.uniform(0.9, 1.1, a.shape)).astype(np.int64)
    p1, l2p, cnt = rebalance_experts(b, 80, 1, 1, 16, old_phy2log=p0)
    assert check_triple(p1, l2p, cnt, 64) == []
    ref = deepseek_ref.rebalance_experts(b, 80, 1, 1, 16)[0]
    assert (p1 != p0).mean() < (ref != p0).mean()


def test_env_picks_the_policy(monkeypatch):
    w = np.array(DS_WEIGHT)
    monkeypatch.setenv("XLLM_EPLB_POLICY", "node_aware")
    p, _, _ = rebalance_experts(w, 16, 4, 2, 8)
    assert p.tolist() == DS_PHY2LOG                  # node_aware hierarchical = DeepSeek's here
    monkeypatch.setenv("XLLM_EPLB_POLICY", "greedy")
    assert rebalance_experts(w, 16, 4, 2, 8)[0].tolist() == \
        rebalance_experts(w, 16, 4, 2, 8, policy="greedy")[0].tolist()
    with pytest.raises(ValueError, match="policy='nope'"):
        rebalance_experts(w, 16, 4, 2, 8, policy="nope")
