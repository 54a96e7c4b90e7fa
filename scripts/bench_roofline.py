#!/usr/bin/env python3
"""How close a decode step comes to this machine's limit, beside transformers' default generate.

In one run, per config (a generated checkpoint and a batch of ``--batch`` prompts of
``--prompt-len`` tokens, ``--new`` greedy tokens each, EOS ignored):

1. the machine: read bandwidth (``x.sum()`` over a large fp32 tensor) and fp32 GEMM throughput
   (1024^3 and the batch's own expert shape), with ``--threads`` torch threads (cuda: the GPU);
2. the roofline: a lower bound of the whole generation, the prefill plus every decode step. A
   step must read the dense weights, the experts its batch touches (measured from the
   single-process run's routing) and the KV cache so far, and do ~2 FLOPs per active parameter
   per token plus attention; its bound is max(bytes / bandwidth, FLOPs / GEMM rate);
3. the rows, each on the same prompts: ``transformers`` (``AutoModelForCausalLM.from_pretrained(
   path, dtype=torch.float32)`` and nothing else: sdpa attention, grouped_mm experts; the same
   torch threads), ``single`` (our ``Decoder.reference`` stepping the whole batch in this
   process), ``engine EPn`` (``xllm-eplb serve --model DIR --ep-size n`` at default flags, the
   batch as concurrent ``/v1/completions``, timed from the first request to the last answer).

Printed per row: wall seconds, mean step time (wall / new tokens), tokens/s, the fraction of the
roofline, x transformers, whether its tokens equal transformers', and for the engine its
step-time breakdown (``/eplb/status`` ``step_breakdown``, this run's delta: model phases of the
slowest rank, ring, EPLB hooks, sampling, scheduling / HTTP, idle) and, per rank, the EP
all-to-all rounds per step, the mean round (seconds blocked on communication / rounds) and the
worker's wait for its input.

Configs: ``compute`` (qwen3_moe, hidden 768, 4 MoE layers, 32 experts top-4, width 384, vocab
4096, fp32: issue 32's), ``hf_compute`` (``scripts/bench_hf.py``'s ``compute``, deepseek_v3),
``tiny`` (the default checkpoint of ``serve`` without ``--model``; engine EP1, EP2, EP4) and
``compute_olmoe`` / ``compute_glm4_moe`` / ``compute_deepseek_v2`` (issue 40's families at
``compute``'s sizes, engine EP1; the roofline fraction compares them per parameter).
``--quick``: ``tiny`` only, 8 new tokens, EP1 and EP2. ``--device cuda``: transformers, single
and engine EP1 on one GPU (an engine that cannot start there is reported, the rest still runs).
``--before DIR`` (another checkout, e.g. ``git worktree add /tmp/before <commit>``): its
engine runs too, each EP size right before this tree's (rows ``before_engine_epN``), so a
before/after comparison shares one run's machine. Checkpoints go to ``.cache/bench_roofline``
(``--cache``), never into the repository's tree.

    python scripts/bench_roofline.py [--quick] [--json PATH] [--device cpu|cuda]
        [--configs compute hf_compute tiny] [--threads 2] [--batch 32] [--new 32]
        [--repeat 2] [--before DIR] [--transports dist,shm]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from xllm_eplb.testing.roofline import (  # noqa: E402
    COMPUTE,
    FAMILY_COMPUTE,
    HF_COMPUTE,
    roofline,
)
from xllm_eplb.testing.serving import (  # noqa: E402
    Server,
    hf_greedy,
    hf_model,
    make_prompts,
    timed,
    write_json,
)

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {"compute": ("qwen3_moe", COMPUTE, (1, 2)), "hf_compute": ("deepseek_v3", HF_COMPUTE,
                                                                      (1, 2)),
           "tiny": (None, None, (1, 2, 4)),
           **{f"compute_{f}": (f, sizes, (1,)) for f, sizes in FAMILY_COMPUTE.items()}}


# --- the machine ---------------------------------------------------------------------------
def _best(fn, reps: int, sync) -> float:
    """Best seconds of one ``fn()`` over ``reps`` timings, each of enough calls to last
    >= 5 ms (a tiny GEMM timed alone measures the clock)."""
    fn()
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    n = max(1, int(5e-3 / max(time.perf_counter() - t0, 1e-7)))
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        sync()
        best = min(best, (time.perf_counter() - t0) / n)
    return best


def machine(device: str, quick: bool, gemm_shape: tuple[int, int, int]) -> dict:
    """Read bandwidth (bytes/s) and fp32 GEMM rates (FLOP/s) on ``device``: on the CPU the
    best of 1 thread and the run's threads (on a shared machine a 2-thread op can be far slower
    than a 1-thread one: the roofline is what the machine can do)."""
    import torch

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    n = (64 if quick else 128) * (1 << 20) * (8 if device == "cuda" else 1)   # fp32 elements
    threads = torch.get_num_threads()
    counts = sorted({1, threads}) if device == "cpu" else [threads]
    x = torch.ones(n, dtype=torch.float32, device=device)
    out = {"device": device, "threads": threads, "read_bytes_per_s": 0.0}
    shapes = (("gemm_1024", (1024, 1024, 1024)), ("gemm_batch", gemm_shape))
    for t in counts:
        torch.set_num_threads(t)
        out["read_bytes_per_s"] = max(out["read_bytes_per_s"],
                                      4 * n / _best(lambda: x.sum(), 5, sync))
        for name, (m, k, nn) in shapes:
            a = torch.randn(m, k, device=device)
            b = torch.randn(k, nn, device=device)
            rate = 2 * m * k * nn / _best(lambda a=a, b=b: a @ b, 10, sync)
            out[f"{name}_flops"] = max(out.get(f"{name}_flops", 0.0), rate)
    torch.set_num_threads(threads)
    return out


# --- the roofline ----------------------------------------------------------------------------
# --- the rows --------------------------------------------------------------------------------
def run_transformers(model_dir: Path, prompts, new: int, device: str, repeat: int):
    model = hf_model(model_dir, defaults=True).to(device)     # dtype=torch.float32 only
    info = {"attn": model.config._attn_implementation,
            "experts": getattr(model.config, "_experts_implementation", "n/a")}
    hf_greedy(model, prompts[:2], 2, device=device)                  # warm-up
    dt, out = timed(lambda: hf_greedy(model, prompts, new, device=device), repeat)
    return dt, out, info


def run_single(model_dir: Path, prompts, new: int, device: str, repeat: int):
    """``Decoder.reference`` stepping every row in this process: one prefill, ``new - 1``
    decodes; -> (seconds, tokens, mean distinct experts per MoE layer of the last decode, the
    model-phase seconds its ``timer`` recorded)."""
    import numpy as np

    from xllm_eplb.flags import config_from_dict
    from xllm_eplb.model.batch import RankBatch, SeqRow
    from xllm_eplb.model.decoder import Decoder
    from xllm_eplb.obs.step_timer import StepTimer

    B, P = len(prompts), len(prompts[0])
    cfg = config_from_dict({"model": {"model": str(model_dir), "dtype": "float32"},
                            "eplb": {"ep_size": 1},
                            "runtime": {"device": device, "max_batch_size": B,
                                        "max_prefill_tokens": B * P}})
    model = Decoder.reference(cfg, device=device)
    touched: list[float] = []

    def gen(ps, last_routing=False):
        ids = list(range(len(ps)))
        rows = [SeqRow(i, p, 0, True) for i, p in zip(ids, ps, strict=True)]
        res = model.forward_step(RankBatch(rows), pure_decode=False)
        out = [[res.sampled[i]] for i in ids]
        for t in range(new - 1):
            routing = last_routing and t == new - 2
            res = model.forward_step(RankBatch([SeqRow(i, [out[i][-1]], P + t, False)
                                                for i in ids]),
                                     pure_decode=True, return_routing=routing)
            for i in ids:
                out[i].append(res.sampled[i])
            if routing:
                touched.extend(len(np.unique(r)) for r in res.routed)
        model.release(ids)
        return out

    gen(prompts[:2])                                                   # warm-up
    model.time_phases(StepTimer())     # model phases (a Decoder without them leaves it unread)
    dt, out = timed(lambda: gen(prompts, last_routing=True), repeat)
    phases = {p: s / repeat for p, s in model.timer.take().items()}   # per generation
    return dt, out, float(np.mean(touched)) if touched else 0.0, phases


def breakdown_delta(before: dict, after: dict) -> dict | None:
    """This run's share of the engine's cumulative ``step_breakdown`` (None: not reported)."""
    a, b = after.get("step_breakdown"), before.get("step_breakdown") or {}
    if not a:
        return None
    sec = {p: s - b.get("seconds", {}).get(p, 0.0) for p, s in a["seconds"].items()}
    wall = a["wall_s"] - b.get("wall_s", 0.0)
    old = b.get("per_rank") or [{} for _ in a["per_rank"]]
    ranks = [{p: s - o.get(p, 0.0) for p, s in r.items()}
             for r, o in zip(a["per_rank"], old, strict=False)]
    steps = a["steps"] - b.get("steps", 0)
    a2a = []                                     # issue 39: rounds and the mean round per rank
    olda = b.get("all_to_all") or [{} for _ in a.get("all_to_all", [])]
    for r, o in zip(a.get("all_to_all", []), olda, strict=False):
        n, c = r["rounds"] - o.get("rounds", 0), r["comm_s"] - o.get("comm_s", 0.0)
        a2a.append({"rounds_per_step": n / steps if steps else 0.0,
                    "round_us": 1e6 * c / n if n else 0.0})
    return {"wall_s": wall, "steps": steps, "seconds": sec,
            "fraction": {p: s / wall for p, s in sec.items()} if wall > 0 else {},
            "per_rank": ranks, "all_to_all": a2a}


def run_engine(model_dir: Path, prompts, new: int, ep: int, device: str, log_dir: Path,
               repeat: int, root: Path = ROOT, extra: tuple[str, ...] = ()):
    """(best seconds, tokens, the best run's breakdown) of the engine of the tree ``root``
    (``extra``: more serve flags, e.g. ``--ep_transport=dist``)."""
    flags = ([] if device == "cpu" else [f"--device={device}"]) + list(extra)
    srv = Server.start(model_dir, log_dir, flags, ep=ep, src=root)
    try:
        srv.complete_all(prompts[:4], 2)                                 # warm-up
        best = (float("inf"), None, None)
        for _ in range(repeat):
            before = srv.status()
            t0 = time.perf_counter()
            out = srv.complete_all(prompts, new)
            dt = time.perf_counter() - t0
            if dt < best[0]:
                best = (dt, out, breakdown_delta(before, srv.status()))
        return best
    finally:
        srv.stop()


# --- one config ------------------------------------------------------------------------------
def checkpoint_dir(name: str, cache: Path) -> Path:
    from xllm_eplb.model.checkpoint import make_checkpoint

    arch, sizes, _ = CONFIGS[name]
    if arch is None:                                   # serve's default checkpoint
        from xllm_eplb.flags import config_from_dict
        from xllm_eplb.model.default_checkpoint import ensure_checkpoint

        return ensure_checkpoint(config_from_dict({"model": {"model_cache_dir": str(cache)}}))
    d = cache / name
    if not (d / "config.json").is_file():
        make_checkpoint(arch, d, force=True, **sizes)
    return d


def prompts_for(model_dir: Path, batch: int, length: int) -> list[list[int]]:
    return make_prompts(model_dir, batch, length)


def run_config(name: str, args, eps: tuple[int, ...]) -> dict:
    model_dir = checkpoint_dir(name, args.cache)
    prompts = prompts_for(model_dir, args.batch, args.prompt_len)
    cfgj = json.loads((model_dir / "config.json").read_text())
    H = cfgj["hidden_size"]
    mach = machine(args.device, args.quick, (args.batch, H, cfgj.get("moe_intermediate_size", H)))
    ntok = args.batch * args.new
    rows: dict = {}
    dt, ref, info = run_transformers(model_dir, prompts, args.new, args.device, args.repeat)
    rows["transformers"] = {"seconds": dt, "impl": info}
    dt, out, touched, phases = run_single(model_dir, prompts, args.new, args.device,
                                          args.repeat)
    rows["single"] = {"seconds": dt, "tokens_equal": out == ref, "model_phases_s": phases}
    trees = [("before_", args.before)] if args.before else []
    for ep in eps if args.device == "cpu" else (1,):
        # --transports: this tree's engine once per --ep_transport (EP1 exchanges nothing)
        ways = [("", ())] if not args.transports or ep == 1 else \
            [(f"_{t}", (f"--ep_transport={t}",)) for t in args.transports]
        runs = [(f"{tag}engine_ep{ep}", root, ()) for tag, root in trees] + \
            [(f"engine_ep{ep}{suffix}", ROOT, flags) for suffix, flags in ways]
        for row, root, flags in runs:                # before and after, back to back
            try:
                dt, out, bd = run_engine(model_dir, prompts, args.new, ep, args.device,
                                         args.cache / "logs" / f"{name}-{row}", args.repeat,
                                         root, flags)
                rows[row] = {"seconds": dt, "tokens_equal": out == ref, "breakdown": bd}
            except Exception as e:  # noqa: BLE001 - e.g. the engine cannot run on this device
                rows[row] = {"skipped": f"{type(e).__name__}: {str(e)[-600:]}"}
    roof = roofline(model_dir, args.batch, args.prompt_len, args.new, touched, mach)
    hf_tps = ntok / rows["transformers"]["seconds"]
    for r in rows.values():
        if "seconds" in r:
            r.update(step_ms=1e3 * r["seconds"] / args.new, tokens_per_s=ntok / r["seconds"])
            r.update(of_roofline=r["tokens_per_s"] / roof["tokens_per_s"],
                     x_transformers=r["tokens_per_s"] / hf_tps)
    return {"config": name, "checkpoint": str(model_dir), "batch": args.batch,
            "prompt_len": args.prompt_len, "new_tokens": args.new, "machine": mach,
            "roofline": roof, "rows": rows}


def report(r: dict) -> None:
    m, roof = r["machine"], r["roofline"]
    print(f"\n== {r['config']}: {r['batch']} x ({r['prompt_len']} prompt + {r['new_tokens']} "
          f"new), {roof['weights_bytes'] / 2**20:.0f} MiB of weights; {m['device']} "
          f"{m['threads']} threads: read {m['read_bytes_per_s'] / 1e9:.1f} GB/s, GEMM "
          f"{m['gemm_1024_flops'] / 1e9:.0f} GFLOP/s (batch shape "
          f"{m['gemm_batch_flops'] / 1e9:.0f})")
    print(f"roofline: decode step >= {roof['decode_step_s'] * 1e3:.2f} ms "
          f"({roof['experts_touched_per_layer']:.1f}/{roof['num_experts']} experts touched), "
          f"prefill >= {roof['prefill_s'] * 1e3:.1f} ms -> {roof['tokens_per_s']:.0f} tok/s")
    print(f"{'row':<21}{'wall s':>8}{'step ms':>9}{'tok/s':>8}{'roofline':>9}{'x hf':>7}  tokens")
    for name, v in r["rows"].items():
        if "skipped" in v:
            print(f"{name:<21} skipped: {v['skipped'].splitlines()[-1][:100]}")
            continue
        same = "-" if "tokens_equal" not in v else ("==" if v["tokens_equal"] else "!=")
        print(f"{name:<21}{v['seconds']:>8.2f}{v['step_ms']:>9.1f}{v['tokens_per_s']:>8.0f}"
              f"{v['of_roofline']:>8.0%}{v['x_transformers']:>7.2f}  {same}")
        bd = v.get("breakdown")
        if bd:
            top = sorted(bd["fraction"].items(), key=lambda kv: -kv[1])
            print(f"{'':<21}breakdown ({bd['steps']} steps): "
                  + ", ".join(f"{p} {f:.0%}" for p, f in top if f >= 0.005))
            if bd.get("all_to_all") and bd["steps"]:
                n = bd["steps"]
                print(f"{'':<21}all-to-all per rank: " + ", ".join(
                    f"{a['rounds_per_step']:.0f} rounds/step x {a['round_us']:.0f} us"
                    for a in bd["all_to_all"]) + "; worker wait for its input ms/step: "
                    + ", ".join(f"{r.get('wait', 0.0) * 1e3 / n:.2f}" for r in bd["per_rank"]))
        elif "engine" in name:
            print(f"{'':<21}breakdown: not reported by this build (/eplb/status step_breakdown)")
        if v.get("model_phases_s"):
            tot = sum(v["model_phases_s"].values())
            print(f"{'':<21}model phases: " + ", ".join(
                f"{p} {s / tot:.0%}" for p, s in sorted(v["model_phases_s"].items(),
                                                        key=lambda kv: -kv[1])))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny only, 8 new tokens, EP1+EP2")
    ap.add_argument("--json", type=Path, help="write every number here")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--configs", nargs="+", choices=sorted(CONFIGS),
                    default=["compute", "hf_compute"])
    ap.add_argument("--threads", type=int, default=2, help="torch threads of transformers "
                    "and single (engine workers: serve's own --worker_cpu_affinity)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new", type=int, default=32, help="greedy tokens per prompt")
    ap.add_argument("--repeat", type=int, default=2, help="timed runs per row (best kept; "
                    "the machine may be shared)")
    ap.add_argument("--transports", type=lambda v: v.split(","), default=None,
                    help="comma-separated --ep_transport values (dist,shm): each EP>1 engine "
                    "row once per transport, back to back (rows engine_epN_<transport>)")
    ap.add_argument("--before", type=Path, help="another checkout of this project (e.g. "
                    "`git worktree add /tmp/before <commit>`): its engine runs beside this one's, "
                    "each EP size back to back (rows before_engine_epN)")
    ap.add_argument("--cache", type=Path, default=ROOT / ".cache" / "bench_roofline",
                    help="generated checkpoints and server logs")
    args = ap.parse_args()
    import torch

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: torch sees no CUDA device", file=sys.stderr)
        return 2
    configs = ["tiny"] if args.quick else args.configs
    if args.quick:
        args.new, args.repeat = 8, 1
    args.cache.mkdir(parents=True, exist_ok=True)
    out = {"command": " ".join(sys.argv), "torch_threads": args.threads, "results": []}
    for name in configs:
        eps = (1, 2) if args.quick else CONFIGS[name][2]
        r = run_config(name, args, eps)
        out["results"].append(r)
        report(r)
    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
