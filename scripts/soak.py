#!/usr/bin/env python3
"""Soak: EP4 on the built-in checkpoint, rebalancing every 2 s, for ``--minutes`` under a
bounded client mix; every reply is checked against a reference run, and the processes' RSS,
file descriptors, threads and the run's /dev/shm objects are tracked (issue #17).

1. The checkpoint: ``--model DIR``, else one generated with ``xllm-eplb make-checkpoint``
   (deepseek_v3, its defaults) into a temporary folder.
2. Reference run: ``xllm-eplb serve --ep-size 4 --model DIR --enable_eplb=false``; every prompt
   of the fixed pool (short and long, greedy and seeded-sampled) once, non-streaming.
3. Soak run: the same server with ``--enable_eplb=true --eplb_update_interval=2``
   (``--eplb_min_peak_load_improvement=0``: every round may publish) and ``--clients`` threads,
   each with at most one request in flight, drawing prompts from the pool (streaming or not,
   seeded by thread). Every reply's token ids must equal the reference's (``token_mismatches``).
   After a warm-up (``--warmup-s``, clients paused for the snapshot) the start figures are
   taken; RSS is sampled every 5 s; clients stop at the end and the end figures are taken.

``rss_growth_max``: the largest per-process RSS growth over the warm-up value (a ratio, 0.05 =
5 %); fds/threads: summed over the launcher and every child; shm: the run's /dev/shm objects.
Targets over 10 minutes (docs/benchmarks.md): 0 failed requests, 0 mismatches, RSS growth
<= 5 %, constant fds, threads and shm objects.

    python scripts/soak.py --minutes 10 [--model DIR] [--json PATH] [--clients 4]
    python scripts/soak.py --quick --json /tmp/soak.json        # 1 minute

``--chaos`` (issue #23): the soak server runs ``--elastic_ep=true`` and a random worker is
SIGKILLed every ``--kill-every`` seconds (default 60; 20 with ``--quick``); the survivors shrink
and the launcher's replacement rejoins once loaded (the default ``--elastic_rejoin``). Targets: 0 failed requests, 0 token mismatches, every kill
recovered (``/eplb/status`` ``membership``), the recovery seconds of each kill reported.

    python scripts/soak.py --chaos --minutes 10 --json /tmp/chaos.json
    python scripts/soak.py --chaos --quick
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from xllm_eplb.testing.elastic_measure import recoveries  # noqa: E402
from xllm_eplb.testing.serving import Chaos, Clients, Server, complete, elastic_flags, prompt_pool  # noqa: E402

RSS_PERIOD_S = 5.0


def snapshot(server: Server) -> dict:
    """RSS per process (by role), fds and threads summed, the run's shm objects."""
    rss, fds, threads = {}, 0, 0
    for p in server.procs():
        try:
            with p.oneshot():
                name = "launcher" if p.pid == server.proc.pid else p.name()
                rss[f"{name}:{p.pid}"] = p.memory_info().rss
                fds += p.num_fds()
                threads += p.num_threads()
        except psutil.NoSuchProcess:
            pass
    shm = [n for n in os.listdir("/dev/shm") if f"xllm_eplb_{server.run_id}_" in n]
    return {"rss": rss, "fds": fds, "threads": threads, "shm": len(shm)}


def quiet_snapshot(server: Server, clients: Clients) -> dict:
    clients.pause()
    time.sleep(1.5)                      # in-flight frees, HTTP keep-alives close
    snap = snapshot(server)
    clients.resume()
    return snap


def reference(model: Path, tmp: Path, pool: list[dict]) -> list[list[int]]:
    s = Server(model, tmp / "logs_ref", ["--enable_eplb=false"])
    try:
        s.wait_ready()
        ref = [complete(s.port, b, stream=False) for b in pool]
    finally:
        s.stop()
    bad = [r for r in ref if isinstance(r, str)]
    if bad:
        raise RuntimeError(f"reference run failed: {bad[0]}")
    return ref


