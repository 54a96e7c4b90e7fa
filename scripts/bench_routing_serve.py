#!/usr/bin/env python3
"""Per-step replica routing in ``serve``: MoE critical path and routing cost of each mode.

One run: a generated HF-format checkpoint (``xllm-eplb make-checkpoint --arch deepseek_v3``, 64
experts, top-4, 3 MoE layers, width ``--hidden`` and expert width ``--expert-width``), then one real server per ``--eplb_replica_routing`` mode (static, spread,
balanced) at EP4 on CPU with redundant slots and EPLB on with no publication gate
(``--eplb_min_peak_load_improvement=0``: every mode gets the policy's placements, which depend
only on the logical loads, not on how the mode spread the physical load; replicas sit on the
hot experts),
each driven by the same client requests (``xllm_eplb.commands.bench``: Zipf-skewed topic prompts,
temperature 0). A warm-up phase lets the first EPLB rounds commit; the measured phase is read as
deltas of ``/eplb/status``:

- ``critical_path_ms_per_step``: per decode step, the sum over MoE layers of the slowest rank's
  expert compute thread CPU (the work the routing mode redistributes), and ``ratio_vs_static``;
- ``solve_cpu_us_per_layer`` / ``solve_share_of_moe_cpu``: thread CPU of the per-step routing
  (``balanced``: the rank's count of its rows, the solve and its assignment; ``spread``: the
  assignment) per layer and step, and over the main-thread CPU of the MoE layers (thread CPU, so
  it does not depend on how the cores are shared);
- ``comm_ms_per_step_per_rank`` (wall) and ``comm_delta_vs_static_ms``: the count all-gather of
  ``balanced`` replaces the split-size all_to_all (one collective per layer either way), so its
  net cost is the difference to static's communication wait (noisy on a shared machine);
- the generated tokens of every mode must equal static's (asserted, reported).

    python scripts/bench_routing_serve.py [--quick] [--json PATH]
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from xllm_eplb.commands.bench import make_prompts, run_bench  # noqa: E402

MODES = ("static", "spread", "balanced")
LAYERS = 3                         # MoE layers of the generated checkpoint (plus one dense)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def status(url: str) -> dict:
    with urllib.request.urlopen(url + "/eplb/status", timeout=30) as r:
        return json.loads(r.read())


def start(ckpt: Path, mode: str, args, log_dir: Path):
    port = free_port()
    cmd = [sys.executable, "-m", "xllm_eplb", "serve", "--model", str(ckpt), "--ep-size",
           str(args.ep), "--port", str(port), "--log_dir", str(log_dir), "--workload=none",
           "--max_batch_size=32", "--enable_eplb=true", "--eplb_update_interval=2",
           "--eplb_min_peak_load_improvement=0",
           f"--redundant_experts_num={args.redundant}", f"--eplb_replica_routing={mode}",
           f"--enable_fused_mc2={args.fused}"]
    out = log_dir / "stdout.txt"
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out.open("w"),
                            stderr=(log_dir / "stderr.txt").open("w"), start_new_session=True)
    deadline = time.monotonic() + 300
    while "xllm-eplb ready" not in out.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(proc)
            raise RuntimeError(f"server did not start; see {log_dir}")
        time.sleep(0.3)
    return proc, f"http://127.0.0.1:{port}"


def stop(proc) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


def run_mode(ckpt: Path, mode: str, warm, measure, args, tmp: Path) -> dict:
    log_dir = tmp / mode
    log_dir.mkdir()
    print(f"bench_routing_serve mode={mode} starting", file=sys.stderr, flush=True)
    proc, url = start(ckpt, mode, args, log_dir)
    try:
        run_bench(url, warm, args.max_tokens, args.concurrency)
        s0 = status(url)
        res = run_bench(url, measure, args.max_tokens, args.concurrency)
        s1 = status(url)
    finally:
        stop(proc)

    def d(key):
        return s1["critical_path"].get(key, 0.0) - s0["critical_path"].get(key, 0.0)

    dsteps, steps = max(1.0, d("decode_steps")), max(1.0, d("steps"))
    moe, moe_cpu = max(1e-12, d("moe_s")), max(1e-12, d("moe_cpu_s"))
    per_rank_step = 1e3 / args.ep / steps
    return {"critical_path_ms_per_step": 1e3 * d("decode_critical_s") / dsteps,
            "mean_rank_ms_per_step": 1e3 * d("decode_expert_cpu_s") / args.ep / dsteps,
            "moe_cpu_ms_per_step_per_rank": moe_cpu * per_rank_step,
            "moe_wall_ms_per_step_per_rank": moe * per_rank_step,
            "comm_ms_per_step_per_rank": d("comm_s") * per_rank_step,
            "solve_cpu_us_per_layer": 1e3 * d("route_s") * per_rank_step / LAYERS,
            "solve_share_of_moe_cpu": d("route_s") / moe_cpu,
            "comm_share_of_moe_wall": d("comm_s") / moe,
            "decode_steps": dsteps, "layers_committed": s1.get("layers_committed", 0),
            "ok": res["ok"], "errors": res["errors"], "outputs": res["outputs"]}


def make_ckpt(folder: Path, args) -> Path:
    subprocess.run([sys.executable, "-m", "xllm_eplb", "make-checkpoint", "--arch",
                    "deepseek_v3", "--out", str(folder), "--num-layers", str(LAYERS + 1),
                    "--hidden-size", str(args.hidden), "--moe-intermediate-size",
                    str(args.expert_width)], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return folder


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer requests (about a minute)")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--ep", type=int, default=4)
    ap.add_argument("--redundant", type=int, default=4, help="redundant slots per rank")
    ap.add_argument("--fused", type=int, default=0, help="--enable_fused_mc2 (0 plain, 1 fused)")
    ap.add_argument("--concurrency", type=int, default=None,
                    help="requests in flight (default 16 with --quick, else 32)")
    ap.add_argument("--prompt-len", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=None, help="default 16 / 32")
    ap.add_argument("--skew", type=float, default=1.2)
    ap.add_argument("--hidden", type=int, default=256, help="model width of the checkpoint")
    ap.add_argument("--expert-width", type=int, default=256, help="expert FFN width")
    args = ap.parse_args(argv)
    args.concurrency = args.concurrency or (16 if args.quick else 32)
    args.max_tokens = args.max_tokens or (16 if args.quick else 32)
    n_warm, n_meas = (16, 16) if args.quick else (32, 96)
    warm = make_prompts(n_warm, args.prompt_len, 16, args.skew, seed=1)
    measure = make_prompts(n_meas, args.prompt_len, 16, args.skew, seed=2)
    with tempfile.TemporaryDirectory(prefix="bench_routing_serve_") as tmp:
        ckpt = make_ckpt(Path(tmp) / "ckpt", args)
        res = {m: run_mode(ckpt, m, warm, measure, args, Path(tmp)) for m in MODES}
    st = res["static"]
    out = {}
    for m, r in res.items():
        out[m] = {k: v for k, v in r.items() if k != "outputs"} | {
            "ratio_vs_static": r["critical_path_ms_per_step"] / st["critical_path_ms_per_step"],
            # the all-gather replaces the split-size all_to_all: its net cost is this difference
            "comm_delta_vs_static_ms": r["comm_ms_per_step_per_rank"]
            - st["comm_ms_per_step_per_rank"]}
    same = all(res[m]["outputs"] == res["static"]["outputs"] for m in MODES)
    summary = {"tokens_identical_across_modes": same, "modes": out,
               "args": vars(args) | {"json": str(args.json)}}
    text = json.dumps(summary, indent=2, default=str)
    print(text)
    if args.json:
        args.json.write_text(text)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
