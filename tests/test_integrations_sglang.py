"""SGLang's hook (`xllm_eplb.integrations.sglang`): its signature with the step axis, dense
layers as zero rows, the deployed map, the fall-back to SGLang's algorithm. The test against the
real SGLang runs where `sglang.srt.plugins` and `sglang.srt.eplb.eplb_algorithms` import
(sglang 0.5.23 `--no-deps` needs orjson, pybase64, msgspec, IPython, traitlets and triton, about
1 GB; `make test` does not install it), else it skips."""

import numpy as np
import pytest
import torch
from integrations_util import import_host, kept_slots_ok

from xllm_eplb.integrations import sglang as ours
from xllm_eplb.integrations.maps import check_triple

SGL = (import_host("sglang", "sglang.srt.eplb.eplb_algorithms",
                   "sglang.srt.plugins.hook_registry") or [None])[0]
needs_sglang = pytest.mark.skipif(SGL is None, reason="SGLang is not installed (its EPLB and "
                                  "plugin modules need sglang + triton, ~1 GB; make test does not "
                                  "install it): see docs/integrations.md")


def counts(steps=4, dense=3, moe=5, experts=16, seed=0):
    rng = np.random.default_rng(seed)
    t = (rng.random((steps, dense + moe, experts)) ** 4 * 100).astype(np.int64)
    t[:, :dense] = 0                                   # dense layers: zero rows, as SGLang sends
    return torch.tensor(t)


def test_signature_with_steps_and_dense_zero_rows():
    t = counts()
    p, l2p, cnt = ours.rebalance_experts(t, 24, 6, None, 1, "auto", old=None)
    assert p.shape == (8, 24) and p.dtype == torch.int64 and p.device.type == "cpu"
    assert check_triple(p.numpy(), l2p.numpy(), cnt.numpy(), 16) == []


def test_deployed_map_is_honoured():
    t = counts()
    p0, _, _ = ours.rebalance_experts(t, 24, 6, None, 1, "auto", old=None)
    t2 = (t.double() * 1.05).long()
    p1, l2p, cnt = ours.rebalance_experts(t2, 24, 6, None, 1, "auto", old=p0)
    assert torch.equal(p1[:3], p0[:3])                 # zero rows keep what is deployed
    assert kept_slots_ok(p0.numpy(), p1.numpy(), 4)
    assert check_triple(p1.numpy(), l2p.numpy(), cnt.numpy(), 16) == []


def test_around_falls_back_to_sglangs_function(caplog):
    seen = []

    def original(*args, **kwargs):
        seen.append(kwargs)
        return "sglang's plan"

    t = counts().double()
    t[0, 4, 0] = float("nan")                          # our planner refuses NaN loads
    with caplog.at_level("WARNING", logger="xllm_eplb.integrations"):
        got = ours.around(original, tokens_per_expert=t, num_physical_experts=24,
                          num_local_physical_experts=6, num_groups=None, num_nodes=1,
                          algorithm="auto")
    assert got == "sglang's plan" and len(seen) == 1
    assert len([r for r in caplog.records if "using SGLang's" in r.getMessage()]) == 1


def test_register_without_env_does_nothing(monkeypatch, caplog):
    monkeypatch.delenv("XLLM_EPLB_POLICY", raising=False)
    with caplog.at_level("DEBUG", logger="xllm_eplb.integrations"):
        ours.register()
    assert caplog.records == []


@needs_sglang
def test_real_sglang_hook(monkeypatch):
    from sglang.srt.plugins.hook_registry import HookRegistry

    original = SGL.rebalance_experts
    try:
        monkeypatch.setenv("XLLM_EPLB_POLICY", "incremental")
        ours.register()
        HookRegistry.apply_hooks()
        assert SGL.rebalance_experts is not original
        t = counts()
        algo = SGL.compute_algorithm("auto", None, 1)
        p, l2p, cnt = SGL.rebalance_experts(tokens_per_expert=t, num_physical_experts=24,
                                            num_local_physical_experts=6, num_groups=None,
                                            num_nodes=1, algorithm=algo)
        assert check_triple(p.numpy(), l2p.numpy(), cnt.numpy(), 16) == []
        mine = ours.rebalance_experts(t, 24, 6, None, 1, algo)[0]
        assert torch.equal(p, mine)
    finally:
        SGL.rebalance_experts = original
        HookRegistry.reset()
