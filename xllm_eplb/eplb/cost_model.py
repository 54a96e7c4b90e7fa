"""What a MoE step costs each rank (pure numpy): a per-layer linear model fitted on the fly.

Each call of a local expert streams the expert's whole weights before it multiplies any row, so
one rank's expert time in one MoE layer and step is, to a good approximation::

    cost[l, r] = fixed[l] x active_slots[l, r] + row[l] x rows[l, r]       (seconds)

``active_slots`` = local slots that received at least one row this step, ``rows`` = rows the
rank computed. Token-count planning sees only the second term; the first is why splitting a
hot expert over two replicas (two smaller GEMMs) can make the slowest rank slower.

:class:`CostModel` fits ``fixed`` and ``row`` per layer from the workers' measured expert CPU
seconds (``StepTimings.expert_cpu_s``) and the step's per-slot counts, robustly (Huber-weighted
least squares, both coefficients >= 0, over a ring of recent rank-steps). A layer whose own
data cannot separate the two (a coefficient comes out 0, or active slots and rows move together:
condition number over ``MAX_CONDITION``) takes the fit pooled over the other layers, scaled
to its own mean cost. It also keeps an
exponentially weighted per-step rate of every logical expert. From these it predicts, for any
placement row, each rank's expected per-step cost (:func:`rank_costs`): a slot whose expected
rows per step are ``lam`` is active with probability ``1 - exp(-lam)`` (Poisson arrivals), so
its expected cost is ``fixed x (1 - exp(-lam)) + row x lam``. A replicated expert's rate splits
evenly over its replicas (xLLM's static replica rule spreads the source ranks over them), so a
split pays up to twice the fixed cost: the replication's split cost is in the prediction.

The modelled step critical path of a layer is ``max over ranks`` of that cost
(:func:`critical_path`); :func:`expert_weights` turns the model into per-expert token
equivalents a token-count policy can balance directly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from xllm_eplb.eplb.placement import replica_counts

#: rank-steps a layer needs before its fit is used
MIN_SAMPLES = 24
#: ring capacity in steps (each step adds ep_size observations per layer)
RING_STEPS = 256
#: half-life of the per-expert rate estimate, in observed steps
RATE_HALF_LIFE = 128
#: Huber threshold, in robust standard deviations of the residuals
HUBER_K = 1.5
#: condition number (unit-norm columns) above which a layer's active slots and rows are too
#: collinear to separate the two costs
MAX_CONDITION = 20.0


@dataclass(frozen=True)
class CostFit:
    """Per layer: ``fixed`` seconds per active slot, ``row`` seconds per row, ``samples``
    rank-steps behind the fit, ``ok`` (enough samples and a positive per-row or fixed cost)."""

    fixed: np.ndarray        # float64 [L]
    row: np.ndarray          # float64 [L]
    samples: np.ndarray      # int64 [L]
    ok: np.ndarray           # bool [L]

    @property
    def ready(self) -> bool:
        """True when every layer has a usable fit."""
        return bool(self.ok.all())


@dataclass(frozen=True)
class CostSnapshot:
    """What the planner needs: the fit and the per-step logical rates ``rate`` [L, E] (expected
    rows of each logical expert per step over all ranks)."""

    fit: CostFit
    rate: np.ndarray


def fit_layer(active: np.ndarray, rows: np.ndarray, seconds: np.ndarray,
              iters: int = 6) -> tuple[float, float]:
    """Robust non-negative fit of ``seconds ~ fixed x active + row x rows`` (no intercept).

    active / rows / seconds: float [n]. Huber-weighted least squares (``HUBER_K`` robust sigmas,
    the sigma from the residuals' median absolute deviation); a coefficient that comes out
    negative is pinned to 0 and the other refitted alone. -> (fixed, row) seconds.
    """
    a, n, y = (np.asarray(v, dtype=np.float64) for v in (active, rows, seconds))
    keep = (a > 0) & np.isfinite(y)
    a, n, y = a[keep], n[keep], y[keep]
    if a.size < 2:
        return 0.0, 0.0
    w = np.ones_like(y)
    coef = np.zeros(2)
    for _ in range(iters):
        coef = _nnls2(a, n, y, w)
        res = y - coef[0] * a - coef[1] * n
        sigma = 1.4826 * np.median(np.abs(res - np.median(res)))
        if sigma <= 0:
            break
        r = np.abs(res) / (HUBER_K * sigma)
        w = np.where(r <= 1.0, 1.0, 1.0 / np.maximum(r, 1e-12))
    return float(coef[0]), float(coef[1])


def separable(active: np.ndarray, rows: np.ndarray) -> bool:
    """True when the columns (active slots, rows) of the observations [n] are independent
    enough to fit two coefficients (condition number of the unit-norm columns)."""
    x = np.stack([np.asarray(active, dtype=np.float64), np.asarray(rows, dtype=np.float64)], 1)
    norms = np.linalg.norm(x, axis=0)
    if (norms <= 0).any():
        return False
    s = np.linalg.svd(x / norms, compute_uv=False)
    return bool(s[-1] > 0 and s[0] / s[-1] <= MAX_CONDITION)


def _nnls2(a: np.ndarray, n: np.ndarray, y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Weighted least squares of y ~ [a, n] with both coefficients >= 0 (2 unknowns)."""
    x = np.stack([a, n], axis=1)
    sw = np.sqrt(w)
    sol, *_ = np.linalg.lstsq(x * sw[:, None], y * sw, rcond=None)
    if (sol >= 0).all():
        return sol
    best, err = np.zeros(2), np.inf
    for j in (0, 1):
        col = x[:, j]
        den = float((w * col * col).sum())
        c = max(0.0, float((w * col * y).sum()) / den) if den > 0 else 0.0
        cand = np.zeros(2)
        cand[j] = c
        e = float((w * (y - x @ cand) ** 2).sum())
        if e < err:
            best, err = cand, e
    return best


def slot_rates(rate: np.ndarray, placement: np.ndarray) -> np.ndarray:
    """Expected rows per step of every physical slot: the expert's rate split evenly over its
    replicas. rate [L, E], placement [L, N] -> float64 [L, N]."""
    r = np.atleast_2d(np.asarray(rate, dtype=np.float64))
    p = np.atleast_2d(np.asarray(placement, dtype=np.int64))
    cnt = replica_counts(p, r.shape[1]).astype(np.float64)
    return np.take_along_axis(r, p, 1) / np.maximum(np.take_along_axis(cnt, p, 1), 1.0)


def rank_costs(fit: CostFit, rate: np.ndarray, placement: np.ndarray, ep_size: int,
               layers: np.ndarray | None = None) -> np.ndarray:
    """Expected per-step expert seconds of every rank: float64 [k, D] for the layers
    ``layers`` (default all) of ``rate`` [L, E] under ``placement`` [L, D*S] (already the
    rows of those layers when ``layers`` is given for ``rate`` only: see :func:`critical_path`).
    """
    idx = np.arange(np.atleast_2d(rate).shape[0]) if layers is None else np.asarray(layers)
    lam = slot_rates(np.atleast_2d(rate)[idx], np.atleast_2d(placement))
    fixed, row = fit.fixed[idx][:, None], fit.row[idx][:, None]
    per_slot = fixed * -np.expm1(-lam) + row * lam
    return per_slot.reshape(len(idx), ep_size, -1).sum(axis=2)


def critical_path(fit: CostFit, rate: np.ndarray, placement: np.ndarray, ep_size: int,
                  layers: np.ndarray | None = None) -> np.ndarray:
    """Modelled step critical path per layer: max over ranks of :func:`rank_costs`, float64
    [k] seconds. ``placement`` [k, D*S] holds the rows of ``layers`` (default all L)."""
    return rank_costs(fit, rate, placement, ep_size, layers).max(axis=1)


def expert_weights(fit: CostFit, rate: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Per-expert cost in token equivalents for a token-count policy: ``scale x (lam + (fixed /
    row) x (1 - exp(-lam)))`` with ``lam`` = rate [L, E] (one replica each; the gate prices the
    splits); ``scale`` [L] turns per-step rows back into the window's units. float64 [L, E]."""
    lam = np.asarray(rate, dtype=np.float64)
    ratio = np.where(fit.row > 0, fit.fixed / np.where(fit.row > 0, fit.row, 1.0), 0.0)
    return np.asarray(scale, dtype=np.float64)[:, None] * (lam + ratio[:, None]
                                                           * -np.expm1(-lam))


class CostModel:
    """Observations of one engine's MoE steps and the fit behind them (see the module doc).

    ``observe`` takes one pure-decode step: per-slot rows ``deltas`` [L, D, S] (the decoded
    counters), the placement they ran under [L, D*S] and the ranks' ``expert_cpu`` [D, L]
    seconds. Not thread-safe: the manager calls it under its lock.
    """

    def __init__(self, num_layers: int, ep_size: int, num_logical: int,
                 ring_steps: int = RING_STEPS, half_life: float = RATE_HALF_LIFE):
        self.L, self.D, self.E = num_layers, ep_size, num_logical
        shape = (ring_steps, num_layers, ep_size)
        self.active = np.zeros(shape)
        self.rows = np.zeros(shape)
        self.seconds = np.zeros(shape)
        self.steps = 0
        self.rate = np.zeros((num_layers, num_logical))
        self.rate_weight = 0.0
        self.decay = 0.5 ** (1.0 / half_life)
        self._fit: CostFit | None = None

    def observe(self, deltas: np.ndarray, placement: np.ndarray, expert_cpu,
                logical: np.ndarray | None = None) -> None:
        """One step; ``logical`` [L, E]: the step's rows per logical expert when the caller
        already has them (else scattered here from ``deltas`` and ``placement``)."""
        cpu = np.asarray(expert_cpu, dtype=np.float64)
        if cpu.shape != (self.D, self.L):
            raise ValueError(f"expert_cpu of shape {cpu.shape}, expected [ranks, layers]="
                             f"{(self.D, self.L)}")
        d = np.asarray(deltas)
        i = self.steps % self.active.shape[0]
        self.active[i] = (d > 0).sum(axis=2)
        self.rows[i] = d.sum(axis=2)
        self.seconds[i] = cpu.T
        self.steps += 1
        if logical is None:
            logical = np.zeros((self.L, self.E))
            p = np.asarray(placement, dtype=np.int64)
            np.add.at(logical, (np.arange(self.L)[:, None], p), d.reshape(self.L, -1))
        self.rate = self.decay * self.rate + (1.0 - self.decay) * logical
        self.rate_weight = self.decay * self.rate_weight + (1.0 - self.decay)
        self._fit = None

    @property
    def filled(self) -> int:
        return min(self.steps, self.active.shape[0])

    def fit(self) -> CostFit:
        """The per-layer fit over the ring (cached until the next observation)."""
        if self._fit is None:
            k = self.filled
            fixed, row = np.zeros(self.L), np.zeros(self.L)
            samples = np.zeros(self.L, dtype=np.int64)
            weak = np.zeros(self.L, dtype=bool)
            for lay in range(self.L):
                a, n = self.active[:k, lay].ravel(), self.rows[:k, lay].ravel()
                samples[lay] = int((a > 0).sum())
                fixed[lay], row[lay] = fit_layer(a, n, self.seconds[:k, lay].ravel())
                weak[lay] = not separable(a[a > 0], n[a > 0])
            self._pool(fixed, row, k, weak | (fixed <= 0) | (row <= 0))
            ok = (samples >= MIN_SAMPLES) & ((fixed > 0) | (row > 0))
            self._fit = CostFit(fixed, row, samples, ok)
        return self._fit

    def _pool(self, fixed: np.ndarray, row: np.ndarray, k: int, weak: np.ndarray) -> None:
        """``weak`` layers take the fit pooled over the others (all layers when every one is
        weak), scaled to their own mean (in place)."""
        if not weak.any() or k == 0:
            return
        a, n, y = self.active[:k], self.rows[:k], self.seconds[:k]
        src = ~weak if (~weak).any() else np.ones_like(weak)
        pf, pr = fit_layer(a[:, src].ravel(), n[:, src].ravel(), y[:, src].ravel())
        if pf <= 0 or pr <= 0:
            return
        for lay in np.nonzero(weak)[0]:
            pred = (pf * a[:, lay] + pr * n[:, lay]).sum()
            if pred > 0:
                s = y[:, lay].sum() / pred
                fixed[lay], row[lay] = pf * s, pr * s

    def per_step_rate(self) -> np.ndarray:
        """Expected rows per step of every logical expert, float64 [L, E] (bias-corrected)."""
        return self.rate / self.rate_weight if self.rate_weight > 0 else self.rate.copy()

    def snapshot(self) -> CostSnapshot | None:
        """The fit and the rates, or None while any layer lacks a usable fit."""
        f = self.fit()
        return CostSnapshot(f, self.per_step_rate()) if f.ready else None

    def measured(self, layer: int, last: int) -> tuple[float, int]:
        """Measured critical path of ``layer`` over the last ``last`` observed steps: max over
        ranks of the mean expert seconds per step -> (seconds, steps used)."""
        k = min(last, self.filled)
        if k == 0:
            return 0.0, 0
        idx = (self.steps - 1 - np.arange(k)) % self.active.shape[0]
        return float(self.seconds[idx, layer].mean(axis=0).max()), k
