"""The record -> plan -> deploy loop on real `xllm-eplb serve` process groups (a generated
HF-format checkpoint, 4 ranks, gloo): `/eplb/record/*` counts exactly the routed token-expert
picks, its dump goes through `xllm-eplb plan` and `simulate` as it is, and servers started from
the plan (EPLB off and on) report that placement and give the default layout's greedy tokens.
Each rank of a worker group built from the plan holds exactly its slots of it."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from xllm_eplb.eplb.placement import initial_phy2log
from xllm_eplb.sim.trace import load_trace
from xllm_eplb.testing.serving import ROOT, Server, shm_objects

pytestmark = [pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs POSIX shm"),
              pytest.mark.slow]

E, D, R, TOP_K, MOE_LAYERS = 16, 4, 1, 2, 2
PROMPTS = [[5, 17, 300, 42, 8, 9, 100, 77, 23], [7, 3], [11, 12, 13, 14, 15], [401] * 12]
N_NEW = 8
#: the example config's EPLB/workload settings off: no traffic but ours, every token counted
QUIET = ["--workload=none", "--eplb_use_decode_only_load=false"]


def _http(method: str, url: str, body: dict | None = None):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            raw, ctype = r.read(), r.headers.get_content_type()
            return r.status, (json.loads(raw) if ctype == "application/json" else raw)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _greedy(url: str) -> tuple[list[list[int]], int]:
    """Token ids of PROMPTS (one at a time) and the tokens the model forwarded for them."""
    out, fed = [], 0
    for p in PROMPTS:
        code, body = _http("POST", url + "/v1/completions", {
            "prompt": p, "max_tokens": N_NEW, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True})
        assert code == 200, body
        out.append(body["choices"][0]["token_ids"])
        u = body["usage"]
        fed += u["prompt_tokens"] + u["completion_tokens"] - 1   # the last token is not fed
    return out, fed


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "xllm_eplb", *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout + r.stderr
    return r


class _Servers:
    """Servers of one test module; each killed and its shm swept even on failure."""

    def __init__(self, root: Path):
        self.root, self.all = root, []

    def start(self, *args: str) -> Server:
        d = self.root / f"s{len(self.all)}"
        d.mkdir()
        s = Server.launch(d, list(args))
        self.all.append(s)
        s.wait_ready(240)
        return s

    def stop(self, s: Server) -> None:
        """A graceful stop (SIGTERM): exit 0, every process gone, the run's shm removed."""
        s.note_children()
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(60) == 0, s.err.read_text()[-3000:]
        deadline = time.monotonic() + 20
        while s.alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert s.alive() == [] and shm_objects(s.run_id) == []


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    sv = _Servers(tmp_path_factory.mktemp("servers"))
    yield sv
    for s in sv.all:
        s.kill()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from xllm_eplb.model.checkpoint import make_checkpoint

    return make_checkpoint("deepseek_v3", tmp_path_factory.mktemp("ckpt") / "tiny",
                           num_layers=3, first_k_dense=1, num_experts=E, top_k=TOP_K)


@pytest.fixture(scope="module")
def recorded(servers, ckpt, tmp_path_factory):
    """Server A (default layout, EPLB off): the record API's rules, a recording of PROMPTS, the
    dump and the trace written to files."""
    d = tmp_path_factory.mktemp("record")
    s = servers.start("--model", str(ckpt), "--noenable_eplb", *QUIET)
    u = s.url + "/eplb/record"
    for method, path in (("GET", "/dump"), ("POST", "/stop")):
        code, body = _http(method, u + path)
        assert code == 409 and body["error"]["type"] == "conflict", body
    code, body = _http("POST", u + "/start", {"trace": "yes"})
    assert code == 400 and body["error"]["param"] == "trace", body
    code, body = _http("POST", u + "/start", {"trace": True})
    assert code == 200 and body["recording"] is True and body["steps"] == 0, body
    assert _http("POST", u + "/start")[0] == 409
    tokens, fed = _greedy(s.url)
    code, stopped = _http("POST", u + "/stop")
    assert code == 200 and stopped["recording"] is False and stopped["steps"] > 0, stopped
    _greedy(s.url)                                  # after stop: not counted
    code, dump = _http("GET", u + "/dump")
    assert code == 200 and dump["steps"] == stopped["steps"], dump
    code, npz = _http("GET", u + "/dump?format=npz")
    assert code == 200 and isinstance(npz, bytes)
    assert _http("GET", u + "/dump?format=csv")[0] == 400
    status = _http("GET", s.url + "/eplb/status")[1]
    servers.stop(s)
    (d / "dump.json").write_text(json.dumps(dump))
    (d / "trace.npz").write_bytes(npz)
    return dict(dir=d, tokens=tokens, fed=fed, dump=dump, status=status)


