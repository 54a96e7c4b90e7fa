"""Benchmark of the sharded MoE model on real gloo ranks (CPU).

Reports, for the tiny default model (the generated default checkpoint) at EP4:
1. exactness: sharded float64 logits vs the single-process reference (max abs diff);
2. overhead of the load counters + masks as a share of the MoE layer time;
3. plain vs overlapped ("fused") dispatch: median step time, median MoE time and the share of
   MoE time spent blocked on communication, for both.

Usage: python scripts/bench_model.py [--quick] [--json PATH] [--ep 4] [--steps N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from xllm_eplb.config import Config, EplbConfig, ModelConfig  # noqa: E402
from xllm_eplb.engine.workload import TopicPrompts  # noqa: E402
from xllm_eplb.model.batch import RankBatch, SeqRow  # noqa: E402
from xllm_eplb.model.default_checkpoint import with_default_checkpoint  # noqa: E402


def make_workload(cfg: Config, ep: int, rows: int, prompt: int, steps: int, seed: int = 0):
    """steps[t][rank]: one prefill step then ``steps`` pure-decode steps, ``rows`` per rank;
    prompts drawn from Zipf(1.2)-weighted topics of the checkpoint ``cfg.model.model``."""
    rng = np.random.default_rng(seed)
    tp = TopicPrompts.for_checkpoint(cfg.model.model)
    T = tp.num_topics
    topic_p = 1.0 / np.arange(1, T + 1) ** 1.2
    topic_p /= topic_p.sum()
    out = [[RankBatch([SeqRow(r * rows + j, tp.sample(int(rng.choice(T, p=topic_p)), prompt, rng),
                              0, True) for j in range(rows)])
        for r in range(ep)]]
    for t in range(steps):
        out.append([RankBatch([SeqRow(r * rows + j, [int(rng.integers(0, 256))], prompt + t,
                                      False) for j in range(rows)]) for r in range(ep)])
    return out


def _bench_rank(rank, world, cfgs, steps, reps):
    import torch

    from xllm_eplb.engine.scheduler import is_pure_decode_step
    from xllm_eplb.model.decoder import Decoder

    torch.set_num_threads(1)
    out = {}
    models = {name: Decoder(cfg, rank) for name, cfg in cfgs.items()}
    for rep in range(reps):
        recs = {name: [] for name in models}
        for model in models.values():
            model.release(list(model.kv.slot_of))
        for batches in steps:                        # interleave modes step by step: the
            for name, model in models.items():       # machine's noise hits all alike
                res = model.forward_step(batches[rank], pure_decode=is_pure_decode_step(batches),
                                         return_logits=rep == 0)
                recs[name].append((res.timings, res.mode, None if res.logits is None
                                   else res.logits.numpy()))
        for name, rec in recs.items():
            out.setdefault(name, []).append(rec)
    return out


def summarize(per_rank, name, ep, reps, n_steps) -> dict:
    """Decode steps of every rank and every repetition after the first (warm-up)."""
    tm = [per_rank[r][name][rep][t][0] for r in range(ep) for rep in range(1, reps)
          for t in range(1, n_steps)]
    moe = sum(x["moe_s"] for x in tm)
    return {"mode": per_rank[0][name][0][1][1],
            "step_ms_median": 1e3 * statistics.median(x["total_s"] for x in tm),
            "moe_ms_median": 1e3 * statistics.median(x["moe_s"] for x in tm),
            "comm_wait_share_of_moe": sum(x["comm_wait_s"] for x in tm) / moe,
            "counter_share_of_moe": sum(x["counter_s"] for x in tm) / moe}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small run (under a minute)")
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--ep", type=int, default=4)
    ap.add_argument("--steps", type=int, default=None, help="decode steps per repetition")
    args = ap.parse_args()
    steps_n = args.steps or (8 if args.quick else 32)
    reps = 2 if args.quick else 4
    rows = 8
    from xllm_eplb.testing.dist import run_ranks
    from xllm_eplb.testing.harness import reference_steps

    base = with_default_checkpoint(Config(eplb=EplbConfig(ep_size=args.ep), model=ModelConfig()))
    cfgs = {"plain": replace(base, eplb=replace(base.eplb, enable_fused_mc2=0)),
            "fused": replace(base, eplb=replace(base.eplb, enable_fused_mc2=1))}
    exact_cfg = replace(base, model=replace(base.model, dtype="float64"))   # same files, fp64
    steps = make_workload(base, args.ep, rows, 16, steps_n)
    t0 = time.perf_counter()
    per_rank = run_ranks(_bench_rank, args.ep, {"exact64": exact_cfg, **cfgs}, steps, reps,
                         timeout=600)
    wall = time.perf_counter() - t0
    ref = reference_steps(exact_cfg, steps)
    diff = max(float(np.abs(per_rank[r]["exact64"][0][t][2] - ref[t][r].logits).max())
               for r in range(args.ep) for t in range(len(steps)))
    result = {"ep": args.ep, "rows_per_rank": rows, "decode_steps": steps_n, "reps": reps,
              "max_abs_logit_diff_float64": diff, "wall_s": wall}
    for name in cfgs:
        result[name] = summarize(per_rank, name, args.ep, reps, len(steps))
    result["fused_over_plain_step"] = (result["fused"]["step_ms_median"]
                                       / result["plain"]["step_ms_median"])
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
