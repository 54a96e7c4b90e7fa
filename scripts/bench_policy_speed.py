#!/usr/bin/env python
"""CPU time of one full-model ``incremental`` round (``gate.propose``) in one or more source
trees, interleaved, for before/after comparisons on a shared machine.

Each round runs every tree in its own process (``OMP_NUM_THREADS=1``): a fresh plan of
decode_in1000out1000 from xLLM's initial layout, then the drift to decode_in500out1500 from that
plan, best of ``--repeats`` process-CPU timings each; EP ``96`` means 384 experts at EP96+96
(the dumps' 256 experts plus 128 of them again, as ``bench_policy.py``). A tree is a checkout of this repository
(e.g. ``git worktree add /tmp/base <commit>``); only its ``xllm_eplb`` package is used.

Usage::

    .venv/bin/python scripts/bench_policy_speed.py /tmp/base . [--eps 32,64,128] [--rounds 4]
        [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "sglang_ep_statistics"

CHILD = r"""
import json, sys, time
import numpy as np
sys.path.insert(0, sys.argv[1])
from xllm_eplb.eplb.gate import propose
from xllm_eplb.eplb.loads import read_loads
from xllm_eplb.eplb.placement import initial_phy2log
from xllm_eplb.eplb.policy import make_policy
a = read_loads(sys.argv[2] + "/decode_in1000out1000.json").loads
b = read_loads(sys.argv[2] + "/decode_in500out1500.json").loads
out = {}
pick = np.random.default_rng(0).permutation(a.shape[1])[:128]
for d in map(int, sys.argv[3].split(",")):
    x, y = (a, b) if d != 96 else (np.concatenate([m, m[:, pick]], axis=1) for m in (a, b))
    init = np.tile(initial_phy2log(x.shape[1], d, 1), (x.shape[0], 1))
    bf = bd = float("inf")
    for _ in range(int(sys.argv[4])):
        pol = make_policy("incremental", d, x.shape[1], 1)
        t0 = time.process_time(); f = propose(pol, x, init, min_improvement=0.0).table
        bf = min(bf, time.process_time() - t0)
        t0 = time.process_time(); propose(pol, y, f, min_improvement=0.0)
        bd = min(bd, time.process_time() - t0)
    out[d] = {"fresh_ms": bf * 1000, "drift_ms": bd * 1000}
print(json.dumps(out))
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trees", nargs="+", help="source trees (repository checkouts)")
    ap.add_argument("--eps", default="32,64,128")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="EP32 only, 2 rounds")
    ap.add_argument("--json", default=None)
    ap.add_argument("--data", default=str(DATA))
    args = ap.parse_args(argv)
    for t in args.trees:
        if not (Path(t) / "xllm_eplb").is_dir():
            print(f"error: {t}: not a checkout (no xllm_eplb/ folder)", file=sys.stderr)
            return 2
    eps, rounds = ("32", 2) if args.quick else (args.eps, args.rounds)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    rows = []
    for r in range(rounds):
        for t in args.trees:
            p = subprocess.run([sys.executable, "-c", CHILD, str(Path(t).resolve()), args.data,
                                eps, str(args.repeats)], capture_output=True, text=True,
                               env=env, timeout=900)
            if p.returncode:
                print(f"error: {t}: {p.stderr.strip().splitlines()[-1]}", file=sys.stderr)
                return 2
            for d, v in json.loads(p.stdout).items():
                rows.append({"round": r, "tree": t, "ep": int(d), **v})
    print("| round | tree | EP | fresh ms | drift ms |\n|---:|---|---:|---:|---:|")
    for x in rows:
        print(f"| {x['round']} | {x['tree']} | {x['ep']}+{x['ep']} | {x['fresh_ms']:.1f} | "
              f"{x['drift_ms']:.1f} |")
    print(f"load average {os.getloadavg()[0]:.1f}", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
