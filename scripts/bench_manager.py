#!/usr/bin/env python
"""Engine-side EPLB manager overhead per step, with no round in flight.

Per step the engine calls ``eplb_info(allow=True)``, ``on_outputs(counters, tokens, -1)`` and
``tick()``; this times those three calls together (``time.perf_counter_ns``) for:

- ``thread`` runner (production): aggregation runs on the background thread. Between steps a
  modelled forward of ``--forward-ms`` (sleep) lets the thread drain, as in the engine (a
  second row runs back to back, forward 0: no sleep-wake cost, but the thread competes for the
  GIL);
- ``sync`` runner: aggregation inline (what ``simulate`` and the tests use).

Wall time (``perf_counter``) and the calling thread's CPU time (``thread_time``: not inflated
when a loaded machine preempts the process). Sizes: small (3 MoE layers, EP4, 64 experts) and DeepSeek-like (58 layers, EP32, 256 experts,
1 redundant slot per rank). The update interval is huge so no round starts.

Usage: ``python scripts/bench_manager.py [--quick] [--json PATH]``
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import time

import numpy as np

from xllm_eplb.config import EplbConfig
from xllm_eplb.eplb.manager import EplbManager

SIZES = {"small": (3, 4, 64, 1), "deepseek": (58, 32, 256, 1)}


def bench(runner: str, size: str, steps: int, forward_ms: float) -> dict:
    layers, ep, experts, red = SIZES[size]
    cfg = EplbConfig(ep_size=ep, redundant_experts_num=red, eplb_update_interval=1e9,
                     eplb_first_round_samples=0,
                     eplb_policy_kind="balanced")
    mgr = EplbManager(cfg, layers, experts, runner=runner)
    slots = experts // ep + red
    rng = np.random.default_rng(0)
    counters = [np.cumsum(rng.integers(0, 20, size=(layers, slots)), axis=1)
                for _ in range(ep)]
    tokens = [-1] * ep
    times = np.empty(steps, dtype=np.float64)
    cpu = np.empty(steps, dtype=np.float64)
    try:
        for i in range(steps):
            c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
            mgr.eplb_info(True)
            mgr.on_outputs(counters, tokens, -1)
            mgr.tick()
            times[i] = (time.perf_counter_ns() - t0) / 1e3
            cpu[i] = (time.thread_time_ns() - c0) / 1e3
            if forward_ms:
                time.sleep(forward_ms / 1e3)
        st = mgr.stats()
    finally:
        mgr.close()
    assert st["rounds"] == 0 and st["samples_rejected"] == 0
    return {"runner": runner, "size": size, "layers": layers, "ep_size": ep,
            "experts": experts, "steps": steps, "forward_ms": forward_ms,
            "median_us": round(float(np.median(times)), 2),
            "p99_us": round(float(np.percentile(times, 99)), 2),
            "mean_us": round(float(times.mean()), 2),
            "cpu_median_us": round(float(np.median(cpu)), 2),
            "cpu_mean_us": round(float(cpu.mean()), 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps (under a minute)")
    ap.add_argument("--json", dest="json_path", default=None, help="write results as JSON")
    ap.add_argument("--forward-ms", type=float, default=2.0,
                    help="modelled forward time between steps (thread runner)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    steps = 300 if args.quick else 3000
    rows = []
    for size in SIZES:
        rows.append(bench("thread", size, steps, args.forward_ms))
        rows.append(bench("thread", size, steps, 0.0))
        rows.append(bench("sync", size, steps, 0.0))
    print(f"{'runner':<7} {'size':<9} {'L':>3} {'EP':>3} {'E':>4} {'fwd_ms':>6} {'steps':>6} "
          f"{'median_us':>10} {'p99_us':>9} {'cpu_med_us':>10} {'cpu_mean_us':>11}")
    for r in rows:
        print(f"{r['runner']:<7} {r['size']:<9} {r['layers']:>3} {r['ep_size']:>3} "
              f"{r['experts']:>4} {r['forward_ms']:>6} {r['steps']:>6} {r['median_us']:>10} "
              f"{r['p99_us']:>9} {r['cpu_median_us']:>10} {r['cpu_mean_us']:>11}")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({"bench": "manager_overhead", "quick": args.quick,
                       "python": platform.python_version(), "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