def soak(model: Path, tmp: Path, pool, ref, minutes: float, n_clients: int,
         warmup_s: float, chaos_every: float = 0.0) -> dict:
    flags = ["--enable_eplb=true", "--eplb_update_interval=2",
             "--eplb_min_peak_load_improvement=0"]
    s = Server(model, tmp / "logs_soak", flags + (elastic_flags(model) if chaos_every else []))
    clients = chaos = None
    try:
        s.wait_ready()
        clients = Clients(s.port, pool, ref, n_clients)
        clients.start()
        time.sleep(warmup_s)
        start = quiet_snapshot(s, clients)
        st0 = s.get("/eplb/status")
        chaos = Chaos(s, chaos_every) if chaos_every else None
        peak = dict(start["rss"])
        end_at = time.monotonic() + max(minutes * 60.0 - warmup_s, 1.0)
        while time.monotonic() < end_at:
            time.sleep(min(RSS_PERIOD_S, max(end_at - time.monotonic(), 0.0)))
            assert s.proc.poll() is None, f"server died: {s.out.read_text()[-2000:]}"
            for k, v in snapshot(s)["rss"].items():
                peak[k] = max(peak.get(k, 0), v)
        if chaos is not None:
            chaos.close()
        clients.pause()
        time.sleep(1.5)
        end = snapshot(s)
        st = s.get("/eplb/status")
        clients.close()
    finally:
        if chaos is not None:
            chaos.close()
        code = s.stop()
    growth = {k: peak[k] / v - 1.0 for k, v in start["rss"].items() if k in peak and v > 0}
    return {"minutes": minutes, "clients": n_clients, "warmup_s": warmup_s,
            "requests_ok": clients.ok, "requests_failed": clients.failed,
            "token_mismatches": clients.mismatches,
            "first_error": clients.errors[0] if clients.errors else "",
            "rebalances": int(st["rounds"]), "layers_moved": int(st["layers_committed"]),
            "layers_timed_out": int(st["layers_timed_out"]), "slots_moved": int(st["slots_moved"]),
            "rebalances_after_warmup": int(st["rounds"]) - int(st0["rounds"]),
            "rss_growth_max": max(growth.values()) if growth else 0.0,
            "rss_start_mb": {k: round(v / 2**20, 1) for k, v in start["rss"].items()},
            "fds_start": start["fds"], "fds_end": end["fds"],
            "threads_start": start["threads"], "threads_end": end["threads"],
            "shm_objects_start": start["shm"], "shm_objects_end": end["shm"],
            "exit_code": code,
            "shm_objects_after_exit": len([n for n in os.listdir("/dev/shm")
                                           if f"xllm_eplb_{s.run_id}_" in n]),
            **({"kills": len(chaos.kills), "recovered": st["membership"].get("recoveries", 0),
                "pg_generation": st["membership"].get("pg_generation", 0),
                "requests_reprefilled": st["membership"].get("requests_reprefilled", 0),
                "requests_kept": st["membership"].get("requests_kept", 0),
                **recoveries(tmp / "logs_soak", chaos.kills)} if chaos else {})}


def make_model(tmp: Path) -> Path:
    out = tmp / "ckpt"
    subprocess.run([sys.executable, "-m", "xllm_eplb", "make-checkpoint", "--arch",
                    "deepseek_v3", "--out", str(out)], cwd=ROOT, check=True,
                   stdout=subprocess.DEVNULL)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--quick", action="store_true", help="1 minute")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--model", type=Path, help="checkpoint folder (default: generate one)")
    ap.add_argument("--clients", type=int, default=4, help="client threads (one request each)")
    ap.add_argument("--chaos", action="store_true",
                    help="--elastic_ep=true and a random worker SIGKILLed every --kill-every s")
    ap.add_argument("--kill-every", type=float, default=None,
                    help="seconds between kills (default 60; 20 with --quick)")
    ap.add_argument("--keep-logs", type=Path, help="copy the soak server's logs here")
    ap.add_argument("--warmup-s", type=float, default=None,
                    help="seconds before the start figures (default min(60, 10%% of the run))")
    args = ap.parse_args()
    minutes = 1.0 if args.quick else args.minutes
    warm = args.warmup_s if args.warmup_s is not None else min(60.0, max(10.0, 6.0 * minutes))
    pool = prompt_pool()
    with tempfile.TemporaryDirectory(prefix="soak_") as d:
        tmp = Path(d)
        model = args.model or make_model(tmp)
        t0 = time.monotonic()
        ref = reference(model, tmp, pool)
        every = (args.kill_every or (20.0 if args.quick else 60.0)) if args.chaos else 0.0
        try:
            res = soak(model, tmp, pool, ref, minutes, args.clients, warm, every)
        finally:
            if args.keep_logs:
                shutil.copytree(tmp / "logs_soak", args.keep_logs, dirs_exist_ok=True)
        res["wall_s"] = round(time.monotonic() - t0, 1)
    keys = ("requests_ok", "requests_failed", "token_mismatches", "rebalances", "layers_moved",
            "rss_growth_max", "fds_start", "fds_end", "threads_start", "threads_end",
            "shm_objects_start", "shm_objects_end", "exit_code")
    keys += ("kills", "recovered") if args.chaos else ()
    print("soak " + " ".join(f"{k}={res[k]:.4f}" if isinstance(res[k], float) else
                             f"{k}={res[k]}" for k in keys), flush=True)
    if res["first_error"]:
        print(f"first error: {res['first_error']}")
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
