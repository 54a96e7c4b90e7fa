"""`xllm-eplb serve` with per-step replica routing while EPLB moves experts live: greedy tokens
stay those of transformers.generate before and after committed placement changes, on the
defaults (the shared-memory all-to-all, async scheduling) and on gloo's all-to-all with each
step planned after the last one's tokens (issue #39: both transports, both loops)."""

from __future__ import annotations

import pytest
from hf_parity_util import hf_generate
from test_serve import _get, _wait
from test_serve_hf import N_NEW, PROMPTS, _generate


def _tokens(s) -> list[list[int]]:
    return [ids for ids, _ in _generate(s, ignore_eos=True)]


@pytest.mark.slow
@pytest.mark.oracle
@pytest.mark.timeout(300)
@pytest.mark.parametrize("routing, flags", [
    ("spread", ()), ("balanced", ("--ep_transport=dist", "--async_scheduling=false"))])
def test_serve_routing_mode_keeps_tokens_through_live_moves(routing, flags, hf_ckpts,
                                                            start_server):
    path = hf_ckpts["deepseek_v3"]
    want, _ = hf_generate(path, PROMPTS, N_NEW)
    s = start_server("--model", str(path), f"--eplb_replica_routing={routing}",
                     "--redundant_experts_num=2", "--eplb_update_interval=3",
                     "--workload=synthetic", "--workload_rate=6", "--workload_output_len=16",
                     "--workload_prompt_len=8", "--eplb_min_peak_load_improvement=0",
                     "--eplb_policy_kind=balanced", "--eplb_plan_on=tokens", *flags)
    s.wait_ready(180)
    assert _tokens(s) == want
    st = _wait(lambda: (lambda st: st if st["layers_committed"] >= 2 else None)(
        _get(s.url + "/eplb/status")), 150, "two committed layers", s)
    assert st["slots_moved"] > 0 and st["capacity"]["replica_routing"] == routing
    assert _tokens(s) == want
    assert st["outputs_exact"] is True
    assert (st["async_scheduling"]["steps_planned_ahead"] > 0) == (not flags)
