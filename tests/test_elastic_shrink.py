"""Elastic shrink (issue #23 items 5-6) black-box on a real `xllm-eplb serve --elastic_ep=true
--elastic_restart=false` at EP4 of a glm4_moe checkpoint (real processes, shm, gloo): a worker SIGKILLed in the middle
of streams is NOT replaced; the survivors re-form with compact ranks, re-plan the experts (the
dead rank's orphans read from the checkpoint, the transfer canary checked) and keep serving:
every request in flight finishes with exactly the tokens of a fault-free run (float64, greedy
and seeded sampling; the survivors' requests keep their KV caches at their new compact ranks,
only the dead rank's are re-prefilled), and the EPLB manager is rebuilt for the smaller world (3 ranks: a layout
the flags cannot express, 8 experts on 3 x 4 slots). Twice (4 -> 3 -> 2: 8 experts, 4 slots per rank); a third death breaks
the rule (1 x 4 < 8) and the run stops cleanly naming it, leaving nothing behind. The ranks
exchange their rows through the shared memory (``--ep_transport=shm``, issue #39): each
generation's segment, a round failed by the SIGKILL, nothing of it left either."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path

import openai
import psutil
import pytest
from test_elastic_serve import PROMPTS, _fault, _kept_kv, _kw, _status, _worker

from xllm_eplb.testing.serving import shm_objects

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs POSIX shm")]


def _metrics(s) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(s.url + "/metrics", timeout=30) as r:
        return {(x.name, tuple(sorted(x.labels.items()))): x.value
                for f in text_string_to_metric_families(r.read().decode()) for x in f.samples}


def _covers_all(placement, ep_size: int, num_experts: int = 8) -> None:
    """Every MoE layer's deployed table: ep_size x 4 slots holding every expert."""
    for row in placement:
        assert len(row) == ep_size * 4 and set(row) == set(range(num_experts)), row


@pytest.mark.timeout(420)
def test_killed_workers_are_left_out_and_the_survivors_keep_serving(glm8_ckpt, start_server):
    s = start_server("--ep-size", "4", "--model", str(glm8_ckpt), "--dtype=float64",
                     "--workload=none", "--enable_eplb=true", "--eplb_canary=true",
                     "--elastic_ep=true",
                     "--elastic_restart=false", "--redundant_experts_num=2",
                     "--elastic_silence_seconds=2", "--max_batch_size=4", "--ep_transport=shm")
    s.wait_ready(240)
    client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=120)
    assert client.models.list().data[0].model_extra["family"] == "glm4_moe"
    ref = [client.completions.create(**_kw(i)).choices[0].model_extra["token_ids"]
           for i in range(len(PROMPTS))]
    results = []
    for gen, worker, left in ((2, 2, [0, 1, 3]), (3, 0, [1, 3])):       # 4 -> 3 -> 2
        victim = _worker(s, worker)
        results.append(_fault(s, client, ref, victim.kill, f"kill ep{worker}"))
        st = _status(s)
        m = st["membership"]
        assert st["ep_size"] == m["ep_size"] == len(left), m
        assert m["ranks_active"] == list(range(len(left))) and m["workers"] == left, m
        assert m["generation"] == gen and m["shrinks"] == gen - 1, m
        assert m["last_recovery"]["mode"] == "shrink" and m["requests_reprefilled"] >= 1, m
        _kept_kv(m, len(left) + 1)     # kept requests followed their workers' compact ranks
        assert st["enabled"], st          # the EPLB manager rebuilt for the smaller world
        active = {k[1][0][1]: v for k, v in _metrics(s).items()
                  if k[0] == "xllm_eplb_rank_active"}
        assert active == {str(r): float(r < len(left)) for r in range(4)}, active
        _covers_all(st["placement"], len(left))
        results[-1]["recovery"] = m["last_recovery"]
    fams = _metrics(s)
    assert fams[("xllm_eplb_experts_reloaded_total", (("source", "checkpoint"),))] > 0
    assert fams[("xllm_eplb_ep_size", ())] == 2
    assert fams[("xllm_eplb_generation", ())] == 3
    assert fams[("xllm_eplb_requests_reprefilled_total", ())] == m["requests_reprefilled"]
    engine_log = (s.log_dir / "engine.log").read_text()
    assert len(re.findall(r"EPLB elastic re-plan .*ep_size=(4->3|3->2)", engine_log)) == 2
    assert "canary=ok" in (s.log_dir / "rank3.log").read_text()
    # every generation's rows went through its own segment (a2a1, then a2a2, a2a3)
    r3 = (s.log_dir / "rank3.log").read_text()
    assert all(f"EPLB ep transport used=shm segment=/xllm_eplb_{s.run_id}_a2a{g} " in r3
               for g in (1, 2, 3)), r3[-3000:]
    print("ELASTIC_SHRINK", json.dumps(results))
    # a third death breaks the rule (1 x 4 slots < 8 experts): a clean stop that names it
    s.note_children()
    _worker(s, 3).kill()
    assert s.proc.wait(60) != 0
    err = s.err.read_text()
    assert "(ep_size-1) x slots_per_rank >= num_experts" in err, err[-3000:]
    time.sleep(0.5)
    assert s.alive() == [] and shm_objects(s.run_id) == []
    assert not any(p.status() != psutil.STATUS_ZOMBIE for p in map(psutil.Process, s.alive()))
