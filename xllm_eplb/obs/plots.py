"""Plots for offline tools (matplotlib, Agg backend: no display needed).

:func:`plot_rank_loads` is the ``xllm-eplb plan --plot`` figure; other helpers may add more
plotting functions here or elsewhere.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from xllm_eplb.obs.files import write_atomic


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_atomic(fig, path: str | Path, dpi: int = 110) -> None:
    """Save a figure through a temp file + rename, so a failure never leaves a partial file."""
    write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=dpi), suffix=Path(path).suffix or ".png")


def plot_rank_loads(before: np.ndarray, after: np.ndarray, path: str | Path,
                    title: str = "", layer_ids=None) -> None:
    """Two panels: per-layer peak/ideal before and after, and the per-rank load (summed over
    layers, in units of the ideal) before and after. before, after: float [layers, ranks]."""
    plt = pyplot()
    b = np.asarray(before, dtype=np.float64)
    a = np.asarray(after, dtype=np.float64)
    ideal = np.maximum(b.mean(axis=1, keepdims=True), 1e-12)
    layers = np.arange(b.shape[0]) if layer_ids is None else np.asarray(layer_ids)
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 7))
    ax1.plot(layers, b.max(axis=1) / ideal[:, 0], "o-", ms=3, label="before")
    ax1.plot(layers, a.max(axis=1) / ideal[:, 0], "o-", ms=3, label="after")
    ax1.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax1.set_xlabel("MoE layer")
    ax1.set_ylabel("peak / ideal rank load")
    ax1.legend()
    ax1.set_title(title or "rank load per layer")
    ranks = np.arange(b.shape[1])
    tot = ideal.sum()
    width = 0.4
    ax2.bar(ranks - width / 2, b.sum(axis=0) / tot, width, label="before")
    ax2.bar(ranks + width / 2, a.sum(axis=0) / tot, width, label="after")
    ax2.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax2.set_xlabel("EP rank")
    ax2.set_ylabel("load / ideal (all layers)")
    ax2.legend()
    fig.tight_layout()
    try:
        save_atomic(fig, path)
    finally:
        plt.close(fig)
