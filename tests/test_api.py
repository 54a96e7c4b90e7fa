"""HTTP API (FastAPI + uvicorn) in front of a real scheduler and the single-process reference
model: the real ``openai`` client for completions, chat, streaming and errors; raw HTTP for the
error schema, methods, sizes and bad JSON; the server keeps serving after bad input."""

from __future__ import annotations

import http.client
import json
import math
import socket
import time

import openai
import pytest
from api_util import ChatByteTokenizer, start_api

from xllm_eplb.engine.api import ApiServer
from xllm_eplb.engine.tokenizer import ByteTokenizer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server():
    api, loop = start_api(ChatByteTokenizer())
    yield api, loop
    loop.stop.set()
    api.close()


@pytest.fixture(scope="module")
def client(server):
    api, _ = server
    return openai.OpenAI(base_url=f"http://127.0.0.1:{api.port}/v1", api_key="none",
                         max_retries=0, timeout=30)


def _call(port, method, path, body=None, raw=None, headers=None):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    c.request(method, path, body=data, headers={"Content-Type": "application/json",
                                               **(headers or {})})
    r = c.getresponse()
    payload = r.read()
    c.close()
    ctype = r.getheader("Content-Type", "")
    return r.status, (json.loads(payload) if "json" in ctype and payload else payload), r


def test_completion_text_and_token_ids_match_the_reference_model(server):
    api, loop = server
    st, body, _ = _call(api.port, "POST", "/v1/completions",
                        {"prompt": "hello", "max_tokens": 5, "ignore_eos": True,
                         "return_token_ids": True})
    assert st == 200, body
    ch = body["choices"][0]
    assert len(ch["token_ids"]) == 5 and ch["finish_reason"] == "length"
    assert ch["prompt_token_ids"] == [256] + list(b"hello")
    assert body["usage"] == {"prompt_tokens": 6, "completion_tokens": 5, "total_tokens": 11}
    assert body["model"] == "tiny" and body["created"] > 0 and body["id"].startswith("cmpl-")
    for key in ("prompt_token_ids", "prompt"):
        st, again, _ = _call(api.port, "POST", "/v1/completions",
                             {key: [256] + list(b"hello"), "max_tokens": 5, "ignore_eos": True,
                              "return_token_ids": True})
        assert st == 200 and again["choices"][0]["token_ids"] == ch["token_ids"]   # greedy
        assert again["id"] != body["id"]


