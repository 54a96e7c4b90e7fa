"""Benchmark of the sharded MoE model on real gloo ranks (CPU).

Reports, for the tiny default model (the generated default checkpoint) at EP4:
1. exactness: sharded float64 logits vs the single-process reference (max abs diff);
2. overhead of the load counters + masks as a share of the MoE layer time;
3. plain vs overlapped ("fused") dispatch: median step time, median MoE time and the share of
   MoE time spent blocked on communication, for both.

Usage: python scripts/bench_model.py [--quick] [--json PATH] [--ep 4] [--steps N]

``--fp8`` (issue 32): the FP8 per-step expert path against the resident dequantized cache on
the compute-sized checkpoint (``make_checkpoint("qwen3_moe", quant="fp8")``: 4 MoE layers, 32
experts top-4, hidden 768, width 384, vocab 4096, 12 heads / 4 KV heads, 128 x 128 blocks;
fp32 model), EP1 (the sharded ``Decoder`` on a 1-rank gloo group) in one process with
``--threads`` torch threads: ``--batch`` prompts of 16 tokens, one prefill and ``--steps``
greedy decode steps, the cached (``--fp8_dequant_cache=true``) and per-step models stepped
alternately on the same tokens, ``--reps`` repetitions (the first a warm-up). Reported per
source tree: median decode step ms of each, per-step / cached, the median ``experts`` phase
(``StepTimer``) per decode step of each, the dequantization alone (per-step trees with
``Fp8Slots.dense_range``: every slot of one layer, chunk by chunk, best of 5), and whether
every step's logits were equal. ``--before DIR`` (another checkout, e.g. ``git archive
<commit> | tar -x -C DIR``): that tree's ``xllm_eplb`` runs the same, in alternating
processes with this tree's (``--rounds`` each).

    python scripts/bench_model.py --fp8 [--quick] [--json PATH] [--before DIR] [--batch 32]
        [--steps 32] [--threads 2] [--rounds 2] [--reps 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
#: ``--fp8`` child: the source tree to import (this one, or ``--before``'s)
TREE = os.environ.get("BENCH_MODEL_TREE") or str(ROOT)
sys.path.insert(0, TREE)

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


#: issue 32's compute-sized checkpoint, FP8 twin
FP8_SIZES = dict(num_layers=4, first_k_dense=0, num_experts=32, top_k=4, hidden_size=768,
                 moe_intermediate_size=384, vocab_size=4096, num_heads=12, num_kv_heads=4)


def fp8_child(ckpt: str, batch: int, steps: int, reps: int, threads: int) -> dict:
    """One process: the cached and per-step EP1 models of ``ckpt`` stepped alternately."""
    import torch
    import torch.distributed as dist

    from xllm_eplb.model.decoder import Decoder
    from xllm_eplb.obs.step_timer import StepTimer

    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/rdv", rank=0, world_size=1)
        try:
            models = {}
            for name, cache in (("cached", True), ("per_step", False)):
                cfg = Config(eplb=EplbConfig(ep_size=1, redundant_experts_num=0),
                             model=ModelConfig(model=ckpt, dtype="float32",
                                               fp8_dequant_cache=cache))
                models[name] = Decoder(cfg, 0, dist.group.WORLD)
                models[name].time_phases(StepTimer())
            res = _fp8_steps(models, batch, steps, reps)
        finally:
            dist.destroy_process_group()
    if hasattr(models["per_step"].moe_layers[0].store, "dense_range"):   # chunked per step
        res["layer_ms"] = _fp8_layer(models, batch)
    return res


class _CacheChunks:
    """The cached store's dense weights handed out chunk by chunk as the per-step store's
    ``dense_range`` would (no dequantization): the chunked GEMMs alone."""

    def __init__(self, cached, per_step):
        self.cache, self.n, self.chunk = cached.cache, per_step.n, per_step.chunk

    def dense_range(self, a: int, b: int):
        return self.cache[0][a:b], self.cache[1][a:b]


def _fp8_layer(models: dict, batch: int, reps: int = 20) -> dict:
    """One MoE layer's expert compute at a decode step of ``batch`` rows (top-k distinct
    random slots each), split: ``cached`` (``grouped_ffn`` over the resident cache),
    ``chunked_gemm`` (the same chunk loop over cache views: GEMMs alone), ``dequant`` (every
    slot's ``dense_range``, chunk by chunk: dequantization alone), ``per_step`` (both, as
    served). Median and best ms of ``reps`` interleaved timings each."""
    import torch

    from xllm_eplb.model.moe import chunk_spans, grouped_ffn

    cached, per = models["cached"].moe_layers[0], models["per_step"].moe_layers[0]
    k, S = cached.cfg.model.num_experts_per_tok, per.store.n
    g = torch.Generator().manual_seed(0)
    slots = torch.stack([torch.randperm(S, generator=g)[:k] for _ in range(batch)]).reshape(-1)
    x = torch.randn(slots.numel(), cached.cfg.model.hidden_size, generator=g)
    view = _CacheChunks(cached.store, per.store)
    fns = {"cached": lambda: grouped_ffn(x, *cached.store.weights(slots)),
           "chunked_gemm": lambda: grouped_ffn(x, None, None, slots, chunks=view),
           "dequant": lambda: [per.store.dense_range(a, b)
                               for a, b in chunk_spans(S, per.store.chunk)],
           "per_step": lambda: grouped_ffn(x, None, None, slots, chunks=per.store)}
    t: dict = {n: [] for n in fns}
    for r in range(reps + 1):
        for n, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            if r:
                t[n].append(1e3 * (time.perf_counter() - t0))
    return {"chunk_experts": per.store.chunk,
            **{n: {"median": statistics.median(v), "best": min(v)} for n, v in t.items()}}


def _fp8_steps(models: dict, batch: int, steps: int, reps: int) -> dict:
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 4096, 16).tolist() for _ in range(batch)]
    times = {n: [] for n in models}
    experts = {n: [] for n in models}
    equal, prefill = True, {n: [] for n in models}
    for rep in range(reps):
        for m in models.values():
            m.release(list(m.kv.slot_of))
        rows = RankBatch([SeqRow(i, p, 0, True) for i, p in enumerate(prompts)])
        for t in range(steps + 1):
            out = {}
            for name, m in models.items():
                m.timer.take()
                t0 = time.perf_counter()
                out[name] = m.forward_step(rows, pure_decode=t > 0, return_logits=True)
                dt = time.perf_counter() - t0
                if rep > 0:
                    (times[name] if t else prefill[name]).append(dt)
                    if t:
                        experts[name].append(m.timer.take().get("experts", 0.0))
            a, b = out["cached"], out["per_step"]
            equal = equal and torch_equal(a.logits, b.logits) and a.sampled == b.sampled
            rows = RankBatch([SeqRow(i, [a.sampled[i]], 16 + t, False) for i in range(batch)])
    med = {n: 1e3 * statistics.median(v) for n, v in times.items()}
    return {"step_ms": med, "per_step_over_cached": med["per_step"] / med["cached"],
            "step_ms_min": {n: 1e3 * min(v) for n, v in times.items()},
            "prefill_ms": {n: 1e3 * statistics.median(v) for n, v in prefill.items()},
            "experts_ms": {n: 1e3 * statistics.median(v) for n, v in experts.items()},
            "logits_equal": equal}


def torch_equal(a, b) -> bool:
    import torch

    return bool(torch.equal(a, b))


def fp8_main(args) -> int:
    steps = args.steps or (8 if args.quick else 32)
    reps = args.reps or 2
    rounds = args.rounds or (1 if args.quick else 2)
    trees = ([("before", str(Path(args.before).resolve()))] if args.before else []) + [
        ("after", str(ROOT))]
    out: dict = {"checkpoint": {"arch": "qwen3_moe", "quant": "fp8", **FP8_SIZES},
                 "batch": args.batch, "decode_steps": steps, "reps": reps,
                 "threads": args.threads, "runs": {name: [] for name, _ in trees}}
    with tempfile.TemporaryDirectory(prefix="bench_model_fp8_") as tmp:
        from xllm_eplb.model.checkpoint import make_checkpoint

        ckpt = str(make_checkpoint("qwen3_moe", Path(tmp) / "fp8", quant="fp8", **FP8_SIZES))
        for _ in range(rounds):
            for name, tree in trees:
                cmd = [sys.executable, __file__, "--fp8-child", ckpt, "--batch", str(args.batch),
                       "--steps", str(steps), "--reps", str(reps), "--threads", str(args.threads)]
                r = subprocess.run(cmd, env={**os.environ, "BENCH_MODEL_TREE": tree},
                                   capture_output=True, text=True, timeout=600)
                if r.returncode:
                    sys.stderr.write(r.stderr)
                    return 1
                res = json.loads(r.stdout.strip().splitlines()[-1])
                out["runs"][name].append(res)
                print(f"{name}: cached {res['step_ms']['cached']:.1f} ms, per-step "
                      f"{res['step_ms']['per_step']:.1f} ms -> {res['per_step_over_cached']:.2f}x; "
                      f"experts {res['experts_ms']['cached']:.1f} / "
                      f"{res['experts_ms']['per_step']:.1f} ms; logits "
                      f"{'==' if res['logits_equal'] else '!='}", flush=True)
                if "layer_ms" in res:
                    lm = res["layer_ms"]
                    print("  one layer, median ms: " + ", ".join(
                        f"{n} {lm[n]['median']:.2f}" for n in
                        ("cached", "chunked_gemm", "dequant", "per_step")) +
                        f" (chunks of {lm['chunk_experts']} experts)", flush=True)
    for name, runs in out["runs"].items():
        out[f"{name}_per_step_over_cached"] = statistics.median(
            r["per_step_over_cached"] for r in runs)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    ok = all(r["logits_equal"] for runs in out["runs"].values() for r in runs)
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small run (under a minute)")
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--ep", type=int, default=4)
    ap.add_argument("--steps", type=int, default=None, help="decode steps per repetition")
    ap.add_argument("--fp8", action="store_true",
                    help="FP8 experts: per-step dequantization vs the resident cache (EP1)")
    ap.add_argument("--before", help="--fp8: another source tree to measure alike")
    ap.add_argument("--batch", type=int, default=32, help="--fp8: prompts per step")
    ap.add_argument("--threads", type=int, default=2, help="--fp8: torch threads")
    ap.add_argument("--rounds", type=int, default=None, help="--fp8: processes per tree")
    ap.add_argument("--reps", type=int, default=None, help="--fp8: repetitions per process")
    ap.add_argument("--fp8-child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.fp8_child:
        print(json.dumps(fp8_child(args.fp8_child, args.batch, args.steps, args.reps,
                                   args.threads)))
        return 0
    if args.fp8:
        return fp8_main(args)
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
