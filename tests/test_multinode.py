"""Multi-node serving (#14) on one machine: two `serve --nnodes 2` launchers on loopback
(EP4 = 2 + 2) against a single-node EP4 run of the same generated checkpoint; faults, shm
isolation and the rendezvous checks; elastic EP across nodes (respawn in place: a worker killed
or stopped on either node, tokens unchanged; a lost node stops cleanly). Every cluster is killed
and swept even on failure."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest
from node_util import Cluster, Node, mapped_shm
from test_serve import _get, _post

from xllm_eplb.config import Config, EplbConfig, RuntimeConfig, node_of_rank, node_ranks, validate
from xllm_eplb.errors import ConfigError
from xllm_eplb.node.rendezvous import fingerprint, mismatch

PROMPTS = [[5, 17, 300, 42, 8, 9, 100, 77, 23], [7, 3], [11, 12, 13, 14, 15]]
N_NEW = 16
#: EPLB rounds every 3 s on the synthetic workload, every layer published
EPLB_FLAGS = ["--eplb_update_interval=3", "--workload=synthetic", "--workload_rate=6",
              "--workload_output_len=16", "--workload_prompt_len=8",
              "--eplb_min_peak_load_improvement=0", "--eplb_policy_kind=balanced",
              "--eplb_plan_on=tokens"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """One generated deepseek_v3-format checkpoint (`xllm-eplb make-checkpoint`)."""
    from xllm_eplb.model.checkpoint import make_checkpoint

    return make_checkpoint("deepseek_v3", tmp_path_factory.mktemp("mn") / "ckpt", seed=3)


@pytest.fixture
def cluster(tmp_path):
    made: list[Cluster] = []

    def start(*args: str, per_node: dict | None = None, nnodes: int = 2) -> Cluster:
        c = Cluster(tmp_path / f"c{len(made)}", nnodes, list(args), per_node)
        made.append(c)
        return c

    yield start
    for c in made:
        c.kill()


def _tokens(url: str) -> list[list[int]]:
    out = []
    for p in PROMPTS:
        code, body = _post(url, {"prompt": p, "max_tokens": N_NEW, "temperature": 0.0,
                                 "ignore_eos": True, "return_token_ids": True})
        assert code == 200, body
        out.append(body["choices"][0]["token_ids"])
    return out


def _cross_node_bytes(url: str) -> float:
    text = _get(url + "/metrics").decode()
    return sum(float(v) for v in re.findall(
        r'^xllm_eplb_p2p_cross_node_bytes_total\{node="\d+"\} (\S+)$', text, re.M))


def _until(pred, timeout: float, what: str, c: Cluster):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        for n in c.nodes:
            assert n.proc.poll() is None, f"node {n.node} died: {n.err.read_text()[-3000:]}"
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


# --- config and rendezvous rules (fast) -----------------------------------------------------

def _cfg(**rt) -> Config:
    return Config(eplb=EplbConfig(ep_size=4), runtime=RuntimeConfig(**rt))


def test_topology_rules_name_the_flag():
    with pytest.raises(ConfigError, match=r"--nnodes=3: must divide --ep_size=4"):
        validate(_cfg(nnodes=3, master_port=29500))
    with pytest.raises(ConfigError, match=r"--node_rank=2: must be < --nnodes=2"):
        validate(_cfg(nnodes=2, node_rank=2, master_port=29500))
    with pytest.raises(ConfigError, match=r"--master_port=0: must be set"):
        validate(_cfg(nnodes=2))
    cfg = validate(_cfg(nnodes=2, node_rank=1, master_port=29500))
    assert list(node_ranks(cfg)) == [2, 3] and list(node_ranks(cfg, 0)) == [0, 1]
    assert [node_of_rank(cfg, r) for r in range(4)] == [0, 0, 1, 1]


def test_fingerprint_mismatch_names_the_field():
    a = fingerprint(_cfg(nnodes=2, master_port=1))
    b = fingerprint(Config(eplb=EplbConfig(ep_size=4, redundant_experts_num=2),
                           runtime=RuntimeConfig(nnodes=2, master_port=1)))
    assert mismatch(a, a, 1) is None
    assert mismatch(a, b, 1) == ("node 1 refused at rendezvous: --redundant_experts_num=2 "
                                 "there, --redundant_experts_num=1 on node 0 (every node must "
                                 "run with the same config)")


def test_elastic_notices_of_a_remote_node_reach_node0_in_order():
    """Node n's launcher queues its notices for the engine in node 0's store; node 0's
    launcher forwards them in order, each once (real TCPStore, real pipes)."""
    import multiprocessing as mp

    from xllm_eplb.elastic.notices import JoinDropped, WorkerDied
    from xllm_eplb.launcher.events import EventHub
    from xllm_eplb.node.launcher import NoticeForwarder, NoticeSender
    from xllm_eplb.node.rendezvous import open_store
    from xllm_eplb.testing.serving import free_port

    cfg0 = _cfg(nnodes=2, master_addr="127.0.0.1", master_port=free_port())
    store0 = open_store(cfg0, master=True)
    store1 = open_store(cfg0, master=False)
    ctx = mp.get_context("spawn")
    hub0, hub1 = EventHub(ctx), NoticeSender(ctx, store1, 1)
    engine = hub0.sender("engine")          # the engine's end of node 0's channel
    fwd = NoticeForwarder(store0, 2)
    assert fwd.pump(hub0) == 0
    died = WorkerDied(2, "node 1: rank 2 died", 2, 1.5, "respawn")
    assert hub1.notify("engine", died)
    assert hub1.notify("engine", JoinDropped(2, "timeout"))
    assert fwd.pump(hub0) == 2 and fwd.pump(hub0) == 0
    assert engine.notice(1.0) == died
    assert engine.notice(1.0) == JoinDropped(2, "timeout")
    assert engine.notice(0.0) is None
    hub0.close()
    engine.close()


# --- two launchers on loopback (slow) -------------------------------------------------------

@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_nodes_match_one_node_across_cross_node_moves(ckpt, start_server, cluster):
    one = start_server("--model", str(ckpt), *EPLB_FLAGS)
    one.wait_ready(240)
    want = _tokens(one.url)
    one.kill()

    c = cluster("--model", str(ckpt), *EPLB_FLAGS)
    c.wait_ready(300)
    st = _get(c.url + "/eplb/status")
    assert st["nnodes"] == 2 and st["rank_node"] == [0, 0, 1, 1]
    assert _tokens(c.url) == want
    # every node maps only its own shm names (node 1 never touches node 0's)
    for n in c.nodes:
        n.note_children()
        names = set().union(*(mapped_shm(p) for p in n.pids))
        assert names, f"node {n.node} maps no shm object"
        assert all(f"_{c.run_id}-n{n.node}_" in s for s in names), sorted(names)
    _until(lambda: _get(c.url + "/eplb/status")["layers_committed"] >= 2, 240,
           "two committed layers", c)
    _until(lambda: _cross_node_bytes(c.url) > 0, 120, "expert bytes crossing nodes", c)
    assert _tokens(c.url) == want
    moves = [ln for ln in (c.nodes[1].log_dir / "node1" / "latest" / "rank2.log").read_text().splitlines()
             + (c.nodes[1].log_dir / "node1" / "latest" / "rank3.log").read_text().splitlines()
             if "update_expert_weight" in ln and "cross_node_bytes=" in ln]
    assert moves, "no update_expert_weight line on node 1"
    # SIGTERM to node 0 stops the whole run cleanly
    os.kill(c.nodes[0].proc.pid, signal.SIGTERM)
    assert c.wait_exit(60) == [0, 0], [n.err.read_text()[-2000:] for n in c.nodes]
    assert c.leftovers() == ([], [])


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_kill9_of_node0_launcher_stops_node1(ckpt, cluster):
    c = cluster("--model", str(ckpt), "--workload=synthetic", "--workload_rate=4")
    c.wait_ready(300)
    t0 = time.monotonic()
    os.kill(c.nodes[0].proc.pid, signal.SIGKILL)
    codes = c.wait_exit(10)
    assert time.monotonic() - t0 <= 10.5 and codes[1] not in (None, 0), codes
    err = c.nodes[1].err.read_text()
    assert re.search(r"^error: node 0: control link lost", err, re.M), err[-2000:]
    # node 0's engine sweeps node 0's shm on its way out
    assert c.leftovers(grace=8) == ([], [])


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_worker_death_on_node1_is_named_on_every_node(ckpt, cluster):
    c = cluster("--model", str(ckpt), "--workload=synthetic", "--workload_rate=4",
                "--elastic_ep=false")             # a death stops every node (not respawned)
    c.wait_ready(300)
    ep2 = next(p for p in c.nodes[1].pids if _title(p) == "xllm-eplb:ep2")
    t0 = time.monotonic()
    os.kill(ep2, signal.SIGKILL)
    codes = c.wait_exit(10)
    assert time.monotonic() - t0 <= 10.5 and all(x not in (None, 0) for x in codes), codes
    for n in c.nodes:
        err = n.err.read_text()
        assert re.search(r"^error: node 1: rank 2 \(pid \d+\) died during serving: killed by "
                         r"SIGKILL", err, re.M), (n.node, err[-2000:])
    assert c.leftovers() == ([], [])


def _title(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/cmdline").read().split("\0")[0]
    except OSError:
        return ""


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_mismatched_node_is_refused_and_node0_times_out(ckpt, cluster):
    c = cluster("--model", str(ckpt), "--rendezvous_timeout_seconds=20",
                per_node={1: ["--redundant_experts_num=2"]})
    n0, n1 = c.nodes
    assert n1.proc.wait(120) == 2
    assert ("error: node 1 refused at rendezvous: --redundant_experts_num=2 there, "
            "--redundant_experts_num=1 on node 0") in n1.err.read_text()
    assert n0.proc.wait(120) == 2
    err = n0.err.read_text()
    assert "xllm-eplb start waiting for node 1 at 127.0.0.1:" in err
    assert "warning: node 1 refused at rendezvous: --redundant_experts_num=2" in err
    assert re.search(r"^error: rendezvous: node 1 did not join 127\.0\.0\.1:\d+ within "
                     r"--rendezvous_timeout_seconds=20$", err, re.M), err[-2000:]
    assert c.leftovers() == ([], [])


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_node1_without_node0_times_out(ckpt, tmp_path):
    from xllm_eplb.testing.serving import free_port

    n1 = Node(tmp_path, 1, 2, free_port(), free_port(),
              ["--model", str(ckpt), "--rendezvous_timeout_seconds=3"])
    try:
        assert n1.proc.wait(90) == 2
        assert re.search(r"^error: rendezvous: no node 0 at 127\.0\.0\.1:\d+ within "
                         r"--rendezvous_timeout_seconds=3", n1.err.read_text(), re.M), \
            n1.err.read_text()[-2000:]
    finally:
        n1.kill()


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_elastic_workers_on_either_node_are_respawned_and_no_request_is_lost(ds8_ckpt, cluster):
    """``--elastic_ep`` across nodes (respawn in place, ``node/launcher.py``): rank 2 on node 1,
    then rank 1 on node 0, SIGKILLed under streams, then rank 3 on node 1 SIGSTOPped (node 1's
    relay finds it silent after ``--elastic_silence_seconds``, its launcher SIGKILLs it); its
    node's launcher respawns it, the engine on node 0 hears of it (node 1's notice through the
    store), fences the step and re-forms the next generation; every stream ends with the tokens
    of the same requests before the faults (float64, greedy and seeded). Then an ordinary stop
    leaves nothing."""
    import openai
    from test_elastic_serve import PROMPTS as STREAMS
    from test_elastic_serve import Streams, _kw

    c = cluster("--model", str(ds8_ckpt), "--dtype=float64", "--workload=none",
                "--enable_eplb=false", "--elastic_ep=true", "--elastic_rejoin=false",
                "--redundant_experts_num=1", "--max_batch_size=4",
                "--elastic_silence_seconds=2")
    c.wait_ready(300)
    client = openai.OpenAI(base_url=c.url + "/v1", api_key="none", max_retries=0, timeout=120)
    ref = [client.completions.create(**_kw(i)).choices[0].model_extra["token_ids"]
           for i in range(len(STREAMS))]
    faults = ((2, 1, 2, signal.SIGKILL), (3, 0, 1, signal.SIGKILL), (4, 1, 3, signal.SIGSTOP))
    for gen, node, rank, sig in faults:
        c.nodes[node].note_children()
        victim = next(p for p in c.nodes[node].alive() if _title(p) == f"xllm-eplb:ep{rank}")
        st = Streams(client)
        st.wait_tokens(4)
        t_kill = time.monotonic()
        os.kill(victim, sig)
        st.join()
        assert st.errors == [], (st.errors, c.nodes[0].err.read_text()[-3000:])
        assert st.toks == ref                       # none repeated, skipped or changed
        m = _get(c.url + "/eplb/status")["membership"]
        assert m["generation"] == gen and m["recoveries"] == gen - 1, m
        lr = m["last_recovery"]
        assert lr["rank"] == rank and lr["mode"] == "respawn", lr
        assert lr["requests_reprefilled"] >= 1, lr
        # kill -> the next token of every stream (docs/reliability.md)
        nxt = max(next(t for t in ts if t > t_kill) - t_kill for ts in st.times)
        print("MULTINODE_ELASTIC", {"node": node, "signal": sig.name,
                                    "kill_to_next_token_s": round(nxt, 3),
                                    "pause_s": round(st.pause(t_kill), 3), "recovery": lr})
    n1 = (c.nodes[1].log_dir / "node1" / "latest" / "launcher.log").read_text()
    assert "EPLB elastic detect proc=ep2" in n1 and "mode=respawn" in n1, n1[-2000:]
    assert "EPLB elastic fence silent worker proc=ep3" in n1, n1[-2000:]
    assert all("error:" not in n.err.read_text() for n in c.nodes)   # replaced, no failure
    # an ordinary stop afterwards: both nodes exit 0, nothing left (the respawned workers too)
    for n in c.nodes:
        n.note_children()
    os.kill(c.nodes[0].proc.pid, signal.SIGTERM)
    assert c.wait_exit(60) == [0, 0], [n.err.read_text()[-2000:] for n in c.nodes]
    assert c.leftovers() == ([], [])


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_elastic_loss_of_node1_stops_every_node_cleanly(ds8_ckpt, cluster):
    """kill -9 of node 1's launcher stops every node, naming the link; with ``--elastic_ep`` too:
    a whole node lost is not recovered (no launcher is left there to respawn its ranks). The
    stop is the same code with elasticity off (node 0's hub: ``control link lost``; node 1's
    relay sweeps node 1's shm once its workers, SIGKILLed with the launcher, unmap), so one
    test covers both."""
    c = cluster("--model", str(ds8_ckpt), "--workload=synthetic", "--workload_rate=4",
                "--elastic_ep=true", "--elastic_rejoin=false", "--redundant_experts_num=1")
    c.wait_ready(300)
    time.sleep(2)
    t0 = time.monotonic()
    os.kill(c.nodes[1].proc.pid, signal.SIGKILL)
    codes = c.wait_exit(15)
    print("MULTINODE_NODE_LOSS", {"stop_s": round(time.monotonic() - t0, 3), "codes": codes})
    assert codes[0] not in (None, 0), codes
    err = c.nodes[0].err.read_text()
    assert re.search(r"^error: node 1: control link lost", err, re.M), err[-2000:]
    assert c.leftovers(grace=12) == ([], [])
