#!/usr/bin/env python3
"""Speed against transformers: HF ``generate`` vs our single-process forward vs the engine at EP2.

All three run the same generated checkpoint (``make_checkpoint``, deepseek_v3, fp32), the same
batch of 32 equal-length prompts drawn by the synthetic workload's topic sampler, and greedy
decoding of ``--new`` tokens with EOS ignored, on this machine in this run:

- ``hf``: ``AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)``, transformers'
  defaults (sdpa attention, grouped_mm experts: what a user compares with), ``generate``;
- ``single``: ``Decoder.reference`` (every expert local, no dispatch), one prefill step then
  ``new - 1`` decode steps over all 32 rows;
- ``engine_ep2``: ``xllm-eplb serve --model DIR --ep-size 2`` (EPLB on), 32 concurrent
  ``/v1/completions`` by token ids; timed from the first request to the last answer.

tokens/s = 32 * new / wall seconds (prompt tokens are not counted). Ratios against ``hf`` are
reported, and whether each path's greedy tokens equal ``hf``'s. ``hf`` and ``single`` run with
``--threads`` torch threads (default 1: on a shared 2-core machine 2 threads made HF 50x
slower, measured). Configs: ``tiny`` (the default
checkpoint: 4 layers, 64 experts top-4, hidden 64) and ``compute`` (hidden 1024, 4 layers, 16
experts top-2; skipped by ``--quick``). Targets (issue 12): single >= 1.0x hf; engine_ep2 >=
0.9x hf at ``compute`` and >= 0.5x at ``tiny``.

    python scripts/bench_hf.py [--quick] [--json PATH] [--new 32] [--configs tiny compute]
    python scripts/bench_hf.py --quant fp8 [--quick] [--json PATH] [--configs ...]

``--quant fp8`` (issue 24): the engine at EP2 in bfloat16 on the same shapes three ways: a
bf16 checkpoint (``bf16``), its FP8 block-scaled twin (``make_checkpoint(quant="fp8")``, 128 x
128 blocks) with the step's active experts dequantized per step (``fp8_per_step``), and with
the resident dequantized cache (``fp8_cache``, ``--fp8_dequant_cache=true``). Reported: tok/s,
the ratio to ``bf16``, and whether the two FP8 modes produced identical tokens.

Needs the HF-checkpoint engine (``--model``); without it only ``hf`` is measured.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from xllm_eplb.model.checkpoint import make_checkpoint  # noqa: E402
from xllm_eplb.testing.roofline import HF_COMPUTE  # noqa: E402
from xllm_eplb.testing.serving import (  # noqa: E402
    Server,
    engine_serves_checkpoints,
    hf_greedy,
    hf_model,
    make_prompts,
    write_json,
)

BATCH = 32
CONFIGS = {
    "tiny": {},
    "compute": HF_COMPUTE,
}


def bench_hf(model_dir: Path, prompts, new: int) -> tuple[float, list[list[int]]]:
    model = hf_model(model_dir, defaults=True)
    hf_greedy(model, prompts[:2], 2)                          # warm-up
    t0 = time.perf_counter()
    out = hf_greedy(model, prompts, new)
    return time.perf_counter() - t0, out


def bench_single(model_dir: Path, prompts, new: int) -> tuple[float, list[list[int]]]:
    from xllm_eplb.flags import config_from_dict
    from xllm_eplb.model.batch import RankBatch, SeqRow
    from xllm_eplb.model.decoder import Decoder

    P = len(prompts[0])
    cfg = config_from_dict({"model": {"model": str(model_dir), "dtype": "float32"},
                            "eplb": {"ep_size": 2},   # validated; the reference has no EP
                            "runtime": {"max_batch_size": len(prompts),
                                        "max_prefill_tokens": len(prompts) * P}})
    model = Decoder.reference(cfg)

    def run(rows_prompts) -> list[list[int]]:
        ids = list(range(len(rows_prompts)))
        res = model.forward_step(RankBatch([SeqRow(i, p, 0, True) for i, p in
                                            zip(ids, rows_prompts, strict=True)]),
                                 pure_decode=False)
        out = [[res.sampled[i]] for i in ids]
        for t in range(new - 1):
            rows = [SeqRow(i, [out[i][-1]], P + t, False) for i in ids]
            res = model.forward_step(RankBatch(rows), pure_decode=True)
            for i in ids:
                out[i].append(res.sampled[i])
        model.release(ids)
        return out

    run(prompts[:2])                                          # warm-up
    t0 = time.perf_counter()
    out = run(prompts)
    return time.perf_counter() - t0, out


def bench_engine(model_dir: Path, prompts, new: int, log_dir: Path, *,
                 dtype: str = "float32", extra: tuple[str, ...] = ()):
    P = len(prompts[0])
    srv = Server.start(model_dir, log_dir, ["--enable_eplb=true", "--eplb_update_interval=2",
                                            f"--dtype={dtype}", f"--max_batch_size={len(prompts)}",
                                            f"--max_prefill_tokens={len(prompts) * P}", *extra],
                       ep=2)
    try:
        srv.complete_all(prompts[:4], 2)                      # warm-up
        t0 = time.perf_counter()
        out = srv.complete_all(prompts, new)
        return time.perf_counter() - t0, out
    finally:
        srv.stop()


def run_config(name: str, sizes: dict, new: int, prompt_len: int, work: Path) -> dict:
    model_dir = make_checkpoint("deepseek_v3", work / name, **sizes)
    prompts = make_prompts(model_dir, BATCH, prompt_len)
    tokens = BATCH * new
    res: dict = {"config": name, "sizes": sizes, "batch": BATCH, "new_tokens": new,
                 "prompt_len": prompt_len}
    dt, ref = bench_hf(model_dir, prompts, new)
    res["hf"] = {"seconds": dt, "tokens_per_s": tokens / dt}
    paths = {"single": lambda: bench_single(model_dir, prompts, new),
             "engine_ep2": lambda: bench_engine(model_dir, prompts, new, work / f"{name}-logs")}
    for path, fn in paths.items():
        if not engine_serves_checkpoints():
            res[path] = {"skipped": "this checkout has no --model (HF-checkpoint engine)"}
            continue
        dt, out = fn()
        res[path] = {"seconds": dt, "tokens_per_s": tokens / dt,
                     "vs_hf": (tokens / dt) / res["hf"]["tokens_per_s"],
                     "tokens_equal_hf": out == ref}
    return res


def run_fp8_config(name: str, sizes: dict, new: int, prompt_len: int, work: Path) -> dict:
    """bf16 vs FP8 (per-step, cached) through the engine at EP2, all in bfloat16."""
    dirs = {"bf16": make_checkpoint("deepseek_v3", work / f"{name}-bf16", dtype="bfloat16",
                                    **sizes),
            "fp8": make_checkpoint("deepseek_v3", work / f"{name}-fp8", dtype="bfloat16",
                                   quant="fp8", block_size=128, **sizes)}
    prompts = make_prompts(dirs["bf16"], BATCH, prompt_len)
    tokens = BATCH * new
    res: dict = {"config": name, "sizes": sizes, "batch": BATCH, "new_tokens": new,
                 "prompt_len": prompt_len, "dtype": "bfloat16"}
    runs = {"bf16": (dirs["bf16"], ()),
            "fp8_per_step": (dirs["fp8"], ("--fp8_dequant_cache=false",)),
            "fp8_cache": (dirs["fp8"], ("--fp8_dequant_cache=true",))}
    outs = {}
    for path, (d, extra) in runs.items():
        dt, outs[path] = bench_engine(d, prompts, new, work / f"{name}-{path}-logs",
                                      dtype="bfloat16", extra=extra)
        res[path] = {"seconds": dt, "tokens_per_s": tokens / dt}
    for path in ("fp8_per_step", "fp8_cache"):
        res[path]["vs_bf16"] = res[path]["tokens_per_s"] / res["bf16"]["tokens_per_s"]
    res["fp8_modes_tokens_equal"] = outs["fp8_per_step"] == outs["fp8_cache"]
    return res


def fp8_main(args, configs: list[str], new: int) -> int:
    out = {"quant": "fp8", "results": []}
    with tempfile.TemporaryDirectory(prefix="bench_hf_fp8_") as tmp:
        for name in configs:
            r = run_fp8_config(name, CONFIGS[name], new, args.prompt_len, Path(tmp))
            out["results"].append(r)
            print(f"{name} (EP2, bfloat16): bf16 {r['bf16']['tokens_per_s']:.0f} tok/s; "
                  f"fp8 per-step {r['fp8_per_step']['tokens_per_s']:.0f} tok/s "
                  f"({r['fp8_per_step']['vs_bf16']:.2f}x); fp8 cached "
                  f"{r['fp8_cache']['tokens_per_s']:.0f} tok/s ({r['fp8_cache']['vs_bf16']:.2f}x); "
                  f"fp8 modes' tokens {'==' if r['fp8_modes_tokens_equal'] else '!='}",
                  flush=True)
    write_json(args.json, out)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny config only, 8 new tokens")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--new", type=int, default=32, help="greedy tokens per prompt")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--configs", nargs="+", choices=sorted(CONFIGS), default=list(CONFIGS))
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads of hf and single (each engine worker uses its own)")
    ap.add_argument("--quant", choices=["none", "fp8"], default="none",
                    help="fp8: the engine on bf16 vs FP8 (per-step, cached) checkpoints")
    args = ap.parse_args()
    import torch

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    configs = ["tiny"] if args.quick else args.configs
    new = 8 if args.quick else args.new
    if args.quant == "fp8":
        if not engine_serves_checkpoints():
            print("skipped: this checkout has no --model (HF-checkpoint engine)")
            return 0
        return fp8_main(args, configs, new)
    out = {"torch_threads": torch.get_num_threads(), "results": []}
    with tempfile.TemporaryDirectory(prefix="bench_hf_") as tmp:
        for name in configs:
            r = run_config(name, CONFIGS[name], new, args.prompt_len, Path(tmp))
            out["results"].append(r)
            line = [f"{name}: hf {r['hf']['tokens_per_s']:.0f} tok/s"]
            for path in ("single", "engine_ep2"):
                v = r[path]
                line.append(f"{path} skipped" if "skipped" in v else
                            f"{path} {v['tokens_per_s']:.0f} tok/s ({v['vs_hf']:.2f}x, "
                            f"tokens {'==' if v['tokens_equal_hf'] else '!='} hf)")
            print("; ".join(line), flush=True)
    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
