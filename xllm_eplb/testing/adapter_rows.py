"""The adapters' rows of ``scripts/bench_policy.py`` (a library, not a script): each engine's interface with our policy
next to that engine's own default policy, on the same input in the same run.

Hosts: DeepSeek EPLB (this repository's implementation of its published algorithm,
``xllm_eplb.integrations.deepseek_ref``; vLLM's and SGLang's defaults are ports of it), and the
peers' code as installed from their packages where it imports on this machine (vLLM's
``DefaultEplbPolicy``, SGLang's ``deepseek`` algorithm); a missing package gives no row.
"""

from __future__ import annotations

import time

import numpy as np

from xllm_eplb.eplb.balance import rank_loads_from_phy2log
from xllm_eplb.integrations import deepseek, deepseek_ref, sglang, vllm_ascend
from xllm_eplb.integrations.vllm import XllmEplbPolicy
from xllm_eplb.testing.peer_fixtures import ascend_fixture, slot_workload


def _peak(table, loads, d) -> float:
    r = rank_loads_from_phy2log(np.asarray(table), loads, d)
    return float(r.max(axis=1).sum() / (np.asarray(loads, float).sum() / d))


def _timed(fn, repeats):
    best, out = np.inf, None
    for _ in range(repeats):
        t0 = time.process_time()
        out = fn()
        best = min(best, time.process_time() - t0)
    return out, best * 1000


def hosts():
    """name -> fn(loads [L, E] int64, R, D, old [L, R] or None) -> phy2log [L, R] numpy."""
    import torch

    out = {"DeepSeek EPLB (host default)": lambda w, r, d, old: deepseek_ref.rebalance_experts(
        w, r, 1, 1, d)[0]}
    try:
        from vllm.distributed.eplb.policy.default import DefaultEplbPolicy

        out["vLLM DefaultEplbPolicy (installed)"] = lambda w, r, d, old: \
            DefaultEplbPolicy.rebalance_experts(torch.from_numpy(w), r, 1, 1, d,
                                                None if old is None else torch.from_numpy(old)
                                                ).numpy()
    except Exception:
        pass
    try:
        from sglang.srt.eplb.eplb_algorithms import deepseek as sgl_deepseek

        out["SGLang deepseek (installed)"] = lambda w, r, d, old: sgl_deepseek.rebalance_experts(
            torch.from_numpy(w), r, 1, 1, d, False)[0].numpy()
    except Exception:
        pass
    return out


def adapters():
    import torch

    def via_ascend(w, r, d, old):
        cur = np.tile(np.arange(r) % w.shape[1], (w.shape[0], 1)) if old is None else old
        slot = slot_workload(cur, w).reshape(w.shape[0], d, -1)
        _, _, new = vllm_ascend.XllmAscendPolicy(None).rebalance_experts(
            cur.reshape(w.shape[0], d, -1), slot)
        return np.asarray(new).reshape(w.shape[0], r)

    return {
        "xllm deepseek.rebalance_experts": lambda w, r, d, old: deepseek.rebalance_experts(
            w, r, 1, 1, d, old_phy2log=old)[0],
        "xllm vllm.XllmEplbPolicy": lambda w, r, d, old: XllmEplbPolicy.rebalance_experts(
            torch.from_numpy(w), r, 1, 1, d, None if old is None else torch.from_numpy(old)
        ).numpy(),
        "xllm sglang hook": lambda w, r, d, old: sglang.rebalance_experts(
            torch.from_numpy(w)[None], r, r // d, None, 1, None, old=old)[0].numpy(),
        "xllm vllm_ascend.XllmAscendPolicy": via_ascend,
    }


def bench(d: int, a: np.ndarray, b: np.ndarray, repeats: int) -> list[dict]:
    """EPd+d on loads a (fresh) then b (drift, with the fresh plan as the old map)."""
    r = a.shape[1] + d
    rows = []
    for name, fn in {**hosts(), **adapters()}.items():
        fresh, t_f = _timed(lambda fn=fn: fn(a, r, d, None), repeats)
        drift, t_d = _timed(lambda fn=fn, fresh=fresh: fn(b, r, d, fresh), repeats)
        rows.append({"ep": d, "interface": name, "fresh_peak_over_ideal": _peak(fresh, a, d),
                     "fresh_ms": t_f, "drift_peak_over_ideal": _peak(drift, b, d),
                     "drift_moved_pct": 100.0 * float((drift != fresh).mean()),
                     "drift_ms": t_d})
    return rows


def bench_ascend(repeats: int) -> list[dict]:
    """Mean imbalance (vllm-ascend's metric) on its fixture: our adapter vs DeepSeek EPLB."""
    tab, load = ascend_fixture()
    hot = vllm_ascend.logical_load(tab, load, 256)

    def imb(t):
        x = rank_loads_from_phy2log(np.asarray(t).reshape(58, -1), hot, 32)
        return float((x.max(axis=1) / x.mean(axis=1)).mean())

    (_, _, new), t_ours = _timed(lambda: vllm_ascend.XllmAscendPolicy(None).rebalance_experts(
        tab, load), repeats)
    ds, t_ds = _timed(lambda: deepseek_ref.rebalance_experts(hot, 288, 1, 1, 32)[0], repeats)
    return [{"interface": "table as given", "mean_imbalance": imb(tab), "ms": 0.0},
            {"interface": "xllm vllm_ascend.XllmAscendPolicy (incremental)",
             "mean_imbalance": imb(new), "ms": t_ours},
            {"interface": "DeepSeek EPLB (host default)", "mean_imbalance": imb(ds), "ms": t_ds}]


def to_markdown(rows: list[dict], ascend: list[dict]) -> str:
    out = ["| EP | interface | fresh peak/ideal | fresh ms | drift peak/ideal | drift: slots "
           "moved | drift ms |", "|---|---|---:|---:|---:|---:|---:|"]
    out += [f"| {x['ep']}+{x['ep']} | {x['interface']} | {x['fresh_peak_over_ideal']:.4f} | "
            f"{x['fresh_ms']:.1f} | {x['drift_peak_over_ideal']:.4f} | "
            f"{x['drift_moved_pct']:.1f}% | {x['drift_ms']:.1f} |" for x in rows]
    out += ["", "| vllm-ascend fixture (58 x 32 x 9, rand**10*999+1) | mean imbalance | ms |",
            "|---|---:|---:|"]
    out += [f"| {x['interface']} | {x['mean_imbalance']:.4f} | {x['ms']:.1f} |" for x in ascend]
    return "\n".join(out)
