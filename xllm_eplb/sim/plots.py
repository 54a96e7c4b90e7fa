"""Plots of a replay (matplotlib, Agg backend, PNG files).

- ``balancedness.png``: per-step balancedness with and without EPLB, the 100-step window means,
  and a marker at every rebalance round;
- ``load_heatmap.png``: layer x expert load of the whole trace (log scale);
- ``rank_load.png``: per-rank load of the most imbalanced layer over the last window, static
  placement vs the EPLB placement.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from xllm_eplb.eplb.balance import balancedness
from xllm_eplb.obs.plots import pyplot, save_atomic
from xllm_eplb.sim.replay import ReplayResult, step_series
from xllm_eplb.sim.trace import Trace


def _finish(fig, path: Path) -> Path:
    fig.tight_layout()
    save_atomic(fig, path)
    pyplot().close(fig)
    return path


def plot_balancedness(res: ReplayResult, path: Path) -> Path:
    plt = pyplot()
    se, ss = step_series(res.rank_eplb), step_series(res.rank_static)
    steps = np.arange(se["balancedness"].size)
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.plot(steps, ss["balancedness"], lw=0.6, color="tab:gray", label="static (per step)")
    ax.plot(steps, se["balancedness"], lw=0.6, color="tab:blue", label="EPLB (per step)")
    w = res.window_steps
    for rank, color, name in ((res.rank_static, "black", "static"),
                              (res.rank_eplb, "tab:red", "EPLB")):
        xs, ys = [], []
        for s in range(0, rank.shape[0] - w + 1, w):
            tot = rank[s:s + w].sum(axis=0).astype(np.float64)
            ys.append(float(balancedness(tot).mean()))
            xs.append(s + w / 2)
        ax.plot(xs, ys, "o-", color=color, ms=3, label=f"{name} ({w}-step windows)")
    for i, r in enumerate(res.round_steps):
        ax.axvline(r, color="tab:green", lw=0.5, ls="--", label="rebalance" if i == 0 else None)
    ax.set_xlabel("step")
    ax.set_ylabel("balancedness (mean / max rank load)")
    ax.set_ylim(0, 1.02)
    ax.legend(loc="lower right", fontsize=8)
    return _finish(fig, path)


def plot_heatmap(trace: Trace, path: Path) -> Path:
    plt = pyplot()
    tot = trace.loads.sum(axis=0).astype(np.float64)
    fig, ax = plt.subplots(figsize=(10, 4))
    im = ax.imshow(np.log10(tot + 1), aspect="auto", cmap="viridis", interpolation="nearest")
    ax.set_xlabel("logical expert")
    ax.set_ylabel("MoE layer")
    fig.colorbar(im, ax=ax, label="log10(tokens + 1)")
    ax.set_title("expert load over the whole trace")
    return _finish(fig, path)


def plot_rank_load(res: ReplayResult, path: Path) -> Path:
    plt = pyplot()
    w = min(res.window_steps, res.rank_eplb.shape[0])
    static = res.rank_static[-w:].sum(axis=0).astype(np.float64)   # [layers, D]
    eplb = res.rank_eplb[-w:].sum(axis=0).astype(np.float64)
    layer = int(np.argmax(static.max(axis=1) / np.maximum(static.mean(axis=1), 1e-9)))
    ranks = np.arange(static.shape[1])
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.bar(ranks - 0.2, static[layer], width=0.4, label="static placement", color="tab:gray")
    ax.bar(ranks + 0.2, eplb[layer], width=0.4, label="EPLB placement", color="tab:blue")
    ax.axhline(static[layer].mean(), color="black", lw=0.8, ls=":", label="ideal (mean)")
    ax.set_xlabel("EP rank")
    ax.set_ylabel(f"tokens over the last {w} steps")
    ax.set_title(f"per-rank load, layer {layer} (most imbalanced under the static placement)")
    ax.legend(fontsize=8)
    return _finish(fig, path)


def write_plots(res: ReplayResult, trace: Trace, out: Path) -> list[Path]:
    """All plots into ``out``; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    return [plot_balancedness(res, out / "balancedness.png"),
            plot_heatmap(trace, out / "load_heatmap.png"),
            plot_rank_load(res, out / "rank_load.png")]
