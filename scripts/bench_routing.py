#!/usr/bin/env python
"""Benchmark per-step replica routing (static / spread / balanced) on real DeepSeek decode loads.

Placement: the ``incremental`` policy's fresh plan of ``decode_in1000out1000`` at EP32 + 32
redundant slots (one per rank), from xLLM's initial layout (as scripts/bench_policy.py plans it);
optionally also the noise-aware placement (``incremental`` with ``peak_z=z, step_tokens=D x
tokens_per_rank x 8``, ``eplb/policy/noise_aware.py``), planned the same way.

Sampling of one step of one layer: each of the ``D * tokens_per_rank`` tokens (source rank =
token index // tokens_per_rank) picks top-8 *distinct* experts, drawn successively without
replacement with probabilities proportional to the layer's dump load (Plackett-Luce; implemented
with the Gumbel-top-k trick: the 8 largest ``log p_e + Gumbel`` keys). ``counts [D, E]`` are the
resulting routed tokens per source rank and expert. Steps use a fixed seed.

Metric: per step and layer, max rank load / mean rank load; the table gives its mean over the
sampled layers and steps for static, spread, balanced, and the LP bound (exact fractional optimum
of the max rank load over any split of each expert's step total over its replicas, solved with
highspy in the same run; the integer optimum is its ceiling, reported too). ``solve_us`` is the
thread CPU time of ``balanced``'s solve for one layer (``replica_routing.balanced_flex``), and
``source_row_us`` of what a serving rank computes (``balanced_rank``: the solve, then source 0's
slot for each of its rows and its split sizes), mean over the sampled layers.

Usage::

    .venv/bin/python scripts/bench_routing.py [--quick] [--json out.json] [--data DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from xllm_eplb.eplb import replica_routing as rr  # noqa: E402
from xllm_eplb.eplb.loads import read_loads  # noqa: E402
from xllm_eplb.eplb.placement import initial_phy2log  # noqa: E402
from xllm_eplb.eplb.policy import make_policy  # noqa: E402
from xllm_eplb.testing.lp import lp_peak  # noqa: E402

TOP_K = 8
DEFAULT_DATA = ROOT.parent / "shared/data/sglang_ep_statistics"


def sample_counts(p: np.ndarray, d: int, tpr: int, rng) -> np.ndarray:
    """counts [D, E] int64 of one step (see module doc)."""
    n = d * tpr
    keys = np.log(np.maximum(p, 1e-300))[None, :] - np.log(-np.log(rng.random((n, p.size))))
    top = np.argpartition(-keys, TOP_K, axis=1)[:, :TOP_K]
    src = np.repeat(np.arange(d), tpr * TOP_K)
    flat = src * p.size + top.ravel()
    return np.bincount(flat, minlength=d * p.size).reshape(d, p.size).astype(np.int64)


def cpu_us(fn, repeat: int) -> float:
    """Best-of-3 mean thread CPU microseconds of ``fn()`` over ``repeat`` calls."""
    best = np.inf
    for _ in range(3):
        t0 = time.thread_time()
        for _ in range(repeat):
            fn()
        best = min(best, (time.thread_time() - t0) / repeat)
    return best * 1e6


def incremental_plan(loads: np.ndarray, d: int, r: int, **opts) -> np.ndarray:
    e = loads.shape[1]
    table = make_policy("incremental", d, e, r, **opts).plan_table(
        loads, np.tile(initial_phy2log(e, d, r), (loads.shape[0], 1)))
    return table


def bench_size(name, table, loads, d, tpr, layers, steps, rng, timing_repeat):
    """One row: means over (layer, step) of the step's max/mean rank load per mode + LP."""
    acc = {m: [] for m in (*rr.MODES, "lp", "lp_int")}
    t_solve, t_row = [], []
    for li in layers:
        plan = rr.prepare(table[li], loads.shape[1], d)
        p = loads[li] / loads[li].sum()
        for _ in range(steps):
            c = sample_counts(p, d, tpr, rng)
            mean = c.sum() / d
            for m in rr.MODES:
                acc[m].append(rr.rank_loads(rr.slot_loads(c, plan, m), d).max() / mean)
            v = lp_peak(table[li], c.sum(axis=0), d)
            acc["lp"].append(v / mean)
            acc["lp_int"].append(np.ceil(v - 1e-6) / mean)
        t_solve.append(cpu_us(lambda c=c, plan=plan: rr.balanced_flex(c, plan), timing_repeat))
        ids0 = np.repeat(np.arange(c.shape[1]), c[0])          # source 0's routed rows
        t_row.append(cpu_us(lambda c=c, plan=plan, ids0=ids0: rr.balanced_rank(c, plan, 0, ids0),
                            timing_repeat))
    row = {"placement": name, "tokens_per_rank": tpr, "samples": len(acc["lp"])}
    row.update({m: float(np.mean(v)) for m, v in acc.items()})
    row["balanced_over_lp"] = row["balanced"] / row["lp"]
    row["solve_us"] = float(np.mean(t_solve))
    row["source_row_us"] = float(np.mean(t_row))
    return row


def to_markdown(rows) -> str:
    out = ["| placement | tokens/rank | static | spread | balanced | LP bound | LP (integer) | "
           "balanced / LP | solve us/layer | rank us/layer |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for x in rows:
        out.append(f"| {x['placement']} | {x['tokens_per_rank']} | {x['static']:.4f} | "
                   f"{x['spread']:.4f} | {x['balanced']:.4f} | {x['lp']:.4f} | "
                   f"{x['lp_int']:.4f} | {x['balanced_over_lp']:.4f} | {x['solve_us']:.0f} | "
                   f"{x['source_row_us']:.0f} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=str(DEFAULT_DATA), help="SGLang dump directory")
    ap.add_argument("--quick", action="store_true", help="every 4th layer, 2 steps, no 1024")
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--steps", type=int, default=None, help="sampled steps per layer")
    ap.add_argument("--noise-aware", action="store_true",
                    help="also measure the noise-aware placement (eplb/policy/noise_aware.py)")
    ap.add_argument("--z", type=float, nargs="+", default=[1.0, 2.0],
                    help="noise-aware sigma multiples to measure")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    path = Path(args.data) / "decode_in1000out1000.json"
    if not path.is_file():
        print(f"error: --data {args.data}: decode_in1000out1000.json not found", file=sys.stderr)
        return 2
    loads = read_loads(path).loads
    d, r = 32, 1
    layers = range(0, loads.shape[0], 4 if args.quick else 1)
    steps = args.steps or (2 if args.quick else 3)
    sizes = (16, 128) if args.quick else (16, 128, 1024)
    base = incremental_plan(loads, d, r)
    rows = []
    for tpr in sizes:
        plans = [("incremental", base)]
        if args.noise_aware:
            for z in args.z:
                plans.append((f"noise_aware z={z:g}", incremental_plan(
                    loads, d, r, peak_z=z, step_tokens=d * tpr * TOP_K)))
        for name, table in plans:
            t0 = time.perf_counter()
            rng = np.random.default_rng(args.seed + tpr)      # same steps for every placement
            rows.append(bench_size(name, table, loads, d, tpr, layers, steps, rng,
                                   20 if args.quick else 50))
            print(f"{name} {tpr} tokens/rank: {time.perf_counter() - t0:.1f}s "
                  f"{json.dumps(rows[-1])}", file=sys.stderr)
    print(to_markdown(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