def test_openai_client_completions_batch_and_n(client):
    r = client.completions.create(model="tiny", prompt=["ab", "cd"], max_tokens=4, n=2,
                                  temperature=1.0, seed=5, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 16 and r.usage.prompt_tokens == 2 * 3   # each prompt once, as OpenAI
    single = client.completions.create(model="tiny", prompt="cd", max_tokens=4,
                                       temperature=1.0, seed=6, extra_body={"ignore_eos": True})
    assert single.choices[0].text == r.choices[3].text      # choice j of a prompt: seed + j


def test_sampling_is_reproducible_with_a_seed_and_fresh_without(client):
    kw = dict(model="tiny", prompt="abc", max_tokens=12, temperature=1.5,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    a = client.completions.create(seed=42, **kw).choices[0].model_extra["token_ids"]
    b = client.completions.create(seed=42, **kw).choices[0].model_extra["token_ids"]
    assert a == b
    fresh = {tuple(client.completions.create(**kw).choices[0].model_extra["token_ids"])
             for _ in range(3)}
    assert len(fresh) > 1
    k1 = client.completions.create(seed=3, **dict(kw, extra_body=dict(
        kw["extra_body"], top_k=1))).choices[0].model_extra["token_ids"]
    greedy = client.completions.create(**dict(kw, temperature=0.0)).choices[0].model_extra
    assert k1 == greedy["token_ids"]                          # top_k=1 is greedy


def test_streaming_reassembles_to_the_non_streamed_text(client):
    kw = dict(model="tiny", prompt="stream me", max_tokens=20, temperature=1.0, seed=11,
              extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0]
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True},
                                            **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 20 and not chunks[-1].choices


def test_streaming_several_choices_and_zero_tokens(client):
    kw = dict(model="tiny", prompt=["p one", "p two"], max_tokens=6, n=2, temperature=1.0,
              seed=2, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    texts = {k: "" for k in range(4)}
    ends = {}
    for c in client.completions.create(stream=True, **kw):
        for ch in c.choices:
            texts[ch.index] += ch.text
            if ch.finish_reason:
                ends[ch.index] = ch.finish_reason
    assert texts == {c.index: c.text for c in full.choices}
    assert ends == {k: "length" for k in range(4)}
    z = client.completions.create(model="tiny", prompt="x", max_tokens=0)
    assert z.choices[0].text == "" and z.choices[0].finish_reason == "length"
    assert z.usage.completion_tokens == 0


def test_stop_strings_and_stop_token_ids(client):
    base = client.completions.create(model="tiny", prompt="xyz", max_tokens=20,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
    ids = base.choices[0].model_extra["token_ids"]
    text = base.choices[0].text
    stop = next((text[i:i + 2] for i in range(3, len(text) - 2)
                 if text[i:i + 2].isprintable() and "\ufffd" not in text[i:i + 2]), None)
    if stop is not None:
        r = client.completions.create(model="tiny", prompt="xyz", max_tokens=20, stop=[stop],
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].finish_reason == "stop" and r.choices[0].text == \
            text[:text.find(stop)]
        s = client.completions.create(model="tiny", prompt="xyz", max_tokens=20, stop=stop,
                                      stream=True, extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in s) == r.choices[0].text
    r = client.completions.create(model="tiny", prompt="xyz", max_tokens=20,
                                  extra_body={"ignore_eos": True, "stop_token_ids": [ids[4]],
                                              "return_token_ids": True})
    got = r.choices[0].model_extra["token_ids"]
    assert r.choices[0].finish_reason == "stop" and got == ids[:ids.index(ids[4]) + 1]


def test_chat_completion_and_stream(client):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, seed=1,
                                       temperature=0.7, extra_body={"ignore_eos": True,
                                                                    "return_token_ids": True})
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant" and r.usage.completion_tokens == 8
    prompt = "\x01<system>be brief\n<user>hi\n<assistant>"
    assert r.model_extra["prompt_token_ids"] == list(prompt.encode())
    s = list(client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, seed=1,
                                            temperature=0.7, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert s[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in s) == r.choices[0].message.content
    assert s[-1].choices[0].finish_reason == "length"


def test_models_list(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]


@pytest.mark.parametrize("kw,param", [
    (dict(prompt="x", max_tokens=-1), "max_tokens"),
    (dict(prompt="x" * 80), "prompt"),
    (dict(prompt="x" * 50, max_tokens=60), "max_tokens"),
    (dict(prompt="x", extra_body={"ignore_eos": "false"}), "ignore_eos"),
    (dict(prompt="x", extra_body={"bogus": 1, "other": 2}), "bogus"),
    (dict(prompt="x", top_p=0.0), "top_p"),
    (dict(prompt="x", n=1000), "n"),
    (dict(prompt="x", logprobs=6), "logprobs"),
    (dict(prompt="x", stop=[""]), "stop"),
    (dict(prompt=[], max_tokens=2), "prompt"),
])
def test_openai_client_gets_bad_request_errors(client, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", **kw)
    assert e.value.body["param"] == param and e.value.body["message"], e.value.body


def test_completion_logprobs_greedy_tokens_are_the_top_alternative(client):
    r = client.completions.create(model="tiny", prompt="the engine", max_tokens=8,
                                  temperature=0.0, logprobs=3,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    c = r.choices[0]
    lp = c.logprobs
    n = len(c.model_extra["token_ids"])
    assert n == 8 and len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
    assert "".join(lp.tokens) == c.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:k]) for k in range(n)]
    for tok, x, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        first = next(iter(top.items()))
        assert x <= 0.0 and first == (tok, x), (tok, x, top)     # greedy = argmax
        assert list(top.values()) == sorted(top.values(), reverse=True) and len(top) <= 3
        assert sum(math.exp(v) for v in top.values()) <= 1.0 + 1e-9
    plain = client.completions.create(model="tiny", prompt="the engine", max_tokens=8,
                                      temperature=0.0, extra_body={"ignore_eos": True})
    assert plain.choices[0].logprobs is None and plain.choices[0].text == c.text
    zero = client.completions.create(model="tiny", prompt="the engine", max_tokens=2,
                                     temperature=0.0, logprobs=0).choices[0].logprobs
    assert [list(t) for t in zero.top_logprobs] == [[t] for t in zero.tokens]


def test_chat_logprobs_stream_and_full_agree(client):
    kw = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
              temperature=0.0, logprobs=True, top_logprobs=4, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kw).choices[0]
    content = full.logprobs.content
    assert len(content) == 6
    for e in content:
        assert e.logprob <= 0.0 and len(e.top_logprobs) == 4
        assert (e.top_logprobs[0].token, e.top_logprobs[0].logprob) == (e.token, e.logprob)
        assert e.bytes == list(e.token.encode("utf-8"))
    streamed = [e for ch in client.chat.completions.create(stream=True, **kw)
                for c in ch.choices if c.logprobs is not None for e in c.logprobs.content]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                       top_logprobs=2)
    assert e.value.body["param"] == "top_logprobs"


