"""Every policy on every peer case (``xllm_eplb.testing.peer_cases``) through the adapters'
planner (``integrations.core.plan_physical``), next to the host default, in one run.

Per case and policy: peak/ideal (sum of the largest rank loads over the sum of the mean ones),
the difference to the host default's, TensorRT-LLM's max - min rank load where the case states
that bound, vllm-ascend's mean max/mean where it states a bar, whether every invariant held
(every expert present, ids in range), and the planning time (process CPU ms, best of
``--repeats`` after a warm-up call).

``--adapters``: also one fresh EP32+32 plan (``decode_in1000out1000`` of the DeepSeek dumps,
288 slots on 32 ranks, nothing deployed) through the DeepSeek, vLLM and SGLang adapters, best of
``--repeats`` (skipped when the dumps are absent).

Usage: ``OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_peer_cases.py [--quick] [--json
PATH] [--layers N] [--adapters]`` (``--quick``: one repeat, 2 layers on the synthetic large
cases).
"""

from __future__ import annotations

import argparse
import json
import time
import timeit
from pathlib import Path

import numpy as np

from xllm_eplb.integrations.core import KINDS, plan_physical
from xllm_eplb.testing.peer_cases import (
    cases,
    host_plan,
    imbalance,
    max_diff,
    mean_imbalance,
)


def _timed(fn, repeats: int):
    """(result, best process-CPU ms over ``repeats`` calls after one warm-up call)."""
    out = fn()
    return out, 1000 * min(timeit.Timer(fn, timer=time.process_time).repeat(repeats, 1))


def valid(table: np.ndarray, num_e: int) -> bool:
    return bool(table.min() >= 0 and table.max() < num_e and
                all(np.unique(r).size == num_e for r in table))


def run(layers: int, repeats: int) -> list[dict]:
    rows = []
    for c in cases(layers):
        num_e = c.loads.shape[1]
        host, host_ms = _timed(lambda c=c: host_plan(c), repeats)
        base = imbalance(host, c.loads, c.ranks)
        plans = {"host default": (host, host_ms)}
        for k in KINDS:
            plans[k] = _timed(lambda c=c, k=k: plan_physical(
                c.loads, c.replicas, c.ranks, kind=k, num_nodes=c.nodes,
                num_groups=c.groups), repeats)
        for name, (t, ms) in plans.items():
            row = dict(case=c.name, source=c.source, host=c.host,
                       geometry=f"E{num_e} R{c.replicas} D{c.ranks} L{c.loads.shape[0]}",
                       policy=name, peak_over_ideal=round(imbalance(t, c.loads, c.ranks), 4),
                       vs_host=round(imbalance(t, c.loads, c.ranks) - base, 4),
                       valid=valid(t, num_e), ms=round(ms, 2))
            if c.max_diff is not None:
                row["max_diff"] = round(max_diff(t, c.loads, c.ranks), 3)
                row["max_diff_bound"] = c.max_diff
            if c.bar is not None:
                row["mean_max_over_mean"] = round(mean_imbalance(t, c.loads, c.ranks), 4)
                row["bar"] = c.bar
            rows.append(row)
    return rows


DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "sglang_ep_statistics"


def adapter_rows(repeats: int) -> list[dict]:
    """Fresh EP32+32 through each adapter (module doc); [] without the DeepSeek dumps."""
    path = DATA / "decode_in1000out1000.json"
    if not path.is_file():
        return []
    import torch

    from xllm_eplb.eplb.loads import read_loads
    from xllm_eplb.integrations import deepseek, sglang
    from xllm_eplb.integrations.vllm import XllmEplbPolicy

    a = read_loads(path).loads
    t = torch.from_numpy(a)
    fns = {"deepseek.rebalance_experts": lambda: deepseek.rebalance_experts(a, 288, 1, 1, 32)[0],
           "vllm.XllmEplbPolicy": lambda: XllmEplbPolicy.rebalance_experts(t, 288, 1, 1, 32),
           "sglang.rebalance_experts": lambda: sglang.rebalance_experts(t[None], 288, 9, None,
                                                                        1)[0]}
    out = []
    for name, fn in fns.items():
        table, ms = _timed(fn, repeats)
        out.append(dict(adapter=name, ms=round(ms, 2),
                        peak_over_ideal=round(imbalance(np.asarray(table), a, 32), 4)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one repeat, 2 synthetic layers")
    ap.add_argument("--json", type=Path, default=None, help="write the rows here")
    ap.add_argument("--layers", type=int, default=8, help="layers of the synthetic cases")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--adapters", action="store_true", help="fresh EP32+32 through the adapters")
    a = ap.parse_args()
    rows = run(2 if a.quick else a.layers, 1 if a.quick else a.repeats)
    extra = adapter_rows(1 if a.quick else max(a.repeats, 5)) if a.adapters else []
    for r in extra:
        print(f"fresh EP32+32 {r['adapter']}: {r['ms']} ms, peak/ideal {r['peak_over_ideal']}")
    print("| case | geometry | policy | peak/ideal | vs host | bound | valid | ms |")
    print("|---|---|---|---:|---:|---|---|---:|")
    for r in rows:
        bound = ""
        if "max_diff" in r:
            bound = f"max-min {r['max_diff']} (<= {r['max_diff_bound']})"
        elif "bar" in r:
            bound = f"mean max/mean {r['mean_max_over_mean']} (<= {r['bar']})"
        print(f"| {r['case']} | {r['geometry']} | {r['policy']} | {r['peak_over_ideal']:.4f} | "
              f"{r['vs_host']:+.4f} | {bound} | {r['valid']} | {r['ms']} |")
    if a.json:
        a.json.write_text(json.dumps({"cases": rows, "adapters": extra}, indent=1) + "\n")


if __name__ == "__main__":
    main()
