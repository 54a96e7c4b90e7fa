#!/usr/bin/env python3
"""Expert capacity and fallback routing in the seed's shape (#16): latency, drops, spread, comm.

One run: a generated HF-format checkpoint (``xllm-eplb make-checkpoint --arch deepseek_v3``: 64
experts, top-4, topic-skewed routers), then on 4 real gloo ranks (``testing.dist.run_ranks``, the
checkpoint ``Decoder`` of every rank, no engine) the same skewed, drifting traffic for every row:
each rank keeps ``--batch`` requests in flight (prompt prefill, then greedy decode, then a new
request); prompt topics are Zipf(``--skew``) and the hot topics rotate every ``--phase`` steps.
EPLB rows re-plan the placement every ``--interval`` steps from the window's logical loads
(``balanced`` policy, all-reduced, the same plan on every rank) and switch it in place.

Rows (plain ``--enable_fused_mc2=1`` overlapped dispatch unless named ``plain``):

- ``baseline``: no EPLB, no capacity (exact) — also run with the plain dispatch;
- ``static_cap``: no EPLB, static capacity (overflow dropped);
- ``static_cap+fallback``, ``dynamic_cap+fallback``: no EPLB, with the fallback route;
- ``eplb``: EPLB, no capacity (exact);
- ``eplb+dynamic_cap+fallback``.

Per row: P50 / P99 step latency (per step the slowest rank's ``forward_step`` wall clock), drop
and re-route rate (rows over routed rows), expert-utilisation std / mean over physical slots per
step (mean over layers and steps), comm share (seconds blocked on communication / forward
seconds, all ranks), and whether the generated tokens equal the baseline's.

    python scripts/bench_capacity.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

D = 4
ROWS = {
    "baseline/plain": dict(fused=0),
    "baseline": dict(),
    "static_cap": dict(moe_capacity_mode="static"),
    "static_cap+fallback": dict(moe_capacity_mode="static", moe_fallback_routing=True),
    "dynamic_cap+fallback": dict(moe_capacity_mode="dynamic", moe_fallback_routing=True),
    "eplb": dict(eplb=True),
    "eplb+dynamic_cap+fallback": dict(eplb=True, moe_capacity_mode="dynamic",
                                      moe_fallback_routing=True),
}


def prompt(rng, topics: int, skew: float, phase: int, n: int) -> list[int]:
    """``n`` byte tokens of one topic; topic ranks Zipf(skew), rotated by the phase (drift)."""
    w = 1.0 / np.arange(1, topics + 1) ** skew
    t = (int(rng.choice(topics, p=w / w.sum())) + 5 * phase) % topics
    return [int(x) for x in rng.choice(np.arange(t, 256, topics), size=n)]


def _cfg(ckpt: str, row: dict, args):
    from xllm_eplb.config import Config, EplbConfig, ModelConfig

    kw = {k: v for k, v in row.items() if k.startswith("moe_")}
    return Config(eplb=EplbConfig(ep_size=D, redundant_experts_num=args["redundant"],
                                  enable_fused_mc2=row.get("fused", 1),
                                  moe_capacity_factor=args["factor"], **kw),
                  model=ModelConfig(model=ckpt, dtype="float32"))


def _rank(rank, world, ckpt, rows, args):
    import torch
    import torch.distributed as dist

    from xllm_eplb.model.decoder import Decoder
    from xllm_eplb.worker.comm import groups_from_world

    torch.set_num_threads(1)
    out = {}
    for name, row in rows.items():
        cfg = _cfg(ckpt, row, args)
        model = Decoder(cfg, rank, groups_from_world(cfg).ep_group)
        out[name] = _run(model, rank, row.get("eplb", False), args, dist)
    return out


def _run(model, rank, eplb: bool, args, dist) -> dict:
    import torch

    from xllm_eplb.eplb import counters as ctr
    from xllm_eplb.eplb.policy import make_policy
    from xllm_eplb.model.batch import RankBatch, SeqRow

    cfg = model.cfg
    E, L = cfg.model.num_experts, model.num_moe_layers
    policy = make_policy("balanced", D, E, cfg.eplb.redundant_experts_num)
    B, n_out, plen = args["batch"], args["out_len"], args["prompt_len"]
    window = np.zeros((L, E), dtype=np.int64)
    rec = {k: [] for k in ("dt", "decode", "comm", "total", "dropped", "rerouted", "slots",
                           "logits")}
    tokens: list[list[int]] = []
    reqs: list[dict] = []
    rid = 0
    for step in range(args["steps"]):
        if step % n_out == 0:                               # a new round of requests
            release = [r["rid"] for r in reqs]
            rng = np.random.default_rng([rank, step])
            reqs = [{"rid": rid + j, "toks": prompt(rng, 16, args["skew"],
                                                     step // args["phase"], plen), "pos": 0}
                    for j in range(B)]
            rid += B
        else:
            release = []
        rows = [SeqRow(r["rid"], r["toks"][r["pos"]:], r["pos"], r["pos"] == 0) for r in reqs]
        decode = step % n_out != 0
        t0 = time.perf_counter()
        res = model.forward_step(RankBatch(rows, release), pure_decode=decode,
                                 return_routing=eplb, return_logits=True)
        rec["logits"].append(res.logits.numpy().astype(np.float32))
        rec["dt"].append(time.perf_counter() - t0)
        for r in reqs:
            r["pos"] = len(r["toks"])
            r["toks"].append(res.sampled[r["rid"]])
        tm = res.timings
        rec["decode"].append(decode)
        rec["comm"].append(tm["comm_wait_s"])
        rec["total"].append(tm["total_s"])
        rec["dropped"].append(tm["dropped"])
        rec["rerouted"].append(tm["rerouted"])
        rec["slots"].append(ctr.decode(res.counters))
        if step % n_out == n_out - 1:
            tokens += [r["toks"][plen:] for r in reqs]
        if eplb:
            for ml, ids in enumerate(res.routed):
                window[ml] += np.bincount(ids[res.counted].ravel(), minlength=E)
            if (step + 1) % args["interval"] == 0:
                _rebalance(model, policy, window, dist, torch)
                window[:] = 0
    rec["slots"] = np.stack(rec["slots"])                  # [steps, L, S]
    rec["tokens"] = tokens
    return rec


def _rebalance(model, policy, window, dist, torch) -> None:
    """All-reduce the window's logical loads, plan (the same on every rank), switch in place."""
    w = torch.as_tensor(window)
    dist.all_reduce(w, group=model.ep_group)
    deployed = np.stack([fm.global_phy2log for fm in model.moe_layers]).astype(np.int64)
    for ml, row in enumerate(policy.plan(w.numpy(), deployed)):
        if row is not None:
            model.moe_layers[ml].load_placement(np.asarray(row, dtype=np.int64))