def test_unknown_model_is_a_404_and_chat_without_template_a_400():
    api, loop = start_api(ByteTokenizer())
    try:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{api.port}/v1", api_key="x",
                          max_retries=0, timeout=30)
        with pytest.raises(openai.NotFoundError) as e:
            c.completions.create(model="gpt-4", prompt="x", max_tokens=1)
        assert e.value.body["code"] == "model_not_found"
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}])
        assert e.value.body["code"] == "no_chat_template"
        assert "chat template" in e.value.body["message"]
    finally:
        loop.stop.set()
        api.close()


def test_text_prompt_without_tokenizer_files_is_a_400_token_ids_still_served():
    class NoText(ByteTokenizer):
        has_text = False

    api, loop = start_api(NoText())
    try:
        st, err, _ = _call(api.port, "POST", "/v1/completions", {"prompt": "hi"})
        assert st == 400 and err["error"]["code"] == "no_tokenizer"
        assert "no tokenizer files" in err["error"]["message"]
        st, ok, _ = _call(api.port, "POST", "/v1/completions",
                          {"prompt": [256, 1, 2], "max_tokens": 2, "return_token_ids": True})
        assert st == 200 and len(ok["choices"][0]["token_ids"]) <= 2
    finally:
        loop.stop.set()
        api.close()


@pytest.mark.parametrize("body,param", [
    ({"max_tokens": 3}, "prompt"),
    ({"prompt": "x", "prompt_token_ids": [1]}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt_token_ids": [1, 99999]}, "prompt_token_ids"),
    ({"prompt_token_ids": []}, "prompt_token_ids"),
    ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "x", "max_tokens": "3"}, "max_tokens"),
    ({"prompt": "x", "temperature": -0.5}, "temperature"),
    ({"prompt": "x" * 80}, "prompt"),                       # > max_prefill_tokens=64
    ({"prompt": "x" * 50, "max_tokens": 60}, "max_tokens"),  # > max_position_embeddings
    ({"prompt": "x", "ignore_eos": "false"}, "ignore_eos"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "x", "seed": 1.5}, "seed"),
])
def test_bad_requests_get_a_json_400_naming_the_field(server, body, param):
    api, _ = server
    st, err, _ = _call(api.port, "POST", "/v1/completions", body)
    assert st == 400 and err["error"]["param"] == param, err
    assert err["error"]["message"] and set(err["error"]) == {"message", "type", "param", "code"}


def test_malformed_json_unknown_routes_and_methods(server):
    api, _ = server
    assert _call(api.port, "POST", "/v1/completions", raw=b"{not json")[0] == 400
    assert _call(api.port, "POST", "/v1/completions", raw=b"[1, 2]")[0] == 400
    assert _call(api.port, "POST", "/v1/completions", raw=b'{"prompt": NaN}')[0] == 400
    st, err, _ = _call(api.port, "POST", "/v1/completions", raw=b"[" * 100000 + b"]" * 100000)
    assert st == 400 and "nest" in err["error"]["message"]
    st, err, _ = _call(api.port, "POST", "/v1/completions",
                       {"prompt": "x", "user": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]})
    assert st == 400 and "deeper" in err["error"]["message"]
    st, err, _ = _call(api.port, "GET", "/nope")
    assert st == 404 and "nope" in err["error"]["message"]
    assert _call(api.port, "POST", "/metrics", {})[0] == 405
    st, err, r = _call(api.port, "GET", "/v1/completions")
    assert st == 405 and r.getheader("Allow") == "POST"
    st, _, r = _call(api.port, "HEAD", "/v1/chat/completions")
    assert st == 405 and r.getheader("Allow") == "POST"
    # regression: other methods got http.server's HTML 501 page, not a JSON 405/404
    st, err, r = _call(api.port, "DELETE", "/health")
    assert st == 405 and err["error"]["message"] == "use GET for /health"
    assert "GET" in r.getheader("Allow")
    assert _call(api.port, "PUT", "/v1/completions", {})[0] == 405
    assert _call(api.port, "PATCH", "/nope", {})[0] == 404
    st, err, _ = _call(api.port, "POST", "/v1/completions", raw=b" " * ((1 << 20) + 1))
    assert st == 413 and err["error"]["message"]
    # still serving
    assert _call(api.port, "GET", "/health")[:2] == (200, {"status": "serving"})
    st, text, _ = _call(api.port, "GET", "/metrics")
    assert st == 200 and text == b"xllm_eplb_up 1\n"
    assert _call(api.port, "GET", "/eplb/status")[:2] == (200, {"policy": "balanced"})
    st, doc, _ = _call(api.port, "GET", "/openapi.json")
    assert st == 200 and {"/v1/completions", "/v1/chat/completions", "/v1/models"} <= set(
        doc["paths"])
    assert "messages" in json.dumps(doc["paths"]["/v1/chat/completions"])