@pytest.mark.timeout(420)
def test_recording_counts_every_routed_pick(recorded):
    dump, st = recorded["dump"], recorded["status"]
    counts = np.asarray(dump["logical_count"])
    assert counts.shape == (MOE_LAYERS, E)
    # every forwarded token picks top_k experts in every MoE layer, nothing else is counted
    assert counts.sum(axis=1).tolist() == [TOP_K * recorded["fed"]] * MOE_LAYERS
    tr = load_trace(recorded["dir"] / "trace.npz")             # what `simulate --trace` reads
    assert tr.loads.shape == (dump["steps"], MOE_LAYERS, E)
    assert tr.loads.sum(axis=0).tolist() == dump["logical_count"]
    assert st["record"]["recording"] is False and st["record"]["steps"] == dump["steps"]
    assert st["placement"] == [initial_phy2log(E, D, R).tolist()] * MOE_LAYERS
    assert st["enabled"] is False and st["init_placement"] == ""


@pytest.fixture(scope="module")
def plan(recorded):
    d = recorded["dir"]
    out = _cli("plan", "--load", str(d / "dump.json"), "--ep-size", str(D),
               "--redundant-experts-num", str(R), "--output", str(d / "placement.json"))
    assert "output=" in out.stdout
    return d / "placement.json"


@pytest.mark.timeout(420)
def test_the_dump_plans_and_simulates_as_it_is(recorded, plan, tmp_path):
    p = json.loads(plan.read_text())
    assert p["moe_layers"] == [0, MOE_LAYERS] and p["dense_layers_skipped"] == 0
    assert p["num_logical_experts"] == E and p["ep_size"] == D
    assert p["phy2log"] != [initial_phy2log(E, D, R).tolist()] * MOE_LAYERS
    d = recorded["dir"]
    r = _cli("simulate", "--trace", str(d / "trace.npz"), "--ep-size", str(D), "--no-plots",
             "--out", str(tmp_path / "a"))
    assert f"steps={recorded['dump']['steps']}" in r.stdout
    r = _cli("simulate", "--generate", f"sglang:{d / 'dump.json'},steps=20,tokens=64,topk=2",
             "--ep-size", str(D), "--no-plots", "--out", str(tmp_path / "b"))
    assert "steps=20" in r.stdout


@pytest.mark.timeout(420)
@pytest.mark.parametrize("eplb", ["--noenable_eplb", "--enable_eplb"])
def test_a_server_started_from_the_plan(eplb, servers, recorded, plan, ckpt):
    s = servers.start("--model", str(ckpt), eplb, f"--eplb_init_placement={plan}",
                      "--eplb_update_interval=100000", "--eplb_first_round_samples=0", *QUIET)
    want = json.loads(plan.read_text())["phy2log"]
    st = _http("GET", s.url + "/eplb/status")[1]
    assert st["placement"] == want and st["init_placement"] == str(plan)
    assert st["enabled"] is (eplb == "--enable_eplb")
    tokens, _ = _greedy(s.url)
    assert tokens == recorded["tokens"]
    st = _http("GET", s.url + "/eplb/status")[1]
    assert st["placement"] == want and st["generation"] == 0
    servers.stop(s)


def _rank_slots(rank, world, cfg):
    from xllm_eplb.model.decoder import build_model
    from xllm_eplb.model.loader import expert_weights
    from xllm_eplb.worker.comm import groups_from_world

    model = build_model(cfg, rank, groups_from_world(cfg).ep_group)
    same = []
    for fm in model.moe_layers:
        for s, e in enumerate(fm.tag[:, 0].tolist()):
            w = expert_weights(model.spec, model.reader, model.spec.moe_layers[fm.layer_id], e,
                               model.dtype)
            same.append(bool((fm.w13[s] == w["w13"]).all() and (fm.w2[s] == w["w2"]).all()))
    return {"ids": [fm.local_expert_ids.tolist() for fm in model.moe_layers],
            "tags": [fm.tag[:, 0].tolist() for fm in model.moe_layers],
            "layers": [fm.tag[:, 1].tolist() for fm in model.moe_layers], "same": same}


@pytest.mark.timeout(240)
def test_each_rank_loads_exactly_its_slots_of_the_plan(plan, ckpt):
    from xllm_eplb.config import Config, EplbConfig, ModelConfig
    from xllm_eplb.model.resolve import resolve_config
    from xllm_eplb.testing.dist import run_ranks

    cfg = resolve_config(Config(eplb=EplbConfig(ep_size=D, eplb_init_placement=str(plan)),
                                model=ModelConfig(model=str(ckpt))))
    want = np.asarray(json.loads(plan.read_text())["phy2log"])
    S = E // D + R
    for rank, got in enumerate(run_ranks(_rank_slots, D, cfg, timeout=200)):
        mine = want[:, rank * S:(rank + 1) * S].tolist()
        assert got["ids"] == mine and got["tags"] == mine
        assert got["layers"] == [[ml] * S for ml in range(MOE_LAYERS)]
        assert all(got["same"])
