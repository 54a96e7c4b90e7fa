#!/usr/bin/env python3
"""Decode step time per active parameter of every family, beside qwen3_moe, in one process.

Per family a generated checkpoint of ``bench_roofline.py``'s ``compute`` sizes (hidden 768, 4
layers all MoE, 32 experts top-4, width 384, 12 heads, vocab 4096, fp32; the deepseek_v2 MLA
ranks of ``FAMILY_COMPUTE``; glm4_moe and deepseek_v2 with their shared expert), run as
``Decoder.reference`` (single process, every expert local): ``--batch`` prompts of
``--prompt-len`` tokens prefilled, then ``--steps`` greedy decode steps timed. The families run
in interleaved rounds (A B C ... A B C ...); per round the median step, per family the best
round (the least disturbed: on the shared machine a round's median moved 10x, 36 -> 894 ms,
while another family's neighbouring round did not).

Active parameters per token: every weight a token's decode step reads except the embedding
(attention, norms, routers, shared experts, dense layers, LM head) plus ``top_k`` experts per
MoE layer. Printed per family: step ms, active parameters (M), ms per M active parameters, and
that ratio over qwen3_moe's (the issue-40 target: <= 1.2).

    python scripts/bench_families.py [--quick] [--json PATH] [--threads 2] [--batch 32]
        [--steps 16] [--rounds 3] [--families qwen3_moe olmoe ...]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from xllm_eplb.testing.roofline import (  # noqa: E402
    COMPUTE,
    FAMILY_COMPUTE,
    active_params,
    reference_decoder,
)
from xllm_eplb.testing.serving import write_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SIZES = {"qwen3_moe": COMPUTE, **FAMILY_COMPUTE,
         "gpt_oss": dict(COMPUTE, num_heads=12)}
BASELINE = "qwen3_moe"


def checkpoint(family: str, cache: Path, sizes: dict) -> Path:
    from xllm_eplb.model.checkpoint import make_checkpoint

    d = cache / family
    if not (d / "config.json").is_file():
        make_checkpoint(family, d, force=True, **sizes)
    return d


def decode_steps(model, batch: int, prompt_len: int, steps: int, vocab: int) -> list[float]:
    """Seconds of each of ``steps`` decode steps after one prefill of the batch."""
    from xllm_eplb.model.batch import RankBatch, SeqRow

    rows = [(r, [(r * 7 + j * 13) % (vocab - 8) for j in range(prompt_len)])
            for r in range(batch)]
    res = model.forward_step(RankBatch([SeqRow(r, p, 0, True) for r, p in rows]))
    last = {r: res.sampled[r] for r, _ in rows}
    out = []
    for t in range(steps):
        b = RankBatch([SeqRow(r, [last[r]], prompt_len + t, False) for r, _ in rows])
        t0 = time.perf_counter()
        res = model.forward_step(b, pure_decode=True)
        out.append(time.perf_counter() - t0)
        last = {r: res.sampled[r] for r, _ in rows}
    model.release([r for r, _ in rows])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="batch 8, 4 steps, 1 round, "
                    "qwen3_moe and olmoe")
    ap.add_argument("--json", type=Path, help="write every number here")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--families", nargs="+", choices=sorted(SIZES), default=list(SIZES))
    ap.add_argument("--cache", type=Path, default=ROOT / ".cache" / "bench_families")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    fams = args.families
    if args.quick:
        args.batch, args.steps, args.rounds, fams = 8, 4, 1, ["qwen3_moe", "olmoe"]
    if BASELINE not in fams:
        fams = [BASELINE, *fams]
    args.cache.mkdir(parents=True, exist_ok=True)
    models = {f: reference_decoder(checkpoint(f, args.cache, SIZES[f])) for f in fams}
    steps: dict[str, list[float]] = {f: [] for f in fams}
    with torch.no_grad():
        for _ in range(args.rounds):
            for f, m in models.items():
                ts = decode_steps(m, args.batch, args.prompt_len, args.steps, m.spec.vocab_size)
                steps[f].append(statistics.median(ts))
    rows = {}
    for f, m in models.items():
        ms = 1e3 * min(steps[f])
        p = active_params(m)
        rows[f] = {"step_ms": ms, "active_params_m": p / 1e6, "ms_per_m_params": ms / (p / 1e6),
                   "round_step_ms": [1e3 * s for s in steps[f]]}
    base = rows[BASELINE]["ms_per_m_params"]
    print(f"{'family':<14}{'step ms':>9}{'active M':>10}{'ms / M':>9}{'x ' + BASELINE:>14}")
    for f, r in rows.items():
        r["x_baseline"] = r["ms_per_m_params"] / base
        print(f"{f:<14}{r['step_ms']:>9.1f}{r['active_params_m']:>10.2f}"
              f"{r['ms_per_m_params']:>9.2f}{r['x_baseline']:>14.2f}")
    write_json(args.json, {"command": " ".join(sys.argv), "batch": args.batch,
                           "prompt_len": args.prompt_len, "steps": args.steps,
                           "rounds": args.rounds, "threads": args.threads, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
