"""Chat completions with a real chat template: a generated HF-format checkpoint's tokenizer
(``tokenizer.json`` + the template of ``tokenizer_config.json``, through ``HfTokenizer``) behind
the real API server, driven by the real ``openai`` client."""

from __future__ import annotations

import openai
import pytest
from api_util import start_api

from xllm_eplb.engine.tokenizer import load_tokenizer
from xllm_eplb.model.checkpoint import make_checkpoint

pytestmark = pytest.mark.slow

MSGS = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tok = load_tokenizer(str(make_checkpoint("deepseek_v3", tmp_path_factory.mktemp("ck") / "c")))
    api, loop = start_api(tok, vocab_size=tok.size, context=512, max_prompt=256)
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{api.port}/v1", api_key="none",
                      max_retries=0, timeout=60)
    yield tok, c
    loop.stop.set()
    api.close()


def test_chat_prompt_is_the_checkpoints_template(served):
    tok, c = served
    r = c.chat.completions.create(model="tiny", messages=MSGS, max_tokens=6, seed=3,
                                  temperature=0.8, extra_body={"ignore_eos": True,
                                                               "return_token_ids": True})
    want = tok.encode(tok.apply_chat_template(MSGS), add_special_tokens=False)
    assert r.model_extra["prompt_token_ids"] == want and r.usage.prompt_tokens == len(want)
    ids = r.choices[0].model_extra["token_ids"]
    assert len(ids) == 6 and r.choices[0].message.content == tok.decode(ids)
    s = list(c.chat.completions.create(model="tiny", messages=MSGS, max_tokens=6, seed=3,
                                       temperature=0.8, stream=True,
                                       extra_body={"ignore_eos": True}))
    assert "".join(x.choices[0].delta.content or "" for x in s) == r.choices[0].message.content


def test_text_completion_with_the_bpe_tokenizer(served):
    tok, c = served
    r = c.completions.create(model="tiny", prompt="The capital of France is", max_tokens=5,
                             extra_body={"ignore_eos": True, "return_token_ids": True})
    assert r.choices[0].model_extra["prompt_token_ids"] == tok.encode("The capital of France is")
    with pytest.raises(openai.BadRequestError, match="messages"):
        c.chat.completions.create(model="tiny", messages=[])


def test_a_role_the_template_refuses_is_a_400_on_messages_not_no_template(served):
    _, c = served
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny", messages=[{"role": "wizard", "content": "x"}])
    body = e.value.body
    assert body["code"] == "invalid_messages" and body["param"] == "messages", body
    assert "unknown role wizard" in body["message"] and "need a chat template" not in \
        body["message"], body


def test_chat_context_errors_name_the_fields_the_request_used(served):
    _, c = served
    msgs = [{"role": "user", "content": "x"}]
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny", messages=msgs, max_completion_tokens=600)
    assert e.value.body["param"] == "max_completion_tokens", e.value.body
    assert "max_completion_tokens (600)" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny", messages=msgs, max_tokens=600)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x" * 900}])
    assert e.value.body["param"] == "messages" and e.value.body["code"] == \
        "context_length_exceeded", e.value.body