def test_lone_surrogates_and_unparsable_http_are_json_400s(server):
    api, _ = server
    # regression: "\ud800" is legal JSON but no tokenizer can encode it (was a 500)
    for path, body, param in [
            ("/v1/completions", {"prompt": "a\ud800", "max_tokens": 1}, "prompt"),
            ("/v1/completions", {"prompt": "a", "stop": ["\udfff"]}, "stop.0"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
                {"type": "text", "text": "\ud83d"}]}]}, "messages.0.content.0.text")]:
        st, err, _ = _call(api.port, "POST", path, raw=json.dumps(body).encode())
        assert st == 400 and err["error"]["param"] == param, err
        assert "surrogate" in err["error"]["message"]
    # regression: a request h11 cannot parse got uvicorn's text/plain 400
    for head in (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n{}",
                 b"GARBAGE\r\n\r\n"):
        with socket.create_connection(("127.0.0.1", api.port), timeout=10) as sock:
            sock.sendall(head)
            reply = b""
            while chunk := sock.recv(65536):
                reply += chunk
        status, _, rest = reply.partition(b"\r\n")
        headers, _, payload = rest.partition(b"\r\n\r\n")
        assert status.startswith(b"HTTP/1.1 400") and b"application/json" in headers, reply
        err = json.loads(payload)["error"]
        assert err["type"] == "invalid_request_error" and "malformed HTTP" in err["message"]
    assert _call(api.port, "GET", "/health")[0] == 200


def _open_stream(port: int, body: dict) -> http.client.HTTPConnection:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request("POST", "/v1/completions", body=json.dumps(body).encode(),
              headers={"Content-Type": "application/json"})
    return c


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_cancels_the_request(server, stream):
    api, loop = server
    before = len(loop.cancelled)
    c = _open_stream(api.port, {"prompt": "long", "max_tokens": 80, "ignore_eos": True,
                                "stream": stream})
    if stream:
        r = c.getresponse()
        assert r.status == 200 and r.readline().startswith(b"data: ")
    else:
        time.sleep(0.3)             # the request is running
    c.close()
    deadline = time.monotonic() + 10
    while len(loop.cancelled) == before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(loop.cancelled) == before + 1
    req = loop.cancelled[-1]
    assert req.finish_reason == "cancelled" and len(req.output) < 80
    deadline = time.monotonic() + 5
    while loop.sched.running and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not loop.sched.running and req.req_id not in loop.model.kv.slot_of   # KV released


def test_port_in_use_is_an_oserror(server):
    api, _ = server
    with pytest.raises(OSError):
        ApiServer("127.0.0.1", api.port, None)


def test_the_model_path_is_served_as_an_alias_as_vllm_names_it():
    # issue 41 item 4: a client written for vLLM sends the --model string as the model name
    api, loop = start_api(ByteTokenizer(), aliases=("/models/tiny-moe",))
    try:
        st, body, _ = _call(api.port, "GET", "/v1/models")
        assert st == 200 and [m["id"] for m in body["data"]] == ["tiny", "/models/tiny-moe"]
        st, body, _ = _call(api.port, "GET", "/v1/models//models/tiny-moe")
        assert st == 200 and body["id"] == "/models/tiny-moe", body
        st, body, _ = _call(api.port, "POST", "/v1/completions",
                            {"model": "/models/tiny-moe", "prompt": "hi", "max_tokens": 2})
        assert st == 200, body
        st, body, _ = _call(api.port, "POST", "/v1/completions",
                            {"model": "other", "prompt": "hi", "max_tokens": 2})
        assert st == 404 and "this server serves 'tiny' (or '/models/tiny-moe')" in \
            body["error"]["message"], body
    finally:
        loop.stop.set()
        api.close()
