"""The OpenAI API of a real `xllm-eplb serve` at EP2 (real processes, shm, gloo) driven by the
real ``openai`` client: streaming and non-streaming give identical tokens, a client that goes
away is cancelled, a frozen worker makes /health report a stall naming it, and a worker that
stops answering for good is named in the run's exit message."""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from xllm_eplb.testing.serving import shm_objects

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs POSIX shm")]

FLAGS = ["--ep-size", "2", "--workload=none", "--enable_eplb=false", "--dtype=float64"]


def _client(s) -> openai.OpenAI:
    return openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=60)


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _metric(s, name: str, **labels) -> float:
    text = _get(s.url + "/metrics")[1].decode()
    for fam in text_string_to_metric_families(text):
        for x in fam.samples:
            if x.name == name and all(x.labels.get(k) == v for k, v in labels.items()):
                return x.value
    raise AssertionError(f"no sample {name}{labels}")


def _worker(s, rank: int) -> psutil.Process:
    return next(p for p in psutil.Process(s.proc.pid).children()
                if f"ep{rank}" in " ".join(p.cmdline()))


def _wait_for(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _served_tokenizer():
    """The tokenizer of the checkpoint a server started with ``FLAGS`` generated (same flags,
    same cache folder: the session's, which the servers inherit)."""
    from xllm_eplb.engine.tokenizer import load_tokenizer
    from xllm_eplb.flags import load_config
    from xllm_eplb.model.default_checkpoint import with_default_checkpoint

    root = Path(__file__).resolve().parents[1]
    cfg, _ = load_config(["--config", str(root / "configs" / "eplb.yaml"), "--ep-size", "4",
                          *FLAGS])
    return load_tokenizer(with_default_checkpoint(cfg).model.model)


@pytest.mark.timeout(240)
def test_openai_client_streaming_cancellation_and_stall(start_server):
    s = start_server(*FLAGS, "--stall_seconds=1")
    s.wait_ready()
    c = _client(s)
    assert [m.id for m in c.models.list().data] == ["xllm-eplb"]
    kw = dict(model="xllm-eplb", prompt="the engine", max_tokens=24, temperature=0.9, seed=4,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    full = c.completions.create(**kw).choices[0]
    chunks = list(c.completions.create(stream=True, **kw))
    assert [t for ch in chunks for t in ch.choices[0].model_extra["token_ids"]] == \
        full.model_extra["token_ids"]
    assert "".join(ch.choices[0].text for ch in chunks) == full.text
    # chat: the generated default checkpoint ships a ChatML template; the prompt the server
    # counted is exactly that template rendered and encoded by the checkpoint's tokenizer
    msgs = [{"role": "user", "content": "x"}]
    tok = _served_tokenizer()
    want = len(tok.encode(tok.apply_chat_template(msgs), add_special_tokens=False))
    chat = c.chat.completions.create(model="xllm-eplb", messages=msgs, max_tokens=4)
    assert chat.usage.prompt_tokens == want and chat.usage.completion_tokens >= 1
    # log-probabilities computed on the workers, through the rings: greedy tokens are their
    # own most likely alternative, streamed and full replies carry the same values
    lkw = dict(model="xllm-eplb", messages=msgs, max_tokens=4, temperature=0.0, logprobs=True,
               top_logprobs=3, extra_body={"ignore_eos": True})
    content = c.chat.completions.create(**lkw).choices[0].logprobs.content
    assert len(content) == 4
    for e in content:
        assert e.logprob <= 0.0 and len(e.top_logprobs) == 3
        assert (e.top_logprobs[0].token, e.top_logprobs[0].logprob) == (e.token, e.logprob)
    streamed = [e.model_dump() for ch in c.chat.completions.create(stream=True, **lkw)
                for x in ch.choices if x.logprobs is not None for e in x.logprobs.content]
    assert streamed == [e.model_dump() for e in content]
    lp = c.completions.create(model="xllm-eplb", prompt="the engine", max_tokens=5,
                              temperature=0.0, logprobs=2,
                              extra_body={"ignore_eos": True}).choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 5 and all(x <= 0 for x in lp.token_logprobs)
    assert [next(iter(t.items())) for t in lp.top_logprobs] == list(
        zip(lp.tokens, lp.token_logprobs, strict=True))
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model="xllm-eplb", prompt="x", extra_body={"ignore_eos": "no"})

    # a streaming client that goes away: cancelled within a step, slot and KV cache released
    conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=30)
    conn.request("POST", "/v1/completions", body=json.dumps(
        {"prompt": "go on", "max_tokens": 400, "ignore_eos": True, "stream": True}).encode(),
        headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200 and r.readline().startswith(b"data: ")
    conn.close()
    log = s.log_dir / "engine.log"
    _wait_for(lambda: "engine request cancelled" in log.read_text(), 20, "the cancel line")
    status = json.loads(_get(s.url + "/eplb/status")[1])
    assert status["requests"] == {"waiting": 0, "running": 0}
    # one info line per cancelled request (the API's own line is debug)
    assert log.read_text().count("request cancelled") == 1
    assert 'reason="client disconnected"' in log.read_text()
    assert "Traceback" not in log.read_text()
    assert _metric(s, "xllm_eplb_requests_total", result="cancelled") == 1

    # a frozen worker: a streaming client gets an error event naming it within
    # --stall_seconds (#26 item 5); /health says stalled and names it, worker_up drops, ages grow
    w1 = _worker(s, 1)
    w1.suspend()
    t0 = time.monotonic()
    try:
        done = {}

        def read_stream():
            try:
                for _ in c.completions.create(model="xllm-eplb", prompt="wait", max_tokens=400,
                                              stream=True, extra_body={"ignore_eos": True}):
                    pass
            except openai.APIError as e:
                done.update(err=str(e), at=time.monotonic() - t0)

        t = threading.Thread(target=read_stream)
        t.start()
        st, body = _wait_for(lambda: (lambda x: x if x[0] == 503 else None)(
            _get(s.url + "/health")), 20, "a stalled /health")
        info = json.loads(body)
        assert info["status"] == "stalled" and info["waiting_on"] == [1], info
        assert _metric(s, "xllm_eplb_worker_up", rank="1") == 0
        assert _metric(s, "xllm_eplb_worker_up", rank="0") == 1
        a1 = _metric(s, "xllm_eplb_heartbeat_age_seconds", component="worker", rank="1")
        time.sleep(0.6)
        a2 = _metric(s, "xllm_eplb_heartbeat_age_seconds", component="worker", rank="1")
        assert a2 > a1 >= 1.0
        with pytest.raises(openai.APIStatusError) as e:
            c.completions.create(model="xllm-eplb", prompt="x", max_tokens=1)
        assert e.value.status_code == 503 and "stalled" in e.value.message
        t.join(20)
        assert "engine stalled" in done["err"] and "on rank 1 " in done["err"], done
        assert done["at"] < 1 + 1.5, done          # --stall_seconds=1, checked every 0.25 s
    finally:
        w1.resume()
    t.join(60)
    # the worker woke up: the step completes, the failed request's KV cache is released, and
    # the engine serves again
    _wait_for(lambda: json.loads(_get(s.url + "/health")[1])["status"] == "serving", 20,
              "serving again")
    assert c.completions.create(model="xllm-eplb", prompt="x", max_tokens=2).choices[0]
    assert _metric(s, "xllm_eplb_worker_up", rank="1") == 1
    assert "engine stall step=" in log.read_text()


@pytest.mark.timeout(120)
def test_worker_timeout_names_the_silent_rank(start_server):
    s = start_server(*FLAGS, "--worker_timeout_seconds=3", "--shutdown_timeout_seconds=2",
                     "--elastic_ep=false")        # not fenced and replaced: the run stops
    s.wait_ready()
    s.note_children()
    _worker(s, 1).suspend()
    try:
        with pytest.raises((openai.APIError, openai.APIConnectionError)) as told:
            _client(s).completions.create(model="xllm-eplb", prompt="x", max_tokens=2)
        rc = s.proc.wait(60)
    finally:
        for p in s.alive():
            os.kill(p, signal.SIGCONT)
    err = s.err.read_text()
    assert rc == 1, err
    assert "rank 1: stopped answering" in err and "rank 0:" not in err, err
    assert "rank 1 did not stop" in err        # it was frozen: SIGKILL, named
    assert "rank 1: stopped answering" in str(told.value)      # the client is told why
    # the console's final error line and the launcher log agree on who was killed, why, when
    last = [ln for ln in err.splitlines() if ln.startswith("error:")][-1]
    at = last.rsplit(" at ", 1)[1]
    killed = [ln for ln in (s.log_dir / "launcher.log").read_text().splitlines()
              if "launcher killed" in ln]
    assert last.startswith("error: rank 1 did not stop") and len(killed) == 1, (last, killed)
    assert "procs=ep1" in killed[0] and f"at={at}" in killed[0] and "SIGKILL" in killed[0]
    time.sleep(0.3)
    assert s.alive() == [] and shm_objects(s.run_id) == []