def summarize(per_rank: list[dict], base: list[dict]) -> dict:
    dt = np.array([r["dt"] for r in per_rank]).max(axis=0)          # slowest rank per step
    dec = np.array(per_rank[0]["decode"])
    slots = np.concatenate([r["slots"] for r in per_rank], axis=2)  # [steps, L, D*S]
    mean = slots.mean(axis=2)
    live = mean > 0
    cv = (slots.std(axis=2)[live] / mean[live]).mean()
    served = int(slots.sum())
    dropped = sum(sum(r["dropped"]) for r in per_rank)
    rerouted = sum(sum(r["rerouted"]) for r in per_rank)
    comm = sum(sum(r["comm"]) for r in per_rank)
    total = sum(sum(r["total"]) for r in per_rank)
    toks = [r["tokens"] for r in per_rank]
    # largest logit difference from the baseline at any step (the same prompts everywhere)
    diff = max(float(np.abs(a - b).max()) if a.shape == b.shape else float("inf")
               for r, q in zip(per_rank, base, strict=True)
               for a, b in zip(r["logits"], q["logits"], strict=True))
    return {"p50_ms": 1e3 * float(np.percentile(dt[dec], 50)),
            "p99_ms": 1e3 * float(np.percentile(dt[dec], 99)),
            "drop_rate": dropped / max(1, served + dropped),
            "reroute_rate": rerouted / max(1, served + dropped),
            "util_cv": float(cv), "comm_share": comm / max(1e-12, total),
            "outputs_identical_to_baseline": toks == [q["tokens"] for q in base],
            "max_logit_diff_vs_baseline": diff,
            "distinct_tokens": len({x for r in toks for seq in r for x in seq})}


def make_ckpt(folder: Path) -> str:
    subprocess.run([sys.executable, "-m", "xllm_eplb", "make-checkpoint", "--arch",
                    "deepseek_v3", "--out", str(folder)], cwd=ROOT, check=True,
                   stdout=subprocess.DEVNULL)
    return str(folder)


def main(argv=None) -> int:
    from xllm_eplb.testing.dist import run_ranks

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps (under a minute)")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--factor", type=float, default=1.25, help="--moe_capacity_factor")
    ap.add_argument("--redundant", type=int, default=2, help="redundant slots per rank")
    ap.add_argument("--batch", type=int, default=8, help="requests in flight per rank")
    ap.add_argument("--steps", type=int, default=None, help="steps per row (default 48 / 192)")
    ap.add_argument("--out-len", type=int, default=16, help="decode steps per request round")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--phase", type=int, default=None, help="steps per drift phase")
    ap.add_argument("--interval", type=int, default=8, help="EPLB: steps between re-plans")
    ap.add_argument("--skew", type=float, default=1.2)
    a = ap.parse_args(argv)
    steps = a.steps or (48 if a.quick else 192)
    args = {"factor": a.factor, "redundant": a.redundant, "batch": a.batch, "steps": steps,
            "out_len": a.out_len, "prompt_len": a.prompt_len,
            "phase": a.phase or max(1, steps // 3), "interval": a.interval, "skew": a.skew}
    with tempfile.TemporaryDirectory(prefix="bench_capacity_") as tmp:
        ckpt = make_ckpt(Path(tmp) / "ckpt")
        per = run_ranks(_rank, D, ckpt, ROWS, args, timeout=1800)
    base = [p["baseline"] for p in per]
    table = {name: summarize([p[name] for p in per], base) for name in ROWS}
    for name, row in ROWS.items():
        table[name]["changes_outputs"] = "moe_capacity_mode" in row
    summary = {"rows": table, "args": args | {"json": str(a.json), "quick": a.quick}}
    text = json.dumps(summary, indent=2, default=str)
    print(text)
    if a.json:
        a.json.write_text(text)
    exact = all(r["outputs_identical_to_baseline"] for r in table.values()
                if not r["changes_outputs"])
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
