"""End-to-end `xllm-eplb serve` at EP4 on the tiny CPU model: real processes, real shared
memory, real gloo. Each test kills its process group and sweeps the run's /dev/shm objects,
even on failure."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from xllm_eplb.testing.serving import ROOT, Server, shm_objects

pytestmark = [pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs POSIX shm"),
              pytest.mark.slow]   # starts other processes (make test-fast skips it)


def _get(url: str):
    with urllib.request.urlopen(url, timeout=30) as r:
        body = r.read()
        return json.loads(body) if r.headers.get_content_type() == "application/json" else body


def _post(url: str, body: dict | bytes):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url + "/v1/completions", data=data)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _wait(pred, timeout: float, what: str, server: Server):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        assert server.proc.poll() is None, f"server died: {server.err.read_text()[-3000:]}"
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


REQUESTS = [
    {"prompt": "the quick brown fox", "max_tokens": 12, "temperature": 0.0, "seed": 1},
    {"prompt_token_ids": [256, 3, 19, 35, 51, 67, 83], "max_tokens": 12, "temperature": 0.0},
    {"prompt": "sampled with a seed", "max_tokens": 12, "temperature": 0.8, "seed": 7},
    {"prompt": "zzzz", "max_tokens": 12, "temperature": 1.0, "seed": 123},
    {"prompt": "nucleus", "max_tokens": 12, "temperature": 1.0, "seed": 9, "top_p": 0.7,
     "top_k": 20},
]
for _b in REQUESTS:
    _b["return_token_ids"] = True


def _reference_tokens(argv: list[str]) -> list[list[int]]:
    """Same requests through the single-process reference model (every expert local) of the
    checkpoint the server generated (same flags -> same cache folder), with its tokenizer."""
    from xllm_eplb.engine.protocol import ApiLimits, ServedModel, parse_completion
    from xllm_eplb.engine.tokenizer import load_tokenizer
    from xllm_eplb.flags import load_config
    from xllm_eplb.model.batch import RankBatch, SeqRow
    from xllm_eplb.model.decoder import Decoder
    from xllm_eplb.model.default_checkpoint import with_default_checkpoint

    cfg, _ = load_config(argv)
    cfg = with_default_checkpoint(cfg)
    model = Decoder.reference(cfg)
    tok = load_tokenizer(cfg.model.model)
    lim = ApiLimits(model.cfg.model.vocab_size, 512, model.cfg.model.max_position_embeddings)
    served = ServedModel("xllm-eplb", tok, lim)
    outs = []
    for i, body in enumerate(REQUESTS):
        r = parse_completion(body, served)
        toks, pos, seq = [], 0, list(r.prompts[0])
        while len(toks) < r.max_tokens:
            res = model.forward_step(RankBatch([SeqRow(i, seq, pos, pos == 0, r.temperature,
                                                       r.seeds[0], r.top_p, r.top_k)]))
            pos += len(seq)
            seq = [res.sampled[i]]
            toks.append(res.sampled[i])
            if toks[-1] in tok.eos_ids:
                break
        outs.append(toks)
    return outs


@pytest.mark.timeout(200)
def test_serve_rebalances_keeps_tokens_identical_and_stops_cleanly(start_server):
    flags = ["--eplb_update_interval=3", "--dtype=float64", "--workload=synthetic",
             "--workload_rate=6", "--workload_output_len=24", "--eplb_policy_kind=balanced",
             "--eplb_plan_on=tokens", "--log_stats_interval=1"]
    # #39: the default transport on one node is the shared memory: EPLB's moves and token
    # identity on it
    s = start_server(*flags)
    s.wait_ready()
    before = [_post(s.url, b) for b in REQUESTS]
    assert all(code == 200 for code, _ in before), before
    status = _wait(lambda: (lambda st: st if st["layers_committed"] >= 1 else None)(
        _get(s.url + "/eplb/status")), 90, "a committed layer", s)
    assert status["policy"] == "balanced" and status["generation"] >= 1
    after = [_post(s.url, b) for b in REQUESTS]
    tok = [[b["choices"][0]["token_ids"] for _, b in run] for run in (before, after)]
    assert tok[0] == tok[1]
    ref = _reference_tokens(["--config", str(ROOT / "configs" / "eplb.yaml"),
                             "--ep-size", "4", *flags])
    assert tok[0] == ref
    # balancedness of the recent window improves on the first full window
    st = _wait(lambda: (lambda st: st if st.get("initial_balancedness_mean") is not None and
                        st["balancedness_mean"] > st["initial_balancedness_mean"] else None)(
        _get(s.url + "/eplb/status")), 60, "balancedness above its start value", s)
    assert {"rounds", "layers_timed_out", "layer_in_flight", "last_policy_seconds",
            "slots_moved", "balancedness_min", "layers"} <= set(st)
    # the expert gauges refresh about once a second (engine/live_stats.py): scrape once they
    # have seen the committed placement, not a refresh that ran just before the commit
    def scrape_after_commit():
        f = {m.name: m for m in text_string_to_metric_families(_get(s.url + "/metrics").decode())}
        return f if max(x.value for x in f["xllm_eplb_hot_expert_replicas"].samples) >= 2 else None

    fams = _wait(scrape_after_commit, 10, "the hot-expert gauges after the commit", s)
    committed = [x.value for x in fams["xllm_eplb_rebalance_layers"].samples
                 if x.labels.get("result") == "committed" and x.name.endswith("_total")]
    assert committed and committed[0] >= 1
    # heartbeat ages from the components' own timestamps (never "now - 0")
    age = {(x.labels["component"], x.labels["rank"]): x.value
           for x in fams["xllm_eplb_heartbeat_age_seconds"].samples}
    want = {("rebalance_loop", "engine"), ("manager", "engine")}
    want |= {(c, str(r)) for c in ("executor", "p2p", "worker") for r in range(4)}
    assert want <= set(age) and all(0.0 <= v < 1e6 for v in age.values()), age
    assert st["policy_cpu_seconds"] > 0 and st["heartbeat_at"] > 0
    assert st["critical_path"]["manager_thread_cpu_s"] == st["policy_cpu_seconds"]
    # bad input: 4xx JSON, server keeps serving
    assert _post(s.url, b"{oops")[0] == 400
    assert _post(s.url, {"prompt": "x", "max_tokens": -3})[0] == 400
    assert _get(s.url + "/health")["status"] == "serving"
    engine_log = (s.log_dir / "engine.log").read_text()
    assert "EPLB rebalance" in engine_log and "EPLB placement benefit" in engine_log
    assert "update_expert_weight" in (s.log_dir / "rank0.log").read_text()
    _check_live_view(s, fams)
    _check_breakdown(s, engine_log)
    # graceful stop
    s.note_children()
    t0 = time.monotonic()
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(15) == 0
    assert time.monotonic() - t0 < 10
    time.sleep(0.3)
    assert s.alive() == [] and shm_objects(s.run_id) == []


STATS_LINE = re.compile(
    r"INFO engine engine stats prompt_tokens_per_s=[\d.]+ generation_tokens_per_s=([\d.]+) "
    r"running=\d+ waiting=\d+ kv_cache_usage=[\d.]+% balancedness=(0\.\d+|1\.000) "
    r"placement_epoch=(\d+) last_rebalance_s=([\d.]+|never)$")


def _check_breakdown(s: Server, engine_log: str) -> None:
    """#32: the step-time breakdown in /eplb/status tracks the loop's wall time (the test's
    own clock over 3 s) and names the slowest rank's model phases, the ring and the engine's
    phases; /metrics carries it as a counter per phase; the batch rows are logged once."""
    b0, t0 = _get(s.url + "/eplb/status")["step_breakdown"], time.monotonic()
    time.sleep(3.0)
    st = _get(s.url + "/eplb/status")
    b1, dt = st["step_breakdown"], time.monotonic() - t0
    assert abs((b1["wall_s"] - b0["wall_s"]) - dt) < 1.0, (b0["wall_s"], b1["wall_s"], dt)
    assert b1["steps"] > b0["steps"]
    assert abs(sum(b1["seconds"].values()) - b1["wall_s"]) < 1e-6
    phases = set(b1["seconds"])
    assert {"ring", "schedule", "http", "eplb_hooks", "experts"} <= phases, phases
    assert all(v >= 0 for v in b1["seconds"].values())
    assert len(b1["per_rank"]) == st["ep_size"]
    assert all(r["experts"] > 0 and r["wait"] > 0 for r in b1["per_rank"])
    # #39: the all-to-all per rank (this server: the default shm, 2 rounds per MoE layer)
    assert len(b1["all_to_all"]) == st["ep_size"]
    assert all(a["rounds"] > 0 and a["rounds_per_step"] == a["rounds"] / b1["steps"]
               and a["round_us"] > 0 for a in b1["all_to_all"]), b1["all_to_all"]
    assert all(a["rounds_per_step"] % 2 == 0 for a in b1["all_to_all"]), b1["all_to_all"]
    fams = {f.name: f for f in text_string_to_metric_families(_get(s.url + "/metrics").decode())}
    counted = {x.labels["phase"]: x.value for x in fams["xllm_eplb_step_phase_seconds"].samples
               if x.name.endswith("_total")}
    assert set(counted) >= phases and counted["ring"] >= b1["seconds"]["ring"] > 0
    assert engine_log.count("engine batch rows") == 1 and "rows=256" in engine_log
    assert st["batch"] == {"max_batch_size": 256, "waiting_for_slot": 0}


def _check_live_view(s: Server, fams: dict) -> None:
    """#27 live view: the console stats line every --log_stats_interval=1 s while the workload
    runs (balancedness and the last rebalance included), and the vLLM-style metrics plus the
    hot-expert view in /metrics. ``fams``: a /metrics scrape after the first commit."""
    lines = [m for m in map(STATS_LINE.search, s.err.read_text().splitlines()) if m]
    assert len(lines) >= 3, s.err.read_text()[-2000:]             # the console (stderr)
    assert any(float(m[1]) > 0 for m in lines)
    assert any(int(m[3]) >= 1 and m[4] != "never" for m in lines)  # after the first commit
    assert "engine stats " in (s.log_dir / "engine.log").read_text()
    def count(name):
        return sum(x.value for x in fams[name].samples if x.name == name + "_count")
    for h in ("xllm_eplb_time_per_output_token_seconds", "xllm_eplb_inter_token_latency_seconds",
              "xllm_eplb_request_queue_time_seconds", "xllm_eplb_batch_size",
              "xllm_eplb_tokens_per_step"):
        assert count(h) > 0, h
    # the synthetic workload (6 requests/s, 24 tokens each) leaves the batch empty between
    # requests when steps are fast: some scrape within 10 s sees caches in use
    def kv_in_use():
        f = {m.name: m for m in text_string_to_metric_families(_get(s.url + "/metrics").decode())}
        v = f["xllm_eplb_kv_cache_usage_ratio"].samples[0].value
        return v if 0 < v < 1 else None
    _wait(kv_in_use, 10, "the KV cache in use", s)
    hot = {(x.labels["layer"], x.labels["hot"]): x.value
           for x in fams["xllm_eplb_hot_expert_load_ratio"].samples}
    assert set(hot) == {(str(layer), str(k)) for layer in range(3) for k in range(4)}
    assert all(hot[(str(layer), "0")] >= hot[(str(layer), "3")] > 0 for layer in range(3))
    reps = [x.value for x in fams["xllm_eplb_hot_expert_replicas"].samples]
    assert len(reps) == 12 and all(r >= 1 for r in reps) and max(reps) >= 2   # EPLB replicated


@pytest.mark.timeout(90)
def test_killed_worker_stops_the_run_naming_the_rank(start_server):
    # steps in flight when the rank dies: every survivor fails its all-to-all
    import openai

    s = start_server("--workload=synthetic", "--workload_rate=20", "--enable_eplb=false",
                     "--elastic_ep=false")        # a death stops the run (not replaced)
    s.wait_ready()
    # a streaming client in flight is told which rank died, not "server shutting down" (#26)
    c = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=60)
    stream = iter(c.completions.create(model="xllm-eplb", prompt="go", max_tokens=1000,
                                       stream=True, extra_body={"ignore_eos": True}))
    next(stream)
    time.sleep(1.0)
    victim = next(p for p in psutil.Process(s.proc.pid).children()
                  if "ep2" in " ".join(p.cmdline()))
    t0 = time.monotonic()
    victim.kill()
    with pytest.raises(openai.APIError) as told:
        for _ in stream:
            pass
    rc = s.proc.wait(15)
    assert rc != 0 and time.monotonic() - t0 < 10
    err = s.err.read_text()
    assert "rank 2" in err and "SIGKILL" in err
    assert f"rank 2 (pid {victim.pid}) died during serving: killed by SIGKILL" in str(told.value)
    # the console's summary line and the launcher log say the same thing, stamp included
    line = next(ln for ln in err.splitlines() if ln.startswith("error:"))
    assert line[len("error: "):] in (s.log_dir / "launcher.log").read_text().replace('\\"', '"')
    assert "(seen at " in line
    # one summary line on the console; the survivors' tracebacks only in their rank logs
    assert [ln for ln in err.splitlines() if ln.startswith("error:")] == [
        next(ln for ln in err.splitlines() if "died during serving" in ln)], err[-3000:]
    assert "Traceback" not in err and "worker step failed" not in err, err[-3000:]
    # the death is said once on the console (the launcher's own log line is file-only)
    assert sum("SIGKILL" in ln for ln in err.splitlines()) == 1, err[-3000:]
    assert "launcher child died" in (s.log_dir / "launcher.log").read_text()
    time.sleep(0.3)
    assert s.alive() == [] and shm_objects(s.run_id) == []


@pytest.mark.timeout(90)
def test_sigterm_to_the_whole_process_group_is_a_clean_stop(start_server):
    # timeout(1), systemd and container runtimes signal every process of the group at once
    s = start_server("--workload=none", "--enable_eplb=false")
    s.wait_ready()
    t0 = time.monotonic()
    os.killpg(s.proc.pid, signal.SIGTERM)
    rc = s.proc.wait(15)
    assert rc == 0 and time.monotonic() - t0 < 10, s.err.read_text()[-2000:]
    assert "died during serving" not in s.err.read_text()
    time.sleep(0.3)
    assert s.alive() == [] and shm_objects(s.run_id) == []


@pytest.mark.timeout(90)
def test_sigterm_during_the_engine_warmup_is_a_clean_stop(start_server):
    # issue 35 item 8: a script's `serve ... & kill -TERM $!` a few seconds in lands in the
    # engine's warm-up, a wait on the workers' output rings; posix_ipc swallowed the exit its
    # SIGTERM handler raised there, so the engine served on and was SIGKILLed (exit 1)
    s = start_server("--workload=none", base=["--ep-size", "2"])
    deadline = time.monotonic() + 60
    while "engine=rings" not in s.err.read_text():
        assert s.proc.poll() is None and time.monotonic() < deadline, s.err.read_text()
        time.sleep(0.05)
    time.sleep(0.5)                    # the engine is in its warm-up, the workers are starting
    with pytest.raises(urllib.error.HTTPError) as e:   # /health while starting: 503, EPLB on
        _get(s.url + "/health")
    body = json.loads(e.value.read())
    assert e.value.code == 503 and body["status"] == "starting" and body["eplb"] is True, body
    s.note_children()
    s.proc.send_signal(signal.SIGTERM)
    rc = s.proc.wait(30)
    err = s.err.read_text()
    logs = "\n".join(p.read_text()[-1500:] for p in sorted(s.log_dir.glob("*.log")))
    assert rc == 0 and "killed (SIGKILL)" not in err, f"rc={rc}\n{err[-2000:]}\n{logs}"
    assert "engine exit code=0" in (s.log_dir / "engine.log").read_text()
    time.sleep(0.3)
    assert s.alive() == [] and shm_objects(s.run_id) == []


@pytest.mark.timeout(90)
def test_killed_launcher_takes_its_children_and_shm_with_it(start_server, tmp_path):
    # a dead run's leftovers (every process SIGKILLed): the next serve sweeps them (#23 item 11)
    from test_shm_hygiene import OLD, _age, _killed_creator, _names, _rid

    dead = _rid()
    _killed_creator(dead)
    _age(dead, OLD)
    s = start_server("--workload=none", "--enable_eplb=false")
    s.wait_ready()
    assert shm_objects(s.run_id)
    assert _names(dead) == []
    swept = [ln for ln in (s.log_dir / "launcher.log").read_text().splitlines()
             if "shm swept dead runs" in ln]
    assert len(swept) == 1 and dead in swept[0], swept
    # the launcher's event channel is pipes: no process of the run maps a named semaphore of
    # multiprocessing (a SIGKILLed launcher and its resource tracker would leave sem.mp-*)
    s.note_children()
    for pid in s.alive():
        assert "/dev/shm/sem.mp-" not in Path(f"/proc/{pid}/maps").read_text(), pid
    # a stream in flight is told at once that the launcher is gone (elastic EP is on by
    # default: a dead launcher is not a worker's death to recover from; issue #35 item 3)
    import openai

    c = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=30)
    stream = iter(c.completions.create(model="xllm-eplb", prompt="go", max_tokens=1000,
                                       stream=True, extra_body={"ignore_eos": True}))
    next(stream)
    s.proc.kill()                                   # SIGKILL: no handler, no cleanup
    t0 = time.monotonic()
    with pytest.raises(openai.APIError) as told:
        for _ in stream:
            pass
    waited = time.monotonic() - t0
    print("LAUNCHER_KILL", {"client_error_s": round(waited, 3), "error": str(told.value)})
    assert "the launcher (pid " in str(told.value) and "is gone" in str(told.value), told.value
    assert waited < 2.0, waited
    s.proc.wait(5)
    engine_log = (s.log_dir / "engine.log").read_text()
    assert "engine stop signal=SIGUSR1 launcher=gone" in engine_log, engine_log[-2000:]
    deadline = time.monotonic() + 10
    while (s.alive() or shm_objects(s.run_id)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert s.alive() == [] and shm_objects(s.run_id) == []


@pytest.mark.timeout(30)
def test_port_in_use_fails_before_any_worker_starts(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        p = subprocess.run([sys.executable, "-m", "xllm_eplb", "serve", "--ep-size", "4",
                            "--config", str(ROOT / "configs" / "eplb.yaml"), "--port", str(port),
                            "--log_dir", str(tmp_path / "logs")], cwd=ROOT, capture_output=True,
                           text=True, timeout=25)
    assert p.returncode == 2, p.stderr
    assert f"--port={port}" in p.stderr and "xllm-eplb ready" not in p.stdout
    assert not list((tmp_path / "logs").glob("**/rank0.log"))
    assert shm_objects(f"p{port}") == []
