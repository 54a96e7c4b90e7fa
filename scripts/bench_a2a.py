#!/usr/bin/env python3
"""Per-round latency of the EP all-to-all (issue 39): gloo's ``all_to_all_single`` against the
shared-memory all-to-all (``--ep_transport=shm``, ``ipc/alltoall.py``), in one run, on the same
ranks.

For every rank count in ``--ranks`` (default 2 and 4) one spawn of real processes (one torch
thread each, not pinned: the machine's cores are shared as in ``serve`` on a small machine)
times, per payload (``--sizes`` KiB per rank, split evenly over the destinations; default 0 (one
number per destination: a split-size round) and 64):

- ``gloo``: ``dist.all_to_all_single`` on the world group;
- ``shm``: ``ShmAllToAll.all_to_all`` (rows for this rank stay local, as in the dispatch).

Each round is timed on every rank (a barrier-free loop, as the MoE layers run); rank 0's p50,
p90 and mean in microseconds are reported, with the ratio gloo p50 / shm p50.

    python scripts/bench_a2a.py [--quick] [--json PATH] [--ranks 2,4] [--sizes 0,64]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from xllm_eplb.ipc.alltoall import ShmAllToAll, supported  # noqa: E402
from xllm_eplb.ipc.objects import sweep_run  # noqa: E402
from xllm_eplb.testing.dist import run_ranks  # noqa: E402


def _times(fn, rounds: int) -> list[float]:
    for _ in range(max(5, rounds // 10)):       # warm-up
        fn()
    out = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def _summary(ts: list[float]) -> dict:
    us = sorted(t * 1e6 for t in ts)
    return {"p50_us": statistics.median(us), "p90_us": us[int(0.9 * (len(us) - 1))],
            "mean_us": statistics.fmean(us), "rounds": len(us)}


def _rank(rank: int, world: int, run_id: str, sizes: list[int], rounds: int) -> dict:
    import torch
    import torch.distributed as dist

    res = {}
    with ShmAllToAll.open(run_id, 1, rank, world, 1 << 20, 60.0) as a2a:
        for kib in sizes:
            numel = max(world, kib * 1024 // 4 // world * world)    # float32, even split
            x = torch.ones(numel, dtype=torch.float32).view(world, -1)
            o = torch.empty_like(x)
            send = [1] * world
            dist.barrier()
            g = _times(lambda x=x, o=o: dist.all_to_all_single(o, x), rounds)
            dist.barrier()
            s = _times(lambda x=x, send=send: a2a.all_to_all(x, send), rounds)
            dist.barrier()
            res[f"{kib}_KiB"] = {"gloo": _summary(g), "shm": _summary(s),
                                 "bytes_per_rank": numel * 4}
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds per timing (< 1 min)")
    ap.add_argument("--json", type=Path, help="write every number here")
    ap.add_argument("--ranks", default="2,4", help="comma-separated rank counts")
    ap.add_argument("--sizes", default="0,64", help="comma-separated KiB per rank (0: 2 ints)")
    ap.add_argument("--rounds", type=int, default=2000)
    a = ap.parse_args()
    if not supported():
        print("the shared-memory all-to-all needs x86-64", file=sys.stderr)
        return 2
    rounds = 300 if a.quick else a.rounds
    sizes = [int(s) for s in a.sizes.split(",")]
    out = {"cores": len(os.sched_getaffinity(0)), "rounds": rounds, "ranks": {}}
    for world in (int(r) for r in a.ranks.split(",")):
        run_id = f"bench{os.getpid()}"
        try:
            per = run_ranks(_rank, world, run_id, sizes, rounds, timeout=600)
        finally:
            sweep_run(run_id)
        out["ranks"][world] = per[0]
        for k, v in per[0].items():
            g, s = v["gloo"], v["shm"]
            print(f"EP{world} {k:>7} per rank: gloo p50 {g['p50_us']:8.1f} us "
                  f"p90 {g['p90_us']:8.1f} | shm p50 {s['p50_us']:7.1f} us "
                  f"p90 {s['p90_us']:7.1f} | gloo/shm p50 {g['p50_us'] / s['p50_us']:.1f}x")
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
