#!/usr/bin/env python3
"""Why the compute step stays above the roofline (issue 32): torch's CPU matrix products at a
decode batch's shapes, on this machine, in one run.

1. ``experts``: one MoE layer's experts at a batch of ``--batch`` tokens, top-``--top-k`` of
   ``--experts`` (routing drawn with ``--seed``), every way torch offers on CPU, ms per layer:
   reading the layer's expert weights once (``w.sum()``, the bound), the project's fused C++
   kernel (``xllm_eplb.kernels.fused_experts``, every instruction-set variant this CPU runs),
   ``grouped_ffn`` (the torch path, ``--moe_kernel=torch``: a padded ``bmm`` pair), a ``F.linear`` pair per expert, a ``mm`` pair per expert on
   pre-transposed contiguous weights, ``torch._grouped_mm`` (transformers' default experts),
   oneDNN and MKL with pre-packed weights per expert (where this torch build has them). Every
   way's output is compared with the torch path's (max abs difference). ``experts_bf16``: the
   same layer in bf16 (bound, torch path, fused kernel; differences against float64).
2. ``rows``: ``bmm`` over all the experts at 1..12 rows per expert (the GEMV path at 1 row,
   the packing GEMM path above).
3. ``dense``: ``F.linear`` at the batch's rows against a hidden x hidden weight: GFLOP/s and
   the weight's GB/s; ``dense_kernels``: ``F.linear`` against the kernels' batch-invariant
   ``linear`` at hidden x hidden and an LM head of ``--vocab`` rows, fp32 and bf16.
4. ``gloo``: two processes on gloo (loopback), ``all_to_all_single`` of 2 integers and of
   64 KiB, not pinned and pinned to a core each (skipped with fewer than 2 cores).

Default sizes are issue 32's ``compute`` checkpoint (hidden 768, MoE width 384, 32 experts
top-4, batch 32); ``--threads`` torch threads (2). Best of ``--repeat`` timings per number.

    python scripts/bench_kernels.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from xllm_eplb import kernels  # noqa: E402
from xllm_eplb.model.moe import grouped_ffn  # noqa: E402


def best_ms(fn, n: int, repeat: int) -> float:
    fn()
    fn()
    out = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        out = min(out, (time.perf_counter() - t) / n * 1e3)
    return out


def per_expert(xs, cl, first, second):
    """Rows ``xs`` sorted by expert (``cl`` rows each) through ``first(j, x)`` -> (g, u)
    and ``second(j, a)`` per active expert."""
    ys = torch.empty_like(xs)
    s = 0
    for j, c in enumerate(cl):
        if c:
            g, u = first(j, xs[s:s + c])
            ys[s:s + c] = second(j, (F.silu(g) * u).contiguous())
            s += c
    return ys


def experts(a, n: int, repeat: int) -> dict:
    g = torch.Generator().manual_seed(a.seed)
    E, H, inter = a.experts, a.hidden, a.moe_width
    w13 = torch.randn(E, 2 * inter, H, generator=g) * 0.02
    w2 = torch.randn(E, H, inter, generator=g) * 0.02
    x = torch.randn(a.batch, H, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:a.top_k] for _ in range(a.batch)]).flatten()
    xr = x.repeat_interleave(a.top_k, 0)
    order = torch.argsort(idx, stable=True)
    sidx, xs = idx[order], xr[order].contiguous()
    counts = torch.bincount(sidx, minlength=E)
    cl = counts.tolist()
    ref = grouped_ffn(xs, w13, w2, sidx)
    w13t, w2t = w13.transpose(1, 2).contiguous(), w2.transpose(1, 2).contiguous()
    ways = {
        "read_weights_once": lambda: w13.sum() + w2.sum(),
        "grouped_ffn_torch_path": lambda: grouped_ffn(xs, w13, w2, sidx),
        "linear_per_expert": lambda: per_expert(
            xs, cl, lambda j, v: F.linear(v, w13[j]).chunk(2, -1), lambda j, v: F.linear(v, w2[j])),
        "mm_per_expert_pretransposed": lambda: per_expert(
            xs, cl, lambda j, v: torch.mm(v, w13t[j]).chunk(2, -1), lambda j, v: torch.mm(v, w2t[j])),
    }
    offs = torch.cumsum(counts, 0).to(torch.int32)
    gm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    if gm is not None:
        def grouped():
            g_, u_ = gm(xs, w13.transpose(1, 2), offs=offs).chunk(2, -1)
            return gm(F.silu(g_) * u_, w2.transpose(1, 2), offs=offs)
        ways["torch_grouped_mm"] = grouped
    rows = max(cl)
    try:
        p13 = [torch.ops.mkldnn._reorder_linear_weight(w13[j], rows) for j in range(E)]
        p2 = [torch.ops.mkldnn._reorder_linear_weight(w2[j], rows) for j in range(E)]
        lin = torch.ops.mkldnn._linear_pointwise
        ways["onednn_prepacked_per_expert"] = lambda: per_expert(
            xs, cl, lambda j, v: lin(v, p13[j], None, "none", [], "").chunk(2, -1),
            lambda j, v: lin(v, p2[j], None, "none", [], ""))
    except (AttributeError, RuntimeError):
        pass
    try:
        m13 = [torch.ops.mkl._mkl_reorder_linear_weight(w13[j].contiguous(), rows) for j in range(E)]
        m2 = [torch.ops.mkl._mkl_reorder_linear_weight(w2[j].contiguous(), rows) for j in range(E)]
        mkl = torch.ops.mkl._mkl_linear
        ways["mkl_prepacked_per_expert"] = lambda: per_expert(
            xs, cl, lambda j, v: mkl(v, m13[j], w13[j], None, rows).chunk(2, -1),
            lambda j, v: mkl(v, m2[j], w2[j], None, rows))
    except (AttributeError, RuntimeError):
        pass
    if kernels.load():
        for isa in kernels.isas():
            ways[f"fused_kernel_{isa}"] = lambda isa=isa: kernels.fused_experts(xs, sidx, w13, w2,
                                                                                  isa=isa)
    out = {"rows_per_expert": cl, "weight_bytes": (w13.numel() + w2.numel()) * 4, "ms": {},
           "max_abs_diff": {}}
    for name, fn in ways.items():
        out["ms"][name] = best_ms(fn, n, repeat)
        if name != "read_weights_once":
            out["max_abs_diff"][name] = float((fn() - ref).abs().max())
    return out


def experts_bf16(a, n: int, repeat: int) -> dict:
    """The same layer in bf16: reading the weights once, the torch path, the fused kernel."""
    g = torch.Generator().manual_seed(a.seed)
    E, H, inter = a.experts, a.hidden, a.moe_width
    w13 = (torch.randn(E, 2 * inter, H, generator=g) * 0.02).bfloat16()
    w2 = (torch.randn(E, H, inter, generator=g) * 0.02).bfloat16()
    idx = torch.stack([torch.randperm(E, generator=g)[:a.top_k] for _ in range(a.batch)]).flatten()
    x = torch.randn(len(idx), H, generator=g).bfloat16()
    ref = grouped_ffn(x.double(), w13.double(), w2.double(), idx)
    ways = {"read_weights_once": lambda: w13.sum() + w2.sum(),
            "grouped_ffn_torch_path": lambda: grouped_ffn(x, w13, w2, idx)}
    if kernels.load():
        for isa in kernels.isas():
            ways[f"fused_kernel_{isa}"] = lambda isa=isa: kernels.fused_experts(x, idx, w13, w2,
                                                                                  isa=isa)
    out = {"weight_bytes": (w13.numel() + w2.numel()) * 2, "ms": {}, "max_abs_diff_vs_fp64": {}}
    for name, fn in ways.items():
        out["ms"][name] = best_ms(fn, n, repeat)
        if name != "read_weights_once":
            out["max_abs_diff_vs_fp64"][name] = float((fn().double() - ref).abs().max())
    return out


def rows_sweep(a, n: int, repeat: int, rows: list[int]) -> dict:
    E, H, inter = a.experts, a.hidden, a.moe_width
    w13, w2 = torch.randn(E, 2 * inter, H), torch.randn(E, H, inter)
    out = {}
    for m in rows:
        x, h = torch.randn(E, m, H), torch.randn(E, m, inter)
        out[m] = (best_ms(lambda x=x: torch.bmm(x, w13.transpose(1, 2)), n, repeat)
                  + best_ms(lambda h=h: torch.bmm(h, w2.transpose(1, 2)), n, repeat))
    return out


def dense(a, n: int, repeat: int) -> dict:
    x, w = torch.randn(a.batch, a.hidden), torch.randn(a.hidden, a.hidden)
    ms = best_ms(lambda: F.linear(x, w), 10 * n, repeat)
    return {"shape": [a.batch, a.hidden, a.hidden], "us": ms * 1e3,
            "gflops": 2 * a.batch * a.hidden * a.hidden / (ms * 1e6),
            "weight_gb_s": a.hidden * a.hidden * 4 / (ms * 1e6)}


def dense_kernels(a, n: int, repeat: int) -> dict:
    """``F.linear`` against the fused kernels' batch-invariant ``linear`` at the batch's rows,
    a hidden x hidden weight and an LM head of ``--vocab`` rows, fp32 and bf16: us per call."""
    out: dict = {}
    if not kernels.load():
        return out
    for dt in (torch.float32, torch.bfloat16):
        for o in (a.hidden, a.vocab):
            x, w = torch.randn(a.batch, a.hidden).to(dt), torch.randn(o, a.hidden).to(dt)
            key = f"{str(dt).replace('torch.', '')} [{a.batch}, {a.hidden}] x [{o}, {a.hidden}]"
            out[key] = {"F.linear": best_ms(lambda x=x, w=w: F.linear(x, w), 5 * n, repeat) * 1e3,
                        "kernels.linear": best_ms(lambda x=x, w=w: kernels.linear(x, w), 5 * n,
                                                  repeat) * 1e3}
    return out


def _gloo_rank(rank: int, port: int, pin: bool, calls: int, q) -> None:
    import torch.distributed as dist

    if pin:
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[rank]})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    res = {}
    for name, numel, dtype in (("2_ints", 2, torch.int64), ("64_KiB", 2 * 8192, torch.float32)):
        s, o = torch.ones(numel, dtype=dtype), torch.empty(numel, dtype=dtype)
        dist.all_to_all_single(o, s)
        dist.barrier()
        t = time.perf_counter()
        for _ in range(calls):
            dist.all_to_all_single(o, s)
        res[name] = (time.perf_counter() - t) / calls * 1e6
    dist.destroy_process_group()
    if rank == 0:
        q.put(res)


def gloo(calls: int) -> dict:
    import torch.multiprocessing as mp

    from xllm_eplb.launcher import free_port

    if len(os.sched_getaffinity(0)) < 2:
        return {"skipped": "fewer than 2 cores"}
    ctx = mp.get_context("spawn")
    out = {}
    for pin in (False, True):
        q = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=_gloo_rank, args=(r, port, pin, calls, q)) for r in range(2)]
        for p in procs:
            p.start()
        try:
            out["pinned" if pin else "not_pinned"] = q.get(timeout=120)
        finally:
            for p in procs:
                p.join(30)
                if p.is_alive():
                    p.kill()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer calls per timing (< 1 min)")
    ap.add_argument("--json", type=Path, help="write every number here")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--moe-width", type=int, default=384)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=4096, help="LM head rows of the dense row")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    n = 5 if a.quick else 20
    t0 = time.perf_counter()
    res = {"command": " ".join(sys.argv), "torch": torch.__version__, "threads": a.threads,
           "experts": experts(a, n, a.repeat), "experts_bf16": experts_bf16(a, n, a.repeat),
           "rows": rows_sweep(a, n, a.repeat, [1, 2, 4, 8] if a.quick else [1, 2, 4, 6, 8, 10, 12]),
           "dense": dense(a, n, a.repeat), "dense_kernels": dense_kernels(a, n, a.repeat),
           "gloo": gloo(50 if a.quick else 300)}
    e = res["experts"]
    print(f"one MoE layer's experts: batch {a.batch}, top-{a.top_k} of {a.experts}, hidden "
          f"{a.hidden}, width {a.moe_width}, {a.threads} threads; rows per expert "
          f"{min(e['rows_per_expert'])}-{max(e['rows_per_expert'])}, "
          f"{e['weight_bytes'] / 1e6:.0f} MB of weights")
    for name, ms in e["ms"].items():
        diff = e["max_abs_diff"].get(name)
        print(f"  {name:32s} {ms:7.2f} ms" + (f"   max |diff| {diff:.1e}" if diff is not None
                                                else ""))
    b = res["experts_bf16"]
    print(f"the same layer in bf16 ({b['weight_bytes'] / 1e6:.0f} MB of weights):")
    for name, ms in b["ms"].items():
        diff = b["max_abs_diff_vs_fp64"].get(name)
        print(f"  {name:32s} {ms:7.2f} ms" + (f"   max |diff vs fp64| {diff:.1e}"
                                                if diff is not None else ""))
    bound = e["ms"]["read_weights_once"]
    for name in [k for k in e["ms"] if k.startswith("fused_kernel")][:1]:
        print(f"fp32 {name} / reading the weights once: {e['ms'][name] / bound:.2f}x "
              f"(torch path {e['ms']['grouped_ffn_torch_path'] / bound:.2f}x)")
    print("bmm pair over every expert, ms by rows per expert: "
          + ", ".join(f"{m}: {ms:.2f}" for m, ms in res["rows"].items()))
    d = res["dense"]
    print(f"F.linear {d['shape']}: {d['us']:.0f} us, {d['gflops']:.0f} GFLOP/s, "
          f"{d['weight_gb_s']:.1f} GB/s of weight")
    for k, v in res["dense_kernels"].items():
        print(f"{k}: F.linear {v['F.linear']:.0f} us, kernels.linear {v['kernels.linear']:.0f} us")
    for k, v in res["gloo"].items():
        print(f"gloo all_to_all_single, 2 ranks, {k}: " + (
            ", ".join(f"{m} {us:.0f} us" for m, us in v.items()) if isinstance(v, dict) else v))
    res["seconds"] = time.perf_counter() - t0
    print(f"run time {res['seconds']:.0f} s")
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
