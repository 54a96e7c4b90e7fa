"""Elastic rejoin (issue #23 item 8) black-box on a real `xllm-eplb serve --elastic_ep=true` at
EP4 with the default `--elastic_restart=true --elastic_rejoin=true` (real processes, shm, gloo):
a worker SIGKILLed in the middle of streams -> the survivors shrink to 3 ranks at once and keep
serving while the replacement loads in the background -> it joins at a step boundary as compact
rank 3 (EP4 again, the EPLB manager rebuilt, every expert covered, the canary passed); every
stream, before, during and after the switch, has exactly the tokens of a fault-free run
(float64). Then a joiner killed while loading is replaced by another joiner; a serving rank's
death while a joiner loads drops that joiner and shrinks again (3 -> 2), and the dropped joiner
is started again and joins (2 -> 3); a joiner that is not ready within
`--elastic_join_timeout_seconds` (an injected `join_delay`) is dropped: no rank changes
generation, 3 ranks keep serving. Nothing is left."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import openai
import psutil
import pytest
from test_elastic_serve import PROMPTS, Streams, _fault, _kept_kv, _kw, _status, _worker
from test_elastic_shrink import _covers_all, _metrics

from xllm_eplb.testing.serving import shm_objects

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs POSIX shm")]


def _until(s, pred, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        st = _status(s)
        if pred(st["membership"]) or time.monotonic() > deadline:
            return st
        time.sleep(0.1)


def _joiner(s, worker: int, timeout: float = 30) -> psutil.Process:
    """The joiner of ``worker`` once it has its process title (it is set after the imports)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return _worker(s, worker)
        except (StopIteration, psutil.Error):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _streams_match(client, ref, what: str) -> None:
    st = Streams(client)
    st.join()
    assert st.errors == [], (what, st.errors)
    for i, toks in enumerate(st.toks):
        assert toks == ref[i], (what, i, toks, ref[i])


@pytest.mark.timeout(420)
def test_killed_worker_rejoins_while_the_survivors_serve(ds8_ckpt, start_server):
    s = start_server("--ep-size", "4", "--model", str(ds8_ckpt), "--dtype=float64",
                     "--workload=none", "--enable_eplb=true", "--eplb_canary=true",
                     "--elastic_ep=true", "--redundant_experts_num=2",
                     "--elastic_silence_seconds=2", "--max_batch_size=4",
                     "--elastic_join_timeout_seconds=20", "--elastic_max_restarts=5",
                     "--enable_fault_injection=true",
                     "--fault_inject=join_delay:rank=1,seconds=5",
                     "--fault_inject=join_delay:rank=3,seconds=600")
    s.wait_ready(240)
    client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=120)
    ref = [client.completions.create(**_kw(i)).choices[0].model_extra["token_ids"]
           for i in range(len(PROMPTS))]
    # kill ep2 mid-stream: shrink to 3 at once, every stream identical
    got = _fault(s, client, ref, _worker(s, 2).kill, "kill ep2")
    m = _status(s)["membership"]
    assert m["shrinks"] == 1 and m["last_recovery"]["mode"] == "rejoin", m
    _kept_kv(m, 4)
    # streams keep running (and matching) while the joiner loads and joins
    rounds = 0
    while _status(s)["membership"]["joins"] < 1 and rounds < 30:
        _streams_match(client, ref, f"while joining, round {rounds}")
        rounds += 1
    st = _until(s, lambda m: m["joins"] >= 1, 60)
    m = st["membership"]
    assert st["ep_size"] == m["ep_size"] == 4 and m["workers"] == [0, 1, 3, 2], m
    assert m["ranks_active"] == [0, 1, 2, 3] and m["joining"] == [], m
    assert m["generation"] == 3 and m["joins"] == 1, m
    j = m["last_join"]
    assert j["worker"] == "ep2" and j["ep_size"] == "3->4" and j["generation"] == 3, j
    assert j["pause_s"] < 5 and j["start_to_serving_s"] < 60, j
    assert st["enabled"], st             # the EPLB manager rebuilt for 4 ranks
    _covers_all(st["placement"], 4)
    for row in st["placement"]:          # the joiner's slots: no expert twice
        assert len(set(row[12:16])) == 4, row
    active = {k[1][0][1]: v for k, v in _metrics(s).items() if k[0] == "xllm_eplb_rank_active"}
    assert active == {str(r): 1.0 for r in range(4)}, active
    fams = _metrics(s)
    assert fams[("xllm_eplb_ep_size", ())] == 4 and fams[("xllm_eplb_generation", ())] == 3
    _streams_match(client, ref, "after the join")        # the joiner serves its share
    engine_log = (s.log_dir / "engine.log").read_text()
    assert "EPLB elastic rejoin " in engine_log and "pause_s=" in engine_log
    assert "canary=ok" in (s.log_dir / "rank2.log").read_text()
    print("ELASTIC_REJOIN", json.dumps({"kill": got, "join": j, "rounds": rounds}))

    # a serving rank dies while a joiner loads (join_delay: ep1's joiners are ready 5 s after
    # loading, ep3's never): the joiner is dropped, the survivors shrink again (3 -> 2), and
    # the dropped joiner starts again and joins (3 ranks); ep3's joiner is not ready in time
    # and is dropped: no rank changes generation, 3 ranks keep serving
    _fault(s, client, ref, _worker(s, 1).kill, "kill ep1")
    st = _until(s, lambda m: m["joining"] == ["ep1"], 30)
    assert st["ep_size"] == 3 and st["membership"]["workers"] == [0, 3, 2], st["membership"]
    _joiner(s, 1).kill()                 # the joiner dies while loading: another one starts
    launcher_log = s.log_dir / "launcher.log"
    deadline = time.monotonic() + 30
    while ("EPLB elastic rejoin restart proc=ep1"
           not in launcher_log.read_text()) and time.monotonic() < deadline:
        time.sleep(0.1)
    m = _status(s)["membership"]
    assert m["joining"] == ["ep1"] and m["joins_dropped"] == 0 and m["ep_size"] == 3, m
    _fault(s, client, ref, _worker(s, 3).kill, "kill ep3 while ep1 loads")
    st = _until(s, lambda m: m["joins"] >= 2 and m["joins_dropped"] >= 2, 90)
    m = st["membership"]
    assert m["joins_dropped"] == 2 and m["joins"] == 2 and m["joining"] == [], m
    assert st["ep_size"] == 3 and m["generation"] == 6 and m["workers"] == [0, 2, 1], m
    assert m["last_join"]["worker"] == "ep1" and m["last_join"]["ep_size"] == "2->3", m
    text = launcher_log.read_text()
    assert ("EPLB elastic rejoin dropped proc=ep1 why=\"serving worker ep3 died" in text
            and "restart=yes" in text), text[-3000:]
    assert ("EPLB elastic rejoin restart proc=ep1 why=\"dropped: serving worker ep3 died"
            in text), text[-3000:]
    assert "--elastic_join_timeout_seconds=20" in text, text[-3000:]
    print("ELASTIC_REJOIN_RESTART", json.dumps(m["last_join"]))
    _streams_match(client, ref, "after the restarted joiner joined")
    _covers_all(_status(s)["placement"], 3)
    s.note_children()
    s.proc.send_signal(signal.SIGTERM)                  # a clean stop, nothing left
    assert s.proc.wait(60) == 0, s.err.read_text()[-3000:]
    time.sleep(0.5)
    assert s.alive() == [] and shm_objects(s.run_id) == []
    assert not any(p.status() != psutil.STATUS_ZOMBIE for p in map(psutil.Process, s.alive()))
