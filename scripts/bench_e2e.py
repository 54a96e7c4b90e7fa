#!/usr/bin/env python3
"""End-to-end serving benchmark: EPLB off vs on (vs on with no layer moving) on the skewed load.

For each EP size, three real servers (`xllm-eplb serve`, tiny CPU model, float64) are driven by
the same client requests (``xllm_eplb.commands.bench``: Zipf-skewed topic prompts, temperature
0, fixed lengths):

- ``off``: ``--enable_eplb=false``;
- ``on``: ``--enable_eplb=true --eplb_update_interval=2``; a warm-up phase lets the first
  rounds commit before the measured phase;
- ``nomove``: EPLB on with ``--eplb_min_peak_load_improvement=1`` (the gate never passes): the
  steady-state cost of counting, aggregating and running the policy when no layer moves.

Measured over the measured phase only (deltas of ``/eplb/status``):

- MoE critical path per step: sum over MoE layers of the slowest rank's expert compute CPU time
  (``time.thread_time`` around each ``FusedMoE.compute``, per rank, so it does not depend on how
  the 2 cores are shared), per decode step; ``imbalance`` = critical path / mean rank time;
- throughput (tokens/s) and P50/P99 request latency (wall clock: noisy on a shared machine);
- CPU per step: engine + worker process CPU time (psutil) / steps; ``overhead_no_move`` =
  nomove / off - 1 (two separate runs: noisy on a shared machine);
  ``overhead_no_move_direct`` = CPU spent inside EPLB code in the nomove run (manager calls of
  the step loop, the policy thread, the workers' executor hooks) / all engine + worker CPU;
- the generated tokens of off and on must be identical (asserted, reported).

    python scripts/bench_e2e.py [--quick] [--json PATH] [--ep 4 16]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from xllm_eplb.commands.bench import make_prompts, run_bench  # noqa: E402

MODES = {
    "off": ["--enable_eplb=false"],
    "on": ["--enable_eplb=true", "--eplb_update_interval=2"],
    "nomove": ["--enable_eplb=true", "--eplb_update_interval=2",
               "--eplb_min_peak_load_improvement=1"],
}
COMMON = ["--workload=none", "--dtype=float64", "--max_batch_size=16"]
#: extra model flags (default: the tiny model of configs/eplb.yaml, whose expert compute CPU time
#: grows about linearly with tokens; wider float64 experts are weight-bandwidth bound instead)
MODEL: list[str] = []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


class Server:
    def __init__(self, ep: int, flags: list[str], log_dir: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.out = log_dir / "stdout.txt"
        cmd = [sys.executable, "-m", "xllm_eplb", "serve", "--ep-size", str(ep), "--config",
               str(ROOT / "configs" / "eplb.yaml"), "--port", str(self.port), "--log_dir",
               str(log_dir), *COMMON, *flags]
        self.cmd = cmd
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.out.open("w"),
                                     stderr=(log_dir / "stderr.txt").open("w"),
                                     start_new_session=True)
        deadline = time.monotonic() + 300
        while "xllm-eplb ready" not in self.out.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server did not start; see {log_dir}")
            time.sleep(0.3)
        self.children = psutil.Process(self.proc.pid).children()

    def cpu_seconds(self) -> float:
        total = 0.0
        for p in self.children:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.NoSuchProcess:
                pass
        return total

    def status(self) -> dict:
        return get_json(self.url + "/eplb/status")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)


def wait_committed(srv: Server, layers: int, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    st = srv.status()
    while st.get("layers_committed", 0) < layers and time.monotonic() < deadline:
        time.sleep(0.5)
        st = srv.status()
    return st


def delta(a: dict, b: dict, key: str) -> float:
    return b["critical_path"].get(key, 0.0) - a["critical_path"].get(key, 0.0)


def run_mode(ep: int, mode: str, warm, measure, args, tmp: Path) -> dict:
    log_dir = tmp / f"ep{ep}_{mode}"
    log_dir.mkdir(parents=True)
    print(f"bench_e2e ep={ep} mode={mode} starting", file=sys.stderr, flush=True)
    srv = Server(ep, MODES[mode] + args.model_flags, log_dir)
    try:
        run_bench(srv.url, warm, args.max_tokens, args.concurrency)
        if mode == "on":
            st = wait_committed(srv, 1, 30)
            run_bench(srv.url, warm[: len(warm) // 2], args.max_tokens, args.concurrency)
        s0, c0 = srv.status(), srv.cpu_seconds()
        res = run_bench(srv.url, measure, args.max_tokens, args.concurrency)
        s1, c1 = srv.status(), srv.cpu_seconds()
    finally:
        srv.stop()
    steps = max(1.0, delta(s0, s1, "steps"))
    dsteps = max(1.0, delta(s0, s1, "decode_steps"))
    crit = delta(s0, s1, "decode_critical_s")
    mean_rank = delta(s0, s1, "decode_expert_cpu_s") / ep
    eplb_cpu = sum(delta(s0, s1, k) for k in ("eplb_engine_s", "eplb_worker_s",
                                               "manager_thread_cpu_s"))
    st = s1
    return {
        "eplb_cpu_share": eplb_cpu / max(1e-9, c1 - c0),
        "critical_path_ms_per_step": 1e3 * crit / dsteps,
        "imbalance": crit / mean_rank if mean_rank > 0 else float("nan"),
        "cpu_ms_per_step": 1e3 * (c1 - c0) / steps,
        "forward_cpu_ms_per_step": 1e3 * delta(s0, s1, "forward_cpu_s") / steps,
        "tokens_per_s": res["tokens_per_s"], "p50_s": res["p50_s"], "p99_s": res["p99_s"],
        "ok": res["ok"], "errors": res["errors"], "steps": steps,
        "balancedness_mean": st.get("balancedness_mean"),
        "layers_committed": st.get("layers_committed", 0), "rounds": st.get("rounds", 0),
        "outputs": res["outputs"],
    }


def bench_ep(ep: int, args, tmp: Path) -> dict:
    n_warm, n_meas = (16, 24) if args.quick else (4 * args.concurrency, 8 * args.concurrency)
    warm = make_prompts(n_warm, args.prompt_len, 16, args.skew, seed=1)
    measure = make_prompts(n_meas, args.prompt_len, 16, args.skew, seed=2)
    modes = ("off", "on") if args.quick and ep > 4 else ("off", "on", "nomove")
    res = {m: run_mode(ep, m, warm, measure, args, tmp) for m in modes}
    out = {m: {k: v for k, v in r.items() if k != "outputs"} for m, r in res.items()}
    out["tokens_identical_on_off"] = res["on"]["outputs"] == res["off"]["outputs"]
    out["critical_path_ratio_on_off"] = (res["on"]["critical_path_ms_per_step"]
                                         / res["off"]["critical_path_ms_per_step"])
    if "nomove" in res:
        out["overhead_no_move"] = (res["nomove"]["cpu_ms_per_step"]
                                   / res["off"]["cpu_ms_per_step"] - 1.0)
        out["overhead_no_move_forward"] = (res["nomove"]["forward_cpu_ms_per_step"]
                                           / res["off"]["forward_cpu_ms_per_step"] - 1.0)
        # direct: CPU spent inside EPLB code (manager calls, policy thread, executor hooks)
        # as a share of all engine + worker CPU, with EPLB on and no layer moving
        out["overhead_no_move_direct"] = res["nomove"]["eplb_cpu_share"]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="EP4 only, fewer requests (~1 min)")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--ep", type=int, nargs="+", default=None, help="EP sizes (default 4 16)")
    ap.add_argument("--concurrency", type=int, default=None,
                    help="client requests in flight (default 16 with --quick, else 64)")
    ap.add_argument("--prompt-len", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--skew", type=float, default=1.2)
    ap.add_argument("--model-flags", default=" ".join(MODEL),
                    help=f"extra serve flags for the model shape (default: {' '.join(MODEL)})")
    args = ap.parse_args(argv)
    args.model_flags = args.model_flags.split()
    args.concurrency = args.concurrency or (16 if args.quick else 64)
    eps = args.ep or ([4] if args.quick else [4, 16])
    with tempfile.TemporaryDirectory(prefix="bench_e2e_") as tmp:
        results = {f"ep{ep}": bench_ep(ep, args, Path(tmp)) for ep in eps}
    first = results[f"ep{eps[0]}"]
    summary = {"critical_path_ratio_on_off": first["critical_path_ratio_on_off"],
               "overhead_no_move": first.get("overhead_no_move"),
               "overhead_no_move_direct": first.get("overhead_no_move_direct"),
               "tokens_identical_on_off": all(r["tokens_identical_on_off"]
                                              for r in results.values()),
               "per_ep": results, "args": vars(args) | {"json": str(args.json)}}
    text = json.dumps(summary, indent=2, default=str)
    print(text)
    if args.json:
        args.json.write_text(text)
    return 0 if summary["tokens_identical_on_off"] else 1


if __name__ == "__main__":
    sys.exit(main())
