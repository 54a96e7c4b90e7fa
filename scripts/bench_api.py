#!/usr/bin/env python3
"""API overhead of the HTTP front end: P50 time to first token of a 1-token request on an idle
EP2 server minus the engine's step time, for this checkout and for a baseline revision, in the
same run.

For each source tree (``current`` = this checkout; ``baseline`` = ``git archive --baseline-rev``
unpacked into a temporary folder and put first on ``PYTHONPATH``), a real server is started
(``xllm-eplb serve --ep-size 2 --workload=none --enable_eplb=false``, tiny CPU model) and driven
by one client that sends ``--requests`` sequential non-streaming completions with
``max_tokens=1`` (so the whole reply is the first token). Per request, the engine's step time is
the delta of ``xllm_eplb_step_duration_seconds`` (sum/count) scraped from ``/metrics`` around
it; overhead = client-side latency - step time. Reported: P50/P90 latency, mean step time,
P50 overhead, and the ratio current/baseline of the P50 overhead.

On the current server only (the OpenAI API): ``--clients`` (default 200) concurrent streaming
clients on loopback, each asking for a few tokens, must all complete with no error; and the same
seeded sampled requests streamed and not streamed must give identical tokens.

    python scripts/bench_api.py [--quick] [--json PATH] [--baseline-rev REV] [--requests N]
        [--clients N]
"""

from __future__ import annotations

import argparse
import http.client
import json
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from xllm_eplb.testing.serving import Server, complete  # noqa: E402

BODY = {"prompt_token_ids": [256, 104, 105], "max_tokens": 1, "temperature": 0.0}


def unpack_rev(rev: str, dest: Path) -> Path:
    """``git archive REV xllm_eplb`` into ``dest``; returns ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    tar = dest / "src.tar"
    subprocess.run(["git", "archive", "-o", str(tar), rev, "xllm_eplb"], cwd=ROOT, check=True)
    with tarfile.open(tar) as t:
        t.extractall(dest, filter="data")
    return dest


def step_totals(conn: http.client.HTTPConnection) -> tuple[float, float]:
    """(sum, count) of ``xllm_eplb_step_duration_seconds`` from ``/metrics``."""
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    vals = {}
    for line in text.splitlines():
        for k in ("xllm_eplb_step_duration_seconds_sum", "xllm_eplb_step_duration_seconds_count"):
            if line.startswith(k + " "):
                vals[k] = float(line.split()[1])
    return vals["xllm_eplb_step_duration_seconds_sum"], vals["xllm_eplb_step_duration_seconds_count"]


def measure(port: int, n: int, warm: int) -> dict:
    """``warm`` + ``n`` sequential 1-token requests on one keep-alive connection."""
    api = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    mon = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    data = json.dumps(BODY).encode()
    lat, step, over = [], [], []
    for i in range(warm + n):
        s0, c0 = step_totals(mon)
        t0 = time.perf_counter()
        api.request("POST", "/v1/completions", body=data,
                    headers={"Content-Type": "application/json"})
        r = api.getresponse()
        body = r.read()
        dt = time.perf_counter() - t0
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {body[:300]!r}")
        s1, c1 = step_totals(mon)
        if i < warm or c1 <= c0:
            continue
        st = (s1 - s0)
        lat.append(dt)
        step.append(st)
        over.append(dt - st)
        time.sleep(0.02)
    api.close()
    mon.close()
    return {"requests": len(lat), "p50_ttft_ms": 1e3 * float(np.median(lat)),
            "p90_ttft_ms": 1e3 * float(np.percentile(lat, 90)),
            "mean_step_ms": 1e3 * float(np.mean(step)),
            "p50_overhead_ms": 1e3 * float(np.median(over)),
            "p90_overhead_ms": 1e3 * float(np.percentile(over, 90))}


def concurrent_clients(port: int, clients: int) -> dict:
    """``clients`` streaming requests in flight at once; all must complete."""
    sys.path.insert(0, str(ROOT))
    from xllm_eplb.commands.bench import make_prompts, run_bench

    res = run_bench(f"http://127.0.0.1:{port}", make_prompts(clients, 8, 16, 1.2, 0), 4,
                    clients, timeout=300)
    out = {k: res[k] for k in ("requests", "ok", "errors", "first_error", "seconds",
                               "ttft_p50_s", "ttft_p99_s", "e2e_p99_s")}
    out["all_complete"] = res["ok"] == clients and all(len(o) == 4 for o in res["outputs"])
    return out


def stream_matches(port: int, n: int = 8) -> bool:
    """Seeded sampled requests: streamed token ids == non-streamed token ids."""
    same = True
    for i in range(n):
        body = {"prompt": f"request {i}", "max_tokens": 16, "temperature": 1.0, "seed": i,
                "ignore_eos": True, "return_token_ids": True}
        same &= complete(port, body, stream=True, timeout=60) == complete(port, body, timeout=60)
    return same


def run_one(name: str, src: Path, tmp: Path, n: int, warm: int, clients: int = 0) -> dict:
    s = Server(None, tmp / f"logs_{name}", ["--config", str(ROOT / "configs" / "eplb.yaml"),
                                             "--enable_eplb=false"], ep=2, src=src)
    try:
        s.wait_ready()
        res = measure(s.port, n, warm)
        if clients:
            res["streaming_equals_non_streaming"] = stream_matches(s.port)
            res["concurrent"] = concurrent_clients(s.port, clients)
    finally:
        s.stop()
    print(f"{name:9s} requests={res['requests']} p50_ttft_ms={res['p50_ttft_ms']:.2f} "
          f"mean_step_ms={res['mean_step_ms']:.2f} p50_overhead_ms={res['p50_overhead_ms']:.2f} "
          f"p90_overhead_ms={res['p90_overhead_ms']:.2f}", flush=True)
    if "concurrent" in res:
        c = res["concurrent"]
        print(f"{name:9s} streaming_equals_non_streaming={res['streaming_equals_non_streaming']} "
              f"clients={c['requests']} ok={c['ok']} errors={c['errors']} "
              f"all_complete={c['all_complete']} seconds={c['seconds']:.2f}", flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="40 requests per server (~1 min)")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--requests", type=int, default=None, help="measured requests per server")
    ap.add_argument("--clients", type=int, default=200,
                    help="concurrent streaming clients on the current server (0 = skip)")
    ap.add_argument("--baseline-rev", default=None,
                    help="git revision to compare with (e.g. the stdlib server af629c8); "
                         "omitted: only this checkout")
    args = ap.parse_args()
    n = args.requests or (40 if args.quick else 200)
    warm = 5
    out: dict = {"requests": n, "ep_size": 2}
    with tempfile.TemporaryDirectory(prefix="bench_api_") as d:
        tmp = Path(d)
        if args.baseline_rev:
            base = unpack_rev(args.baseline_rev, tmp / "baseline_src")
            out["baseline_rev"] = args.baseline_rev
            out["baseline"] = run_one("baseline", base, tmp, n, warm)
        out["current"] = run_one("current", ROOT, tmp, n, warm, args.clients)
    if "baseline" in out:
        out["overhead_ratio"] = out["current"]["p50_overhead_ms"] / max(
            out["baseline"]["p50_overhead_ms"], 1e-9)
        print(f"overhead ratio current/baseline = {out['overhead_ratio']:.3f}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
