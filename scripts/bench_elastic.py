"""Elastic EP acceptance (issue #23): kills at chosen moments with every stream compared to a
fault-free reference, detection, kill -> next token, coverage and canary after each recovery,
throughput after recovery, and the steady-state overhead of ``--elastic_ep`` (no fault).

Set-up: ``xllm-eplb serve --ep-size 4 --elastic_ep=true`` on a generated deepseek_v3 (8
experts, top-2, ``--redundant_experts_num=2``: 4 slots per rank, enough for two shrinks),
``--dtype=float64``, EPLB on (a round every second, canary on), ``--streams`` concurrent
streams of ``--tokens`` tokens, greedy and seeded-sampled. The reference: the same requests,
one at a time, on the first server before any kill (float64: every server, rank count and
batch gives the same tokens). ``--kills`` per mode, cycling the moments ``prefill``,
``decode``, ``migration`` (an EPLB round in flight), ``reprefill`` (two kills: the second
0-0.3 s after the first recovery resumed). ``shrink`` (``--elastic_restart=false``): a server
takes two kills (4 -> 3 -> 2), then a fresh one; ``rejoin`` (the default
``--elastic_restart=true``: shrink at once, the replacement loads and joins; each trial waits
for 4 ranks again; also the joiner's start -> serving and the pause at the switch) and
``respawn`` (``--elastic_rejoin=false``: in place): one server, every kill.

Per kill (from the launcher's and the engine's logs against the kill's time): kill -> launcher
saw the exit, -> ``EPLB elastic detect`` (recovery starts), -> ``EPLB elastic resume``, the
fence and re-form seconds; per request in flight: kill -> its next token. After every trial:
``/eplb/status`` ``placement`` covers every expert in every layer; no ``EPLB canary:`` line,
one ``canary=ok`` per re-sharded survivor. Throughput: closed-loop streams, 8 s before a kill
and 10 s after, target 0.9 x (N-1)/N (shrink) or 0.9 (respawn) of the rate before. Overhead
(``xllm_eplb/testing/elastic_overhead.py``): EPLB off, one server at a time on the same cores, off / on /
off / ... / off at each of ``--overhead-eps``; the direct cost (CPU inside elastic-only code,
accounted by the engine), the idle cost, and CPU and wall per step on / off with the off / off
(A/A) spread of the same run.

    .venv/bin/python scripts/bench_elastic.py --json /tmp/elastic.json        # ~16 min
    .venv/bin/python scripts/bench_elastic.py --quick                         # < 1 min
    .venv/bin/python scripts/bench_elastic.py --ep 16 --experts 32 --kills 4 --skip throughput,overhead
    .venv/bin/python scripts/bench_elastic.py --skip kills,throughput --json /tmp/ovh.json  # overhead
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

from xllm_eplb.testing import elastic_load as L
from xllm_eplb.testing import elastic_measure as M
from xllm_eplb.testing.elastic_overhead import overhead
from xllm_eplb.testing.serving import Server, kill_worker, last_error

KINDS = {"prefill": 1, "decode": 1, "migration": 1, "reprefill": 2}


def flags(a, mode: str) -> list[str]:
    need = max(1, -(-a.experts // max(a.ep - 2, 1)) - a.experts // a.ep)
    f = [f"--dtype={a.dtype}", "--elastic_ep=true", f"--redundant_experts_num={need}",
         "--elastic_silence_seconds=2", "--max_batch_size=8", "--ep-size", str(a.ep)]
    if mode == "shrink":
        return f + ["--elastic_restart=false"]
    return f + ["--elastic_restart=true", f"--elastic_max_restarts={2 * a.kills + 10}",
                f"--elastic_rejoin={str(mode == 'rejoin').lower()}"]


EPLB = ["--enable_eplb=true", "--eplb_update_interval=1", "--eplb_min_peak_load_improvement=0",
        "--eplb_canary=true"]


def plan(kills: int, per_server: int) -> list[list[str]]:
    """Trial kinds, cycling KINDS, grouped into servers of at most ``per_server`` kills."""
    kinds, n, i = [], 0, 0
    while n < kills:
        k = list(KINDS)[i % len(KINDS)]
        k = k if n + KINDS[k] <= kills else "decode"
        kinds.append(k)
        n, i = n + KINDS[k], i + 1
    servers, cur, used = [], [], 0
    for k in kinds:
        if used + KINDS[k] > per_server:
            servers.append(cur)
            cur, used = [], 0
        cur.append(k)
        used += KINDS[k]
    return servers + [cur]


def kills_series(mode: str, a, model: Path, tmp: Path, bodies, ref, rng) -> dict:
    per = 2 if mode == "shrink" else 2 * a.kills
    rows, requests, bad, cover, servers = [], 0, [], [], plan(a.kills, per)
    joins: list[dict] = []
    settled: list[dict] = []       # rejoin: each trial, once back at N ranks
    restarts: list[dict] = []      # rejoin: launcher lines per server
    for si, kinds in enumerate(servers):
        logs = tmp / f"logs_{mode}{si}"
        s = Server(model, logs, flags(a, mode) + EPLB)
        try:
            s.wait_ready(300)
            if not ref:
                ref += [L.complete(s.port, b) for b in bodies]
            kill_times: list[float] = []
            try:
                if mode == "rejoin":
                    joins.append(L.wait_join(s, a.ep))
                for kind in kinds:
                    got = L.kill_trial(s, bodies, kind, rng)
                    for t_kill, label in got["kills"]:
                        kill_times.append(t_kill)
                        rows.append({"label": label, "recs": got["recs"]})
                    for i, r in enumerate(got["recs"]):
                        why = r["error"] or ("" if r["done"] else "no [DONE]")
                        why = why or M.token_faults(r["ids"], ref[i])
                        if why or r["status"] >= 500:
                            bad.append(f"{kind} stream {i}: status {r['status']} {why}")
                    st = s.get("/eplb/status")
                    cover.append({"ep_size": st["ep_size"],
                                  "layers_missing": M.coverage_gaps(st["placement"], a.experts)})
                    if mode == "rejoin":      # back at N ranks (every replacement joined)
                        t_settle = time.monotonic()
                        joins.append(L.wait_join(s, a.ep, kills=len(kill_times)))
                        st = s.get("/eplb/status")
                        settled.append({"kind": kind, "ep_size": st["ep_size"],
                                        "settle_s": round(time.monotonic() - t_settle, 3),
                                        "layers_missing": M.coverage_gaps(st["placement"],
                                                                          a.experts)})
                for _ in range(a.idle_kills if mode != "shrink" else 0):
                    kill_times.append(L.idle_kill(s, rng))
                    rows.append({"label": "idle", "recs": []})
            except (OSError, KeyError, RuntimeError) as e:     # the server stopped
                bad.append(f"server {si} stopped: {type(e).__name__}: {e}; "
                           f"{last_error(s)}")
            launcher = (logs / "latest" / "launcher.log").read_text()
            restarts.append({k: launcher.count(f"EPLB elastic rejoin {k} ")
                             for k in ("start", "restart", "dropped")})
            lines = M.elastic_lines(logs)
            aborted = sum("EPLB elastic round aborted" in ln for ln in
                          (logs / "latest" / "engine.log").read_text().splitlines())
            mine = rows[len(rows) - len(kill_times):]
            for row, k in zip(mine, M.per_kill(lines, kill_times),
                              strict=True):
                row.update(k)
                # tokens between the kill and the resume were committed before the kill (in
                # transit): the pause ends at the first token after the resume
                after = row["kill"] + (row["resume_s"] or 0.0) - 0.001
                row["gaps"] = [x + after - row["kill"] for x in L.gaps(row.pop("recs"), after)]
                row["in_flight"] = len(row["gaps"])
                requests += len(row["gaps"])
            cover[-1].update(canary_ok=len(lines["resharded"]),
                             canary_failed=len(lines["canary_failed"]), rounds_aborted=aborted)
        finally:
            s.stop()
    gaps = [x for r in rows for x in r["gaps"]]
    by = {lab: M.pct([x for r in rows if r["label"] == lab for x in r["gaps"]], 50, 95)
          for lab in sorted({r["label"] for r in rows}) if lab != "idle"}
    for r in rows:
        r["gaps"] = [round(x, 3) for x in r["gaps"]]
    return {"mode": mode, "ep": a.ep, "experts": a.experts, "dtype": a.dtype,
            "servers": len(servers), "kills": sum(r["label"] != "idle" for r in rows),
            "idle_kills": sum(r["label"] == "idle" for r in rows), "in_flight_requests": requests,
            "distinct_requests": len(bodies) * sum(len(k) for k in servers),
            "labels": {lab: sum(r["label"] == lab for r in rows)
                       for lab in {r["label"] for r in rows}},
            "bad_streams": len(bad), "bad": bad[:10],
            "kill_to_next_token": M.pct(gaps, 50, 95), "kill_to_next_token_by_label": by,
            "kill_to_launcher": M.pct([r.get("launcher_s") for r in rows], 50, 99),
            "detect": M.pct([r.get("detect_s") for r in rows], 50, 99),
            "detect_by_label": {lab: M.pct([r.get("detect_s") for r in rows
                                            if r["label"] == lab], 50, 99)
                                for lab in sorted({r["label"] for r in rows})},
            "kill_to_resume": M.pct([r.get("resume_s") for r in rows], 50, 95),
            "fence": M.pct([r.get("fence_s") for r in rows], 50, 95),
            "reform": M.pct([r.get("reform_s") for r in rows], 50, 95),
            "join_start_to_serving": M.pct([j.get("start_to_serving_s") for j in joins[1:]], 50, 95),
            "join_switch_pause": M.pct([j.get("pause_s") for j in joins[1:]], 50, 95),
            "coverage": cover, "layers_uncovered": sum(len(c["layers_missing"]) for c in cover),
            "settled_ep_size": [x["ep_size"] for x in settled],
            "settle_s": M.pct([x["settle_s"] for x in settled], 50, 95),
            "settled_layers_uncovered": sum(len(x["layers_missing"]) for x in settled),
            "rejoin_lines": {k: sum(r[k] for r in restarts) for k in restarts[0]}
            if restarts else {},
            "per_kill": rows}


def throughput(mode: str, a, model: Path, tmp: Path, bodies, ref, rng) -> dict:
    s = Server(model, tmp / f"logs_tput_{mode}", flags(a, mode))
    try:
        s.wait_ready(300)
        load = L.ClosedLoop(s.port, bodies, ref, a.streams)
        time.sleep(3.0 + a.before_s)
        t_kill = kill_worker(s, rng)
        time.sleep(10.5)
        load.close()
    finally:
        s.stop()
    target = 0.9 * (a.ep - 1) / a.ep if mode == "shrink" else 0.9
    res = M.after_kill(load.times, t_kill, a.before_s, target)
    return {"mode": mode, **res, "requests_ok": load.ok, "errors": load.errors,
            "mismatches": load.mismatches}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="< 1 min: one kill (prefill) per mode, 4 streams, no throughput/overhead")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--kills", type=int, default=20, help="kills per mode")
    ap.add_argument("--streams", type=int, default=12, help="concurrent streams per trial")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--modes", default="shrink,rejoin,respawn",
                    help="shrink (--elastic_restart=false), rejoin (the default: shrink, then "
                         "the replacement joins), respawn (--elastic_rejoin=false: in place)")
    ap.add_argument("--ep", type=int, default=4, help="EP ranks (each kill: ep -> ep-1)")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--dtype", default="float64")
    ap.add_argument("--idle-kills", type=int, default=5,
                    help="rejoin / respawn: kills of an idle server, detection only")
    ap.add_argument("--before-s", type=float, default=8.0, help="throughput: seconds before")
    ap.add_argument("--overhead-eps", default="2,4", help="overhead: EP sizes, comma list")
    ap.add_argument("--overhead-pairs", type=int, default=3,
                    help="overhead: on runs per EP size, each between two off runs (sequential)")
    ap.add_argument("--overhead-rounds", type=int, default=2,
                    help="overhead: measured workloads per run (after one warm-up)")
    ap.add_argument("--overhead-tokens", type=int, default=96, help="per request (16 requests)")
    ap.add_argument("--overhead-idle-s", type=float, default=8.0,
                    help="overhead: idle seconds measured per run (engine CPU with no request)")
    ap.add_argument("--cores", default="",
                    help="overhead: pin the bench and every server to these cores (e.g. 0-1; "
                         "default: the cores the bench may use now)")
    ap.add_argument("--keep-logs", type=Path, help="copy every server's logs here (without it, a run in which "
                         "a server stopped keeps them in a new bench_elastic_stopped_* "
                         "folder under the temp dir)")
    ap.add_argument("--skip", default="", help="comma list of: kills, throughput, overhead")
    a = ap.parse_args()
    skip = set(filter(None, a.skip.split(",")))
    if a.quick:
        a.kills, a.streams, a.tokens, a.idle_kills = 1, 4, 12, 0
        skip |= {"throughput", "overhead"}
    rng = random.Random(23)
    t0 = time.monotonic()
    out: dict = {"command": " ".join(sys.argv), "kills": [], "throughput": []}
    with tempfile.TemporaryDirectory(prefix="bench_elastic_") as d:
        tmp = Path(d)
        try:
            _run(a, skip, tmp, out, rng)
        finally:
            keep = a.keep_logs
            # a server that stopped keeps its logs even without --keep-logs (run A lost them)
            if not keep and any("stopped:" in b for r in out["kills"] for b in r["bad"]):
                keep = Path(tempfile.mkdtemp(prefix="bench_elastic_stopped_"))
            if keep:
                shutil.copytree(tmp, keep, dirs_exist_ok=True, symlinks=True,
                                ignore=shutil.ignore_patterns("ckpt"))
                out["logs"] = str(keep)
                print(f"logs kept in {keep}", file=sys.stderr, flush=True)
    out["wall_s"] = round(time.monotonic() - t0, 1)
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))


def _run(a, skip: set, tmp: Path, out: dict, rng) -> None:
    from xllm_eplb.model.checkpoint import make_checkpoint

    model = make_checkpoint("deepseek_v3", tmp / "ckpt", num_experts=a.experts, top_k=2)
    bodies = [L.body(i, a.tokens) for i in range(a.streams)]
    ref: list = []
    for mode in a.modes.split(","):
        if "kills" not in skip:
            r = kills_series(mode, a, model, tmp, bodies, ref, rng)
            out["kills"].append(r)
            print(json.dumps({k: v for k, v in r.items()
                              if k not in ("per_kill", "coverage")}), flush=True)
        if "throughput" not in skip:
            if not ref:
                ref += _reference(model, tmp, a, bodies)
            out["throughput"].append(throughput(mode, a, model, tmp, bodies, ref, rng))
            print(json.dumps(out["throughput"][-1]), flush=True)
    if "overhead" not in skip:
        out["overhead"] = overhead(a, model, tmp)
        for r in out["overhead"]["by_ep"]:
            print(json.dumps({k: v for k, v in r.items()
                              if k not in ("steps", "cpu_ms_per_step", "engine_rss_mb")}),
                  flush=True)


def _reference(model: Path, tmp: Path, a, bodies) -> list:
    s = Server(model, tmp / "logs_ref", flags(a, "respawn"))
    try:
        s.wait_ready(300)
        return [L.complete(s.port, b) for b in bodies]
    finally:
        s.stop()


if __name__ == "__main__":
    main()
