#!/usr/bin/env python
"""Benchmark the placement policies on real DeepSeek loads (SGLang dumps).

For EP16+16, EP32+32, EP64+64, EP128+128 (one redundant slot per rank) and every policy plus
``static`` (no EPLB, xLLM's initial layout):
- fresh plan on decode_in1000out1000 from the initial layout: global peak/ideal
  (sum of per-layer peaks / sum of ideals), balancedness (its inverse), peak over lower bounds
  (ideal; replica bound; LP relaxation via highspy on one layer), policy runtime per full
  58-layer round (``gate.propose``: ``plan`` + the gate, best of N, process CPU time so that a
  loaded shared machine does not distort it);
- drift to decode_in500out1500 starting from the policy's own fresh plan: slots moved (% of all
  slots) and balancedness reached, plus "no rebalance" (keep the fresh plan);
- the integrations (``xllm_eplb/testing/adapter_rows.py``): every engine interface with our policy next
  to the engine's own default policy, same input, same run (EP32+32 with --quick, else EP32 and
  EP64), and vllm-ascend's policy fixture;
- ``incremental`` at 384 experts, EP96+96 (the dumps' 256 experts plus 128 of them again, shuffled:
  the size of a 384-expert model), fresh and drift CPU ms.

Usage::

    .venv/bin/python scripts/bench_policy.py [DATA_DIR] [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from xllm_eplb.config import rank_slots  # noqa: E402
from xllm_eplb.eplb.balance import rank_loads_from_phy2log  # noqa: E402
from xllm_eplb.eplb.gate import propose  # noqa: E402
from xllm_eplb.eplb.loads import read_loads  # noqa: E402
from xllm_eplb.eplb.placement import diff, initial_phy2log  # noqa: E402
from xllm_eplb.eplb.policy import make_policy  # noqa: E402
from xllm_eplb.eplb.policy.packing import select_replicas_max_load  # noqa: E402
from xllm_eplb.testing.bounds import drift_floor  # noqa: E402

POLICIES = ("static", "balanced", "greedy", "incremental", "node_aware")


def global_peak(table, loads, d) -> float:
    r = rank_loads_from_phy2log(table, loads, d)
    return float(r.max(axis=1).sum() / (np.asarray(loads, float).sum() / d))


def replica_bound(loads, d, r) -> np.ndarray:
    """Per layer: max(ideal, min-max per-replica load + the S-1 smallest other items).

    Any placement has an item >= the min-max per-replica load (the optimum of max_e L_e/c_e with
    sum c = E + D*R, c <= D); its rank holds S-1 other distinct experts, each >= L_e / D."""
    w = np.asarray(loads, dtype=np.float64)
    e = w.shape[1]
    s = rank_slots(e, d, r)
    c = select_replicas_max_load(w, d * r, d)
    top = (w / c).max(axis=1)
    small = np.sort(w / d, axis=1)[:, : s - 1].sum(axis=1)
    return np.maximum(w.sum(axis=1) / d, top + small)


def lp_bound(load_row, d, s, time_limit=20.0):
    """LP relaxation (highspy): fraction x[e,d] of expert e served on rank d (any split),
    presence z[e,d] in [0,1] with x <= z, sum_e z[e,d] <= S, min max_d sum_e L_e x[e,d].
    Returns the optimum (None if highspy is missing or it does not solve in time)."""
    try:
        import highspy
    except ImportError:
        return None
    w = np.asarray(load_row, dtype=np.float64)
    e = w.size
    nx = e * d
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", float(time_limit))
    inf = highspy.kHighsInf
    ncol = 1 + 2 * nx                       # T, x[e*d + k], z[e*d + k]
    cost = np.zeros(ncol)
    cost[0] = 1.0
    lo = np.zeros(ncol)
    hi = np.ones(ncol)
    hi[0] = inf
    h.addCols(ncol, cost, lo, hi, 0, np.zeros(ncol, dtype=np.int32), np.zeros(0, np.int32),
              np.zeros(0))
    starts, idx, val, rlo, rhi = [], [], [], [], []

    def row(ix, vx, lo_, hi_):
        starts.append(len(idx))
        idx.extend(ix)
        val.extend(vx)
        rlo.append(lo_)
        rhi.append(hi_)

    for ei in range(e):
        row([1 + ei * d + k for k in range(d)], [1.0] * d, 1.0, 1.0)
    for j in range(nx):
        row([1 + j, 1 + nx + j], [1.0, -1.0], -inf, 0.0)
    for k in range(d):
        row([1 + nx + ei * d + k for ei in range(e)], [1.0] * e, -inf, float(s))
        row([1 + ei * d + k for ei in range(e)] + [0], list(w) + [-1.0], -inf, 0.0)
    h.addRows(len(rlo), np.array(rlo), np.array(rhi), len(idx), np.array(starts, np.int32),
              np.array(idx, np.int32), np.array(val))
    h.run()
    if h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
        return None
    return float(h.getInfo().objective_function_value)


def ranks_over(table: np.ndarray, loads: np.ndarray, d: int, goal: float) -> float:
    """Mean number of ranks per layer whose load exceeds ideal / goal (the peak ``goal`` allows)."""
    rl = rank_loads_from_phy2log(table, loads, d)
    return float((rl > rl.mean(axis=1, keepdims=True) / goal).sum(axis=1).mean())


def relative_drift(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """(std, median |.|) of each expert's relative change of its share of the layer's load."""
    sa = a / a.sum(axis=1, keepdims=True)
    sb = b / b.sum(axis=1, keepdims=True)
    rel = (sb - sa)[sa > 0] / sa[sa > 0]
    return float(rel.std()), float(np.median(np.abs(rel)))


def plan(kind, d, r, loads, prev, repeats, **opts):
    """(table [L, D*S], best CPU seconds of one round: ``plan`` + the gate, min_improvement 0)."""
    e = loads.shape[1]
    best, table = np.inf, prev
    for _ in range(repeats):
        pol = make_policy(kind, d, e, r, **opts)
        t0 = time.process_time()          # CPU time: robust on a shared, loaded machine
        table = propose(pol, loads, prev, min_improvement=0.0).table
        best = min(best, time.process_time() - t0)
    return table, best


def opts_for(kind, d):
    return dict(num_nodes=max(1, d // 8)) if kind == "node_aware" else {}


def bench_ep(d, a, b, repeats, with_lp):
    r = 1
    e = a.shape[1]
    init = np.tile(initial_phy2log(e, d, r), (a.shape[0], 1))
    ideal_a = a.sum() / d
    rb = replica_bound(a, d, r).sum() / ideal_a
    lp = None
    if with_lp:
        v = lp_bound(a[0], d, rank_slots(e, d, r))
        lp = None if v is None else v / (a[0].sum() / d)
    rows = []
    for kind in POLICIES:
        if kind == "static":
            fresh, t_fresh, drift, t_drift = init, 0.0, init, 0.0
        else:
            fresh, t_fresh = plan(kind, d, r, a, init, repeats, **opts_for(kind, d))
            drift, t_drift = plan(kind, d, r, b, fresh, repeats, **opts_for(kind, d))
        rows.append(row(kind, d, a, b, fresh, drift, t_fresh, t_drift, rb, lp))
    budget = int(0.05 * init.size)
    drift, t_drift = plan("incremental", d, r, b, rows[3]["_fresh"], repeats,
                          budget_slots=budget)
    rows.append(row("incremental(budget 5%)", d, a, b, rows[3]["_fresh"], drift, float("nan"),
                    t_drift, rb, lp))
    for x in rows:
        x.pop("_fresh")
    return rows


def row(kind, d, a, b, fresh, drift, t_fresh, t_drift, rb, lp):
    pk = global_peak(fresh, a, d)
    keep = global_peak(fresh, b, d)
    after = global_peak(drift, b, d)
    return {
        "policy": kind, "ep": d, "peak_over_ideal": pk, "balancedness": 1 / pk,
        "peak_over_replica_bound": pk / rb,
        "lp_over_ideal_layer0": lp,
        "fresh_ms": t_fresh * 1000, "drift_ms": t_drift * 1000,
        "drift_keep_balancedness": 1 / keep, "drift_balancedness": 1 / after,
        "drift_moved_pct": 100.0 * diff(fresh, drift, d).moved_slots / fresh.size,
        "drift_floor_pct_for_0.99": 100.0 * drift_floor(fresh, b, d, 0.99),
        "drift_ranks_over_0.99_peak": ranks_over(fresh, b, d, 0.99),
        "_fresh": fresh,
    }


def to_markdown(rows) -> str:
    out = ["| EP | policy | peak/ideal | balancedness | peak/replica bound | fresh ms | "
           "drift ms | drift: keep bal. | drift: bal. reached | drift: slots moved | "
           "drift: ranks above 0.99 peak | drift: floor for 0.99 |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for x in rows:
        out.append(f"| {x['ep']}+{x['ep']} | {x['policy']} | {x['peak_over_ideal']:.4f} | "
                   f"{x['balancedness']:.4f} | {x['peak_over_replica_bound']:.4f} | "
                   f"{x['fresh_ms']:.1f} | {x['drift_ms']:.1f} | "
                   f"{x['drift_keep_balancedness']:.4f} | {x['drift_balancedness']:.4f} | "
                   f"{x['drift_moved_pct']:.1f}% | {x['drift_ranks_over_0.99_peak']:.1f} of {x['ep']} | "
                   f"{x['drift_floor_pct_for_0.99']:.2f}% |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("data", nargs="?", default=str(ROOT.parent / "shared/data/"
                                                   "sglang_ep_statistics"))
    ap.add_argument("--quick", action="store_true", help="EP32 and EP64 only, one repeat")
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--eps", default=None, help="comma list of EP sizes (default 16,32,64,128)")
    args = ap.parse_args(argv)
    data = Path(args.data)
    if not (data / "decode_in1000out1000.json").is_file():
        print(f"error: {data}: decode_in1000out1000.json not found", file=sys.stderr)
        return 2
    a = read_loads(data / "decode_in1000out1000.json").loads
    b = read_loads(data / "decode_in500out1500.json").loads
    eps = [int(x) for x in args.eps.split(",")] if args.eps else \
        ([32, 64] if args.quick else [16, 32, 64, 128])
    repeats = 1 if args.quick else 3
    std, med = relative_drift(a, b)
    print(f"drift decode_in1000out1000 -> decode_in500out1500: each expert's share of its layer "
          f"changes by {100 * std:.1f}% (std), median |change| {100 * med:.1f}%", file=sys.stderr)
    rows = []
    for d in eps:
        t0 = time.perf_counter()
        rs = bench_ep(d, a, b, repeats, with_lp=not args.quick)
        rows += rs
        lp = rs[0]["lp_over_ideal_layer0"]
        print(f"EP{d}+{d}: done in {time.perf_counter() - t0:.1f}s; replica bound / ideal "
              f"{rs[0]['peak_over_ideal'] / rs[0]['peak_over_replica_bound']:.4f}; "
              f"LP(layer 0) / ideal {'n/a' if lp is None else f'{lp:.4f}'}", file=sys.stderr)
    print(to_markdown(rows))
    from xllm_eplb.testing import adapter_rows as bench_adapters

    ad = [x for d in ([32] if args.quick else [32, 64]) for x in bench_adapters.bench(d, a, b,
                                                                                     repeats)]
    asc = bench_adapters.bench_ascend(repeats)
    print()
    print(bench_adapters.to_markdown(ad, asc))
    big = bench_384(a, b, repeats)
    print()
    print(f"incremental, 384 experts, EP96+96: fresh {big['fresh_ms']:.1f} ms (peak/ideal "
          f"{big['peak_over_ideal']:.4f}), drift {big['drift_ms']:.1f} ms (moved "
          f"{big['drift_moved_pct']:.1f}%)")
    if args.json:
        Path(args.json).write_text(json.dumps({"policies": rows, "adapters": ad,
                                               "vllm_ascend_fixture": asc, "e384_ep96": big},
                                              indent=1) + "\n")
    return 0


def bench_384(a, b, repeats) -> dict:
    """incremental on 384 experts at EP96+96 (module doc), from xLLM's initial layout."""
    rng = np.random.default_rng(0)
    pick = rng.permutation(a.shape[1])[:128]
    a2, b2 = (np.concatenate([x, x[:, pick]], axis=1) for x in (a, b))
    init = np.tile(initial_phy2log(384, 96, 1), (a.shape[0], 1))
    fresh, t_f = plan("incremental", 96, 1, a2, init, repeats)
    drift, t_d = plan("incremental", 96, 1, b2, fresh, repeats)
    return {"fresh_ms": t_f * 1000, "drift_ms": t_d * 1000,
            "peak_over_ideal": global_peak(fresh, a2, 96),
            "drift_moved_pct": 100.0 * diff(fresh, drift, 96).moved_slots / fresh.size}


if __name__ == "__main__":
    sys.exit(main())
