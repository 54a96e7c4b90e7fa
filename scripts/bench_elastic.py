"""Kill -> next token of every request in flight, elastic shrink / rejoin / respawn (#23).

Each trial: an ``xllm-eplb serve --ep-size 4 --elastic_ep=true`` (generated deepseek_v3, 8
experts, top-2, one redundant slot, float64), ``--streams`` concurrent streaming completions;
once each has streamed a few tokens a random worker is SIGKILLed. Per request in flight: the
seconds from the kill to its next token; every request must finish with the tokens of the same
request run before the kill (a fault-free reference). ``shrink``: ``--elastic_restart=false``
(one fresh server per kill: 4 -> 3); ``rejoin``: the default ``--elastic_restart=true`` (one
server, ``--kills`` kills: 4 -> 3 at once, the replacement loads in the background and joins,
4 again before the next kill; also reports the joiner's start -> serving seconds and the pause
at the switch); ``respawn``: ``--elastic_rejoin=false``, the in-place replacement (one server,
``--kills`` kills). Prints one JSON line per mode with p50 / p95 / max.

    .venv/bin/python scripts/bench_elastic.py --kills 4
    .venv/bin/python scripts/bench_elastic.py --ep 16 --experts 32 --kills 3   # EP16 -> 15
    .venv/bin/python scripts/bench_elastic.py --modes rejoin --kills 4
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import openai
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from soak import Server  # noqa: E402

FLAGS = ["--dtype=float64", "--enable_eplb=false", "--elastic_ep=true",
         "--redundant_experts_num=1", "--elastic_silence_seconds=2", "--max_batch_size=4"]
EP = 4     # --ep (the Server's --ep-size 4 is overridden by a later flag)
PROMPTS = ["the engine", "a rank dies", "experts move", "no request is lost", "seeded",
           "tokens stay", "x", "balance the load"]


def _kw(i: int, n: int) -> dict:
    return dict(model="xllm-eplb", prompt=PROMPTS[i % len(PROMPTS)], max_tokens=n,
                temperature=0.8 if i % 2 else 0.0, seed=100 + i,
                extra_body={"ignore_eos": True, "return_token_ids": True})


def _kill_once(s: Server, client, ref, n_tokens: int, streams: int, rng) -> dict:
    toks = [[] for _ in range(streams)]
    times = [[] for _ in range(streams)]
    errors: list[str] = []

    def run(i):
        try:
            for ch in client.completions.create(stream=True, **_kw(i, n_tokens)):
                ids = ch.choices[0].model_extra.get("token_ids") or []
                toks[i] += ids
                times[i] += [time.monotonic()] * len(ids)
        except Exception as e:  # noqa: BLE001
            errors.append(f"{i}: {e}")

    th = [threading.Thread(target=run, args=(i,)) for i in range(streams)]
    for t in th:
        t.start()
    deadline = time.monotonic() + 60
    while min(map(len, toks)) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    workers = [p for p in psutil.Process(s.proc.pid).children()
               if "xllm-eplb:ep" in " ".join(p.cmdline())]
    victim = rng.choice(workers)
    t_kill = time.monotonic()
    victim.kill()
    for t in th:
        t.join(180)
    gaps = [next((x - t_kill for x in ts if x > t_kill), float("nan")) for ts in times
            if ts and len(ts) < n_tokens + 1]
    return {"gaps": gaps, "errors": errors,
            "mismatch": sum(t != r for t, r in zip(toks, ref, strict=True))}


def _wait_join(s: Server, n: int, timeout: float = 120) -> dict:
    """The ``n``-th join's numbers (``/eplb/status`` membership ``last_join``), once back at
    ``EP`` ranks."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = s.get("/eplb/status")["membership"]
        if m["joins"] >= n and m["ep_size"] == EP:
            return m["last_join"]
        time.sleep(0.1)
    raise RuntimeError(f"no rejoin within {timeout} s: {m}")


def trial_series(mode: str, model: Path, tmp: Path, kills: int, streams: int, n: int, rng):
    gaps, bad, recov, joins = [], 0, [], []
    servers = kills if mode == "shrink" else 1
    for k in range(servers):
        extra = (["--elastic_restart=false"] if mode == "shrink"
                 else ["--elastic_restart=true", f"--elastic_max_restarts={kills + 1}",
                       f"--elastic_rejoin={str(mode == 'rejoin').lower()}"])
        s = Server(model, tmp / f"logs_{mode}{k}", FLAGS + extra + ["--ep-size", str(EP)])
        try:
            s.wait_ready(300)
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{s.port}/v1", api_key="none",
                                   max_retries=0, timeout=180)
            ref = [client.completions.create(**_kw(i, n)).choices[0].model_extra["token_ids"]
                   for i in range(streams)]
            for _ in range(1 if mode == "shrink" else kills):
                got = _kill_once(s, client, ref, n, streams, rng)
                gaps += got["gaps"]
                bad += got["mismatch"] + len(got["errors"])
                recov.append(s.get("/eplb/status")["membership"]["last_recovery"]["seconds"])
                if mode == "rejoin":
                    joins.append(_wait_join(s, len(joins) + 1))
        finally:
            s.stop()
    g = np.array(gaps, dtype=float)
    more = {}
    if joins:
        more = {"start_to_serving_s": [j["start_to_serving_s"] for j in joins],
                "start_to_ready_s": [j["start_to_ready_s"] for j in joins],
                "switch_pause_s": [j["pause_s"] for j in joins]}
    return {"mode": mode, "kills": len(recov), "requests": int(g.size), **more,
            "p50_s": round(float(np.nanpercentile(g, 50)), 3),
            "p95_s": round(float(np.nanpercentile(g, 95)), 3),
            "max_s": round(float(np.nanmax(g)), 3),
            "recovery_s": [round(x, 3) for x in recov], "mismatch_or_error": bad}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=4)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--modes", default="shrink,rejoin,respawn")
    ap.add_argument("--ep", type=int, default=4, help="EP ranks (each kill: ep -> ep-1)")
    ap.add_argument("--experts", type=int, default=8)
    a = ap.parse_args()
    global EP
    EP = a.ep
    rng = random.Random(23)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        from xllm_eplb.model.checkpoint import make_checkpoint

        model = make_checkpoint("deepseek_v3", tmp / "ckpt", num_experts=a.experts, top_k=2)
        for mode in a.modes.split(","):
            print(json.dumps(trial_series(mode, model, tmp, a.kills, a.streams, a.tokens, rng)),
                  flush=True)


if __name__ == "__main__":
    main()
