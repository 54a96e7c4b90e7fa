"""`xllm-eplb serve --model DIR --ep-size 4` on save_pretrained folders of every family: EPLB
moves real expert weights live, greedy tokens stay identical to transformers.generate, and a
request stops on the checkpoint's own EOS id (generation_config.json), not the byte tokenizer's;
the served log-probabilities are transformers' log_softmax of its logits."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from hf_parity_util import hf_generate
from hf_util import SERVED_FAMILIES as FAMILIES
from test_serve import _get, _post, _wait

PROMPTS = [[5, 17, 300, 42, 8, 9, 100, 77, 23], [7, 3], [11, 12, 13, 14, 15]]
N_NEW = 12


def _generate(s, ignore_eos: bool, model: str | None = None):
    """-> [(token_ids, finish_reason)] per prompt, greedy (``model``: the name sent)."""
    out = []
    for p in PROMPTS:
        named = {"model": model} if model is not None else {}
        code, body = _post(s.url, {"prompt": p, "max_tokens": N_NEW, "temperature": 0.0,
                                   "ignore_eos": ignore_eos, "return_token_ids": True, **named})
        assert code == 200, body
        c = body["choices"][0]
        out.append((c["token_ids"], c["finish_reason"]))
    return out


def _check_logprobs(s, want: list[int], logits: np.ndarray) -> None:
    """Prompt 0, greedy, ``logprobs=5``: the sampled tokens' logprobs and the top-5 values are
    transformers' ``log_softmax`` of its logits [n, V] within 1e-4."""
    code, body = _post(s.url, {"prompt": PROMPTS[0], "max_tokens": N_NEW, "temperature": 0.0,
                               "ignore_eos": True, "return_token_ids": True, "logprobs": 5})
    assert code == 200, body
    c = body["choices"][0]
    assert c["token_ids"] == want
    ref = logits - logits.max(axis=1, keepdims=True)
    ref = ref - np.log(np.exp(ref).sum(axis=1, keepdims=True))
    got = np.array(c["logprobs"]["token_logprobs"])
    np.testing.assert_allclose(got, ref[np.arange(N_NEW), want], atol=1e-4)
    top = [sorted(d.values(), reverse=True)[0] for d in c["logprobs"]["top_logprobs"]]
    np.testing.assert_allclose(top, ref.max(axis=1), atol=1e-4)


def _eos_case(want: list[list[int]], family: str) -> tuple[object, list[tuple[list[int], str]]]:
    """An EOS id the greedy output of prompt 0 reaches mid-way (first seen at step >= 2), as an
    int (two families) or a list (the other two, as DeepSeek's generation_config has it), and
    what a non-ignore_eos request must then return per prompt: the tokens up to and including
    the first EOS (reason "stop"), else all of them (reason "length")."""
    k = next(i for i in range(2, N_NEW - 1) if want[0][i] not in want[0][:i])
    eos = want[0][k]
    value = eos if FAMILIES.index(family) % 2 == 0 else [eos, 257]
    stop_ids = {eos} | ({257} if isinstance(value, list) else set())
    exp = []
    for w in want:
        cut = next((i for i, t in enumerate(w) if t in stop_ids), None)
        exp.append((w, "length") if cut is None else (w[:cut + 1], "stop"))
    return value, exp


@pytest.mark.slow
@pytest.mark.oracle
@pytest.mark.timeout(240)
@pytest.mark.parametrize("family", FAMILIES)
def test_serve_checkpoint_rebalances_with_transformers_tokens(family, hf_ckpts, tmp_path,
                                                              start_server):  # noqa: F811
    want, hf_logits = hf_generate(hf_ckpts[family], PROMPTS, N_NEW)
    path = tmp_path / family
    shutil.copytree(hf_ckpts[family], path)
    eos, want_eos = _eos_case(want, family)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    # `serve DIR` as vLLM's `vllm serve MODEL` (issue 41 item 4)
    s = start_server(str(path), "--eplb_update_interval=3", "--workload=synthetic",
                     "--workload_rate=6", "--workload_output_len=16", "--workload_prompt_len=8",
                     "--eplb_min_peak_load_improvement=0", "--eplb_policy_kind=balanced",
                     "--eplb_plan_on=tokens")
    s.wait_ready(180)
    assert _get(s.url + "/v1/models")["data"][0]["family"] == family
    # the path is a served name too (a client written for vLLM sends it)
    assert _generate(s, ignore_eos=True, model=str(path)) == [(w, "length") for w in want]
    _check_logprobs(s, want[0], hf_logits[0])
    st = _wait(lambda: (lambda st: st if st["layers_committed"] >= 2 else None)(
        _get(s.url + "/eplb/status")), 150, "two committed layers", s)
    assert st["slots_moved"] > 0
    assert _generate(s, ignore_eos=True) == [(w, "length") for w in want]
    assert _generate(s, ignore_eos=False) == want_eos
    # the default --async_scheduling planned steps ahead (while no EPLB round was in flight)
    assert _get(s.url + "/eplb/status")["async_scheduling"]["steps_planned_ahead"] > 0
