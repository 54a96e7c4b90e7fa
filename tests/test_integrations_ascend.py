"""vllm-ascend's legacy policy interface (`XllmAscendPolicy`) on its policy fixture shape: 58
layers x 32 devices x 9 slots, per-slot load ``rand**10 * 999 + 1`` (their bars: mean imbalance
<= 1.08 SwiftBalancer, <= 1.10 FlashLB; ours <= 1.01), with every invariant of vllm-ascend's
``check_expert_placement`` on every layer."""

import numpy as np
import pytest
import torch

from xllm_eplb.eplb.balance import rank_loads_from_phy2log
from xllm_eplb.integrations.vllm_ascend import XllmAscendPolicy, logical_load
from xllm_eplb.testing.peer_fixtures import ascend_fixture


def mean_imbalance(table, hot):
    """vllm-ascend's metric: per layer max/mean device load (expert load split evenly over its
    replicas), averaged over layers."""
    r = rank_loads_from_phy2log(np.asarray(table).reshape(table.shape[0], -1), hot,
                                table.shape[1])
    return float((r.max(axis=1) / r.mean(axis=1)).mean())


def placement_violations(old, new):
    """vllm-ascend's worker rules (a layer breaking one is reverted), as facts."""
    bad = []
    for i, (o, n) in enumerate(zip(old, new, strict=True)):
        if np.unique(n).size < np.unique(o).size:
            bad.append((i, "expert missing"))
        for d, (od, nd) in enumerate(zip(o, n, strict=True)):
            if np.unique(nd).size != nd.size:
                bad.append((i, d, "expert twice on a device"))
            stay = np.isin(nd, od)
            if not np.array_equal(nd[stay], od[stay]):
                bad.append((i, d, "an expert that stays changed slot"))
    return bad


@pytest.fixture(scope="module")
def planned():
    tab, load = ascend_fixture()
    change, priority, new = XllmAscendPolicy(None, policy="incremental").rebalance_experts(
        tab, load)
    return tab, load, change, priority, np.asarray(new)


def test_fixture_mean_imbalance_and_invariants(planned):
    tab, load, change, priority, new = planned
    hot = logical_load(tab, load, 256)
    assert mean_imbalance(tab, hot) > 2.0                 # the fixture starts unbalanced
    assert mean_imbalance(new, hot) <= 1.01
    assert placement_violations(tab, new) == []
    assert new.shape == tab.shape


def test_change_and_priority_are_real(planned):
    tab, load, change, priority, new = planned
    hot = logical_load(tab, load, 256)
    assert change == 1
    before = rank_loads_from_phy2log(tab.reshape(58, -1), hot, 32).max(axis=1)
    after = rank_loads_from_phy2log(new.reshape(58, -1), hot, 32).max(axis=1)
    ratio = after / before
    assert sorted(priority.tolist()) == list(range(58))
    assert (np.diff(ratio[priority]) >= 0).all()          # the most improved layer first
    # a second call on the plan's own table changes nothing: steady state
    change2, _, again = XllmAscendPolicy(None).rebalance_experts(new, _slot_load(new, hot))
    assert change2 == 0 and np.array_equal(np.asarray(again), new)


def _slot_load(table, hot):
    cnt = np.stack([np.bincount(t.ravel(), minlength=hot.shape[1]) for t in table])
    return np.take_along_axis(hot / cnt, table.reshape(table.shape[0], -1), 1).reshape(
        table.shape)


def test_torch_in_torch_out_and_fallback(caplog):
    tab, load = ascend_fixture(layers=2, devices=4, slots=3, experts=8)
    ch, pr, new = XllmAscendPolicy(None).rebalance_experts(torch.tensor(tab),
                                                           torch.tensor(load))
    assert isinstance(new, torch.Tensor) and new.shape == (2, 4, 3)

    class Keep:                                           # a host policy: keeps the table
        def rebalance_experts(self, table, workload):
            return 0, np.arange(len(table)), table

    bad = load.copy()
    bad[0, 0, 0] = np.nan
    with caplog.at_level("WARNING", logger="xllm_eplb.integrations"):
        ch, pr, got = XllmAscendPolicy(None, fallback=Keep()).rebalance_experts(tab, bad)
        ch2, _, got2 = XllmAscendPolicy(None).rebalance_experts(tab, bad)
    assert ch == 0 and got is tab and ch2 == 0 and got2 is tab
    assert len(caplog.records) == 2
