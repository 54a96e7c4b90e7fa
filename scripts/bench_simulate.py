#!/usr/bin/env python
"""Offline EPLB replay on the real DeepSeek decode loads: balanced vs incremental.

Runs ``xllm-eplb simulate`` (subprocess, exact command printed) on a trace built from the SGLang
decode dumps with a switch to the second decode dump half-way, at EP32 + 32 redundant slots,
for the ``balanced`` and ``incremental`` policies and two flag sets:

- ``defaults``: policy fed the raw window, gate 0.05;
- ``estimator``: EasyBalance estimate on (``--eplb_use_estimator``: 16 batches, 0.85), gate 0.05;
- ``tuned``: raw window, gate 0.02;
- ``nogate``: raw window, gate 0 (publish whenever the plan is predicted better at all): the
  cadence of vLLM and SGLang, which re-plan on every interval without an improvement gate.

``--sweep`` adds a grid over the update interval (5 s, 2 s) and the gate (0.05, 0.02, 0.01, 0)
and prints, for each cell, both policies' balancedness and slots moved and the
incremental/balanced slot ratio.

Reports balancedness (100-step windows) with and without EPLB, slots moved, rounds, timeouts,
the incremental/balanced slot ratio and the replay time. Falls back to a Zipf trace when
``../shared/data`` is absent.

Usage: ``python scripts/bench_simulate.py [--quick] [--json PATH] [--out DIR]``
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / ".." / "shared" / "data" / "sglang_ep_statistics"
FLAGSETS = {"defaults": [], "estimator": ["--eplb_use_estimator"],
            "tuned": ["--eplb_min_peak_load_improvement=0.02"],
            "nogate": ["--eplb_min_peak_load_improvement=0"]}
SWEEP_INTERVALS = (5, 2)
SWEEP_GATES = ("0.05", "0.02", "0.01", "0")
POLICIES = ("balanced", "incremental")
HEAD = ("balancedness_static", "balancedness_eplb", "balancedness_static_global_start",
        "balancedness_eplb_global_start", "slots_moved", "weight_copies", "rounds",
        "layers_committed", "timeouts", "first_activation_step", "step_cost_static_mean",
        "step_cost_eplb_mean", "wall_seconds")


def spec(steps: int) -> str:
    if (DATA / "decode_in1000out1000.json").is_file():
        return (f"sglang:decode_in1000out1000->decode_in500out1500,steps={steps},tokens=4096,"
                f"seed=0")
    return f"zipf:layers=58,experts=256,steps={steps},skew=1.0,depth=0.5,shift_every={steps // 2}"


def slots_by_round(log_path: Path) -> list[int]:
    """Slots moved by the layers each round activated, from the replay's ``simulate.log``
    (``EPLB rebalance`` starts a round, ``EPLB layer activated ... slots_moved=N`` counts)."""
    rounds: list[int] = []
    for line in log_path.read_text().splitlines():
        if "EPLB rebalance" in line:
            rounds.append(0)
        m = re.search(r"EPLB layer activated .*slots_moved=(\d+)", line)
        if m and rounds:
            rounds[-1] += int(m.group(1))
    return rounds


def run(policy: str, flags: list[str], steps: int, out: Path, interval: int = 5) -> dict:
    cmd = ["xllm-eplb", "simulate", "--generate", spec(steps), "--ep-size", "32",
           "--redundant-experts-num", "1", "--policy", policy,
           f"--eplb_update_interval={interval}", *flags, "--no-plots", "--out", str(out)]
    print("$", shlex.join(cmd), flush=True)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "xllm_eplb", *cmd[1:]], check=True, cwd=ROOT,
                   stdout=subprocess.DEVNULL)
    s = json.loads((out / "summary.json").read_text())
    row = {k: s[k] for k in HEAD}
    per_round = slots_by_round(out / "simulate.log")
    row.update(slots_first_round=per_round[0] if per_round else 0,
               slots_after_first_round=sum(per_round[1:]))
    row.update(policy=policy, command=shlex.join(cmd), total_seconds=time.perf_counter() - t0)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="400 steps, tuned flags only")
    ap.add_argument("--json", dest="json_path", default=None)
    ap.add_argument("--out", default="/tmp/xllm_eplb_bench_simulate")
    ap.add_argument("--sweep", action="store_true",
                    help="also sweep update interval x gate (16 more replays, ~2 min)")
    args = ap.parse_args()
    steps = 400 if args.quick else 2000
    sets = {"tuned": FLAGSETS["tuned"]} if args.quick else FLAGSETS
    results = {}
    for name, flags in sets.items():
        rows = {p: run(p, flags, steps, Path(args.out) / f"{name}_{p}") for p in POLICIES}
        b, i = rows["balanced"], rows["incremental"]
        results[name] = {"flags": flags, "rows": rows,
                         "slots_ratio_incremental_over_balanced":
                             i["slots_moved"] / max(b["slots_moved"], 1),
                         "slots_ratio_after_first_round":
                             i["slots_after_first_round"] / max(b["slots_after_first_round"], 1),
                         "balancedness_gap": b["balancedness_eplb"] - i["balancedness_eplb"]}
    print(f"\nsteps={steps} trace={spec(steps)}")
    print(f"{'flags':<9} {'policy':<12} {'bal_static':>10} {'bal_eplb':>9} {'bal_eplb_g':>10} "
          f"{'slots':>7} {'1st':>6} {'after':>6} {'rounds':>6} {'timeouts':>8} {'replay_s':>8}")
    for name, r in results.items():
        for p, row in r["rows"].items():
            print(f"{name:<9} {p:<12} {row['balancedness_static']:>10.4f} "
                  f"{row['balancedness_eplb']:>9.4f} {row['balancedness_eplb_global_start']:>10.4f}"
                  f" {row['slots_moved']:>7} {row['slots_first_round']:>6} "
                  f"{row['slots_after_first_round']:>6} {row['rounds']:>6} {row['timeouts']:>8} "
                  f"{row['wall_seconds']:>8.1f}")
        print(f"{name:<9} incremental/balanced slots = "
              f"{r['slots_ratio_incremental_over_balanced']:.3f} (after the first round "
              f"{r['slots_ratio_after_first_round']:.3f}), balancedness gap = "
              f"{r['balancedness_gap']:+.4f}")
    sweep = run_sweep(steps, Path(args.out)) if args.sweep else None
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({"bench": "simulate", "steps": steps,
                                                    "trace": spec(steps), "results": results,
                                                    "sweep": sweep}, indent=1))


def run_sweep(steps: int, out: Path) -> list[dict]:
    """Update interval x gate grid: both policies per cell, the slot ratio and the gap."""
    cells = []
    print(f"\n{'interval':>8} {'gate':>5} {'bal_eplb b':>10} {'bal_eplb i':>10} "
          f"{'slots b':>8} {'slots i':>8} {'ratio':>6} {'gap':>7}")
    for iv in SWEEP_INTERVALS:
        for gate in SWEEP_GATES:
            flags = [f"--eplb_min_peak_load_improvement={gate}"]
            b, i = [run(p, flags, steps, out / f"sweep_iv{iv}_g{gate}_{p}", interval=iv)
                    for p in POLICIES]
            cell = {"interval_s": iv, "gate": float(gate),
                    "balancedness_balanced": b["balancedness_eplb"],
                    "balancedness_incremental": i["balancedness_eplb"],
                    "slots_balanced": b["slots_moved"], "slots_incremental": i["slots_moved"],
                    "layers_committed_balanced": b["layers_committed"],
                    "layers_committed_incremental": i["layers_committed"],
                    "ratio": i["slots_moved"] / max(b["slots_moved"], 1),
                    "gap": b["balancedness_eplb"] - i["balancedness_eplb"]}
            cells.append(cell)
    for c in cells:
        print(f"{c['interval_s']:>8} {c['gate']:>5} {c['balancedness_balanced']:>10.4f} "
              f"{c['balancedness_incremental']:>10.4f} {c['slots_balanced']:>8} "
              f"{c['slots_incremental']:>8} {c['ratio']:>6.3f} {c['gap']:>+7.4f}")
    return cells


if __name__ == "__main__":
    main()
