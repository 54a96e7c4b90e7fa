"""vLLM's policy interface (`xllm_eplb.integrations.vllm`): the class vLLM calls, the old map,
the plugin's opt-in and the fall-back to the replaced default. The tests against the real vLLM
run where `vllm.distributed.eplb.policy` imports (vllm 0.33.0 `pip install --no-deps` plus
eleven small packages does, on CPU; docs/integrations.md); `make test` does not install vLLM
(a 336 MB wheel), so they skip there."""

import numpy as np
import pytest
import torch
from integrations_util import DS_WEIGHT, PEER_CASES, import_host, kept_slots_ok, per_rank_repeats

from xllm_eplb.integrations import deepseek_ref
from xllm_eplb.integrations.maps import logical_maps
from xllm_eplb.integrations.vllm import XllmEplbPolicy, install, register

VLLM = (import_host("vllm", "vllm.distributed.eplb.policy") or [None])[0]
needs_vllm = pytest.mark.skipif(VLLM is None, reason="vLLM is not installed (its EPLB policy "
                                "module needs the vllm wheel, 336 MB; make test does not install "
                                "it): see docs/integrations.md for the versions tested")


class DeepSeekPolicy:
    """A host default with vLLM's interface: DeepSeek's algorithm (the fallback under test)."""

    calls = 0

    @classmethod
    def rebalance_experts(cls, weight, num_replicas, num_groups, num_nodes, num_ranks,
                          old_global_expert_indices=None):
        cls.calls += 1
        w = np.asarray(weight, dtype=np.float64)
        return torch.from_numpy(deepseek_ref.rebalance_experts(w, num_replicas, num_groups,
                                                               num_nodes, num_ranks)[0])


@pytest.mark.parametrize("case", sorted(PEER_CASES))
def test_classmethod_answers_phy2log_on_cpu(case):
    w, r, groups, nodes, ranks = PEER_CASES[case]
    p = XllmEplbPolicy.rebalance_experts(torch.tensor(w, dtype=torch.int32), r, groups, nodes,
                                         ranks)
    assert isinstance(p, torch.Tensor) and p.dtype == torch.int64 and p.device.type == "cpu"
    assert p.shape == (len(w), r)
    _, cnt = logical_maps(p.numpy(), len(w[0]))
    assert (cnt >= 1).all() and (cnt.sum(axis=1) == r).all()


def test_parameter_validation_is_an_assertion():
    with pytest.raises(AssertionError):           # vLLM test_parameter_validation
        XllmEplbPolicy.rebalance_experts(torch.tensor([[10, 20, 30, 40]]), 7, 2, 2, 4)


def test_old_map_retained_experts_keep_their_slots():
    rng = np.random.default_rng(3)
    a = torch.tensor((rng.random((6, 32)) ** 3 * 500).astype(np.int64) + 1)
    old = XllmEplbPolicy.rebalance_experts(a, 48, 1, 1, 8)
    b = (a.double() * torch.tensor(rng.uniform(0.5, 1.5, a.shape))).long()
    new = XllmEplbPolicy.rebalance_experts(b, 48, 1, 1, 8, old)
    assert kept_slots_ok(old.numpy(), new.numpy(), 8)
    assert (new != old).double().mean() < 0.5


def test_old_map_with_duplicates_like_vllms_intragpu_case():
    old = torch.tensor([[0, 1, 0, 2, 3, 4, 5, 6, 1, 2]])   # 2 GPUs x 5, expert 0 twice on GPU 0
    new = XllmEplbPolicy.rebalance_experts(torch.tensor([[90, 5, 30, 20, 10, 8, 6]]), 10, 1, 1,
                                           2, old)
    assert sorted(set(new[0].tolist())) == list(range(7))
    assert kept_slots_ok(old.numpy(), new.numpy(), 2)


@pytest.mark.parametrize("old", ["minus_one", "narrower"])
def test_old_map_minus_one_or_other_width_plans_fresh(old):
    w = torch.tensor(DS_WEIGHT)
    fresh = XllmEplbPolicy.rebalance_experts(w, 16, 4, 2, 8)
    o = torch.full((2, 16), -1) if old == "minus_one" else fresh[:, :12]
    got = XllmEplbPolicy.rebalance_experts(w, 16, 4, 2, 8, o)
    assert torch.equal(got, fresh)


def test_more_slots_per_rank_than_experts():
    p = XllmEplbPolicy.rebalance_experts(torch.tensor([[1, 2, 3, 4]]), 32, 1, 1, 2)
    assert per_rank_repeats(p.numpy(), 2) == 4                 # 16 slots, 4 experts: forced


def test_register_without_env_does_nothing(monkeypatch, caplog):
    import sys

    monkeypatch.delenv("XLLM_EPLB_POLICY", raising=False)
    before = set(sys.modules)
    with caplog.at_level("DEBUG", logger="xllm_eplb.integrations"):
        register()
    assert not [m for m in set(sys.modules) - before if m.startswith("vllm")]
    assert caplog.records == []                    # not even "vLLM is not importable"
    if VLLM is not None:
        assert not getattr(VLLM.EPLB_POLICIES["default"], "_xllm_eplb", False)


def test_register_with_env_but_no_vllm_logs_one_line(monkeypatch, caplog):
    if VLLM is not None:
        pytest.skip("vLLM is installed here")
    monkeypatch.setenv("XLLM_EPLB_POLICY", "1")
    with caplog.at_level("DEBUG", logger="xllm_eplb.integrations"):
        register()
    assert len(caplog.records) == 1 and "keeps its default" in caplog.records[0].getMessage()


def test_install_replaces_default_and_falls_back_on_failure(caplog):
    reg = {"default": DeepSeekPolicy}
    cls = install(reg, "incremental")
    assert reg["default"] is cls and cls.host_default is DeepSeekPolicy
    assert install(reg, "greedy") is cls                       # idempotent
    w = torch.tensor(DS_WEIGHT)
    assert cls.rebalance_experts(w, 16, 4, 2, 8).shape == (2, 16)
    DeepSeekPolicy.calls = 0
    bad = w.clone()
    bad[0, 0] = -5                                             # our planner refuses negatives
    with caplog.at_level("WARNING", logger="xllm_eplb.integrations"):
        got = cls.rebalance_experts(bad, 16, 4, 2, 8)
    assert DeepSeekPolicy.calls == 1 and got.shape == (2, 16)
    assert len([r for r in caplog.records if "planned by vLLM's" in r.getMessage()]) == 1


@needs_vllm
def test_real_vllm_registry(monkeypatch):
    from vllm.distributed.eplb.policy.abstract import AbstractEplbPolicy
    from vllm.distributed.eplb.policy.default import DefaultEplbPolicy

    saved = dict(VLLM.EPLB_POLICIES)
    try:
        monkeypatch.setenv("XLLM_EPLB_POLICY", "incremental")
        register()
        cls = VLLM.EPLB_POLICIES["default"]
        assert issubclass(cls, AbstractEplbPolicy) and cls.host_default is DefaultEplbPolicy
        w = torch.tensor(DS_WEIGHT)
        ours = cls.rebalance_experts(w, 16, 4, 2, 8)
        theirs = DefaultEplbPolicy.rebalance_experts(w, 16, 4, 2, 8)
        assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
        from xllm_eplb.eplb.balance import rank_loads_from_phy2log as rl

        assert (rl(ours.numpy(), DS_WEIGHT, 8).max(1) <= rl(theirs.numpy(), DS_WEIGHT, 8).max(1)
                ).all()
    finally:
        VLLM.EPLB_POLICIES.clear()
        VLLM.EPLB_POLICIES.update(saved)
