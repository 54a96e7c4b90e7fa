"""Lower bounds quoted in docs/benchmarks.md next to what the policies reach (pure numpy;
``scripts/bench_policy.py`` reports them, ``tests/test_drift_floor.py`` checks them)."""

from __future__ import annotations

import numpy as np

from xllm_eplb.eplb.balance import rank_loads_from_phy2log


def _layer_floor_options(rank_loads: np.ndarray, grid: int) -> tuple[np.ndarray, np.ndarray]:
    """(cost, value) options of one layer for :func:`drift_floor`: for each grid interval
    [T_j, T_j+1] the floor at T_j+1 (fewest changed slots) charged with the peak T_j."""
    r = np.sort(rank_loads)                                   # ascending
    ts = np.linspace(r.mean(), r[-1], grid)
    over = r[None, :] > ts[:, None]                           # [G, D]
    excess = np.where(over, r[None, :] - ts[:, None], 0.0).sum(axis=1)
    n_under = r.size - over.sum(axis=1)
    k = np.arange(1, r.size + 1)
    room = k[None, :] * ts[:, None] - np.cumsum(r)[None, :]  # room of the k lightest ranks
    room = np.where(k[None, :] <= n_under[:, None], room, -np.inf)
    absorbers = np.where(excess > 0, np.argmax(room >= excess[:, None] - 1e-9, axis=1) + 1, 0)
    floor = over.sum(axis=1) + absorbers
    cost = np.append(floor[1:], 0)                            # floor at the upper grid point
    return cost, ts                                           # ... with the lower point's peak


def drift_floor(table: np.ndarray, loads: np.ndarray, d: int, goal: float = 0.99,
                grid: int = 400) -> float:
    """Lower bound on the fraction of all slots that any move set keeping every expert's replica
    count must change so that ``table`` reaches global balancedness ``goal`` on ``loads``.

    Per layer and target peak T: each rank above T changes a slot; their excess over T has to
    move to ranks at or below T, each of which changes a slot and takes at most T - R_u, so at
    least the fewest such ranks whose room covers the excess change one too. The per-layer
    targets are chosen jointly (sum of peaks <= sum of ideals / goal); the Lagrangian dual of
    that choice, on a grid that charges each interval its upper floor and lower peak, is a valid
    lower bound."""
    rl = rank_loads_from_phy2log(table, loads, d).astype(np.float64)
    rl /= rl.mean()                                           # mean ideal over layers = 1
    opts = [_layer_floor_options(x, grid) for x in rl]
    budget = rl.mean(axis=1).sum() / goal                     # sum of peaks allowed
    best = 0.0
    for lam in np.logspace(-1, 5, 600):
        dual = sum(float(np.min(c + lam * v)) for c, v in opts) - lam * budget
        best = max(best, dual)
    return best / table.size
