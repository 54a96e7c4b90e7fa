"""`xllm-eplb serve --model DIR --ep-size 4` on save_pretrained folders: EPLB moves real expert
weights live and greedy tokens stay identical to transformers.generate."""

from __future__ import annotations

import pytest
from hf_parity_util import hf_generate
from test_serve import _get, _post, _wait

PROMPTS = [[5, 17, 300, 42, 8, 9, 100, 77, 23], [7, 3], [11, 12, 13, 14, 15]]
N_NEW = 16


def _tokens(s):
    out = []
    for p in PROMPTS:
        code, body = _post(s.url, {"prompt": p, "max_tokens": N_NEW, "temperature": 0.0,
                                   "ignore_eos": True, "return_token_ids": True})
        assert code == 200, body
        out.append(body["choices"][0]["token_ids"])
    return out


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("family", ["deepseek_v3", "qwen2_moe"])
def test_serve_checkpoint_rebalances_with_transformers_tokens(family, hf_ckpts,
                                                              start_server):  # noqa: F811
    path = hf_ckpts[family]
    want, _ = hf_generate(path, PROMPTS, N_NEW)
    s = start_server("--model", str(path), "--eplb_update_interval=3", "--workload=synthetic",
                     "--workload_rate=6", "--workload_output_len=16", "--workload_prompt_len=8",
                     "--eplb_min_peak_load_improvement=0")
    s.wait_ready(180)
    before = _tokens(s)
    assert before == want
    st = _wait(lambda: (lambda st: st if st["layers_committed"] >= 2 else None)(
        _get(s.url + "/eplb/status")), 150, "two committed layers", s)
    assert st["slots_moved"] > 0
    assert _tokens(s) == want
