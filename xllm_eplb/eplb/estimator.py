"""EasyBalance load estimator: sliding window + exponential decay (+ optional linear trend).

Sits between the aggregator and the policy. It keeps the logical load of the last ``window``
batches (one batch = one accepted load sample = one forward), weights batch ``age`` (0 = newest)
by ``decay ** age`` and returns the weighted mean per batch, ``[layers, experts]`` float64.
With ``trend=True`` a weighted least-squares line is fitted per (layer, expert) over the window
and extrapolated ``horizon`` batches past the newest one (clipped at 0).

The estimate only feeds the policy's logical input (replica choice and packing). The policy's
publication gate always uses the *raw measured* physical window kept by the aggregator (a
prediction must not be able to talk the gate into a move). Logical load does not depend on the
placement, so the estimator's window survives activations.

Hot/cold classification (EasyBalance): an expert is hot when its estimate exceeds
``hot_factor`` (1.5) x the layer mean, cold below ``cold_factor`` (0.7) x the mean.
"""

from __future__ import annotations

import numpy as np

HOT_FACTOR = 1.5
COLD_FACTOR = 0.7


class LoadEstimator:
    """Windowed, decayed estimate of the per-batch logical load ``[layers, experts]``."""

    def __init__(self, num_layers: int, num_logical: int, window: int = 16, decay: float = 0.85,
                 trend: bool = False, horizon: float | None = None):
        if window < 1:
            raise ValueError(f"eplb_estimator_window={window}: must be >= 1")
        if not 0 < decay <= 1:
            raise ValueError(f"eplb_estimator_decay={decay}: must be in (0, 1]")
        self.window = int(window)
        self.decay = float(decay)
        self.trend = bool(trend)
        #: batches past the newest one the trend is extrapolated to (default: half a window)
        self.horizon = self.window / 2 if horizon is None else float(horizon)
        self._ring = np.zeros((self.window, num_layers, num_logical), dtype=np.float64)
        self._next = 0        # ring slot the next batch goes to
        self.count = 0        # batches seen (saturates at nothing; ring keeps the last window)

    def observe(self, logical: np.ndarray) -> None:
        """Add one batch's logical load ``[layers, experts]`` (token counts)."""
        self._ring[self._next] = logical
        self._next = (self._next + 1) % self.window
        self.count += 1

    def _ordered(self) -> np.ndarray:
        """Batches in the window, oldest first: ``[n, layers, experts]``."""
        n = min(self.count, self.window)
        idx = (self._next - n + np.arange(n)) % self.window
        return self._ring[idx]

    def _weights(self, n: int) -> np.ndarray:
        """Decay weights, oldest first: ``decay ** age`` with age n-1 .. 0."""
        return self.decay ** np.arange(n - 1, -1, -1, dtype=np.float64)

    def estimate(self) -> np.ndarray:
        """Estimated load of the next batch, float64 ``[layers, experts]`` (zeros if empty)."""
        n = min(self.count, self.window)
        if n == 0:
            return np.zeros(self._ring.shape[1:], dtype=np.float64)
        x = self._ordered()
        w = self._weights(n)
        mean = np.tensordot(w, x, axes=1) / w.sum()
        if not self.trend or n < 3:
            return mean
        t = np.arange(n, dtype=np.float64)
        tm = (w * t).sum() / w.sum()
        var = (w * (t - tm) ** 2).sum()
        slope = np.tensordot(w * (t - tm), x, axes=1) / var
        pred = mean + slope * (n - 1 + self.horizon - tm)
        return np.maximum(pred, 0.0)

    def classify(self, estimate: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Hot and cold masks, bool ``[layers, experts]``: > 1.5x / < 0.7x the layer mean."""
        est = self.estimate() if estimate is None else np.asarray(estimate, dtype=np.float64)
        mean = est.mean(axis=-1, keepdims=True)
        hot = (est > HOT_FACTOR * mean) & (mean > 0)
        cold = (est < COLD_FACTOR * mean) & (mean > 0)
        return hot, cold

    def as_counts(self, scale: float) -> np.ndarray:
        """The estimate scaled to ``scale`` batches and rounded: int64 ``[layers, experts]``.

        The policy works on integer token counts; scaling to the raw window's batch count keeps
        the estimate in the same units as the measured window.
        """
        return np.rint(self.estimate() * max(scale, 1.0)).astype(np.int64)
