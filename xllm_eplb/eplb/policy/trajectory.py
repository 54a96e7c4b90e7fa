"""The incremental policy's move trajectories: choosing where to cut a layer's trajectory (one layer: :func:`best_cut`; a move budget shared
by every layer: :func:`spend_budget`). A trajectory is ``[(moved_slots, peak), ...]``, point 0
being the deployed table. The moves themselves (``SWAP`` / ``SET``, applied with
:func:`~xllm_eplb.eplb.placement.apply_moves`) are the placement toolkit's."""

from __future__ import annotations

import numpy as np


def best_cut(traj: list[tuple[int, float]], cur: float, slot_cost: float, must: float) -> int:
    """Index on ``[(moved_slots, peak), ...]`` maximising ``cur - peak - slot_cost * moved``
    among the points from the first one whose peak <= must (all points if none reaches it).
    -1 for an empty trajectory."""
    if not traj:
        return -1
    pk = np.array([p for _, p in traj])
    mv = np.array([m for m, _ in traj], dtype=np.float64)
    reach = np.nonzero(pk <= must)[0]
    start = int(reach[0]) if reach.size else 0
    val = cur - pk[start:] - slot_cost * mv[start:]
    return start + int(np.argmax(val))


def spend_budget(traj: list[list[tuple[int, float]]], budget: int) -> list[int]:
    """Pick one point per layer on its trajectory ``[(moved_slots, peak), ...]`` (point 0 = keep
    the deployed table) so that the total moved slots stay within ``budget``, greedily by peak
    reduction per moved slot (best chunk first, ties: lowest layer)."""
    pos = [0] * len(traj)
    left = budget

    def chunk(i):
        """(gain per slot, target point, cost) of layer i's best affordable next chunk."""
        t, p = traj[i], pos[i]
        best = (0.0, -1, 0)
        for q in range(p + 1, len(t)):
            cost = t[q][0] - t[p][0]
            if cost > left:
                continue
            gain = (t[p][1] - t[q][1]) / max(cost, 1)
            if gain > best[0]:
                best = (gain, q, max(cost, 0))
        return best

    cache = [chunk(i) for i in range(len(traj))]
    while True:
        i = max(range(len(traj)), key=lambda j: (cache[j][0], -j), default=-1)
        if i < 0 or cache[i][1] < 0 or cache[i][0] <= 0:
            break
        _, q, cost = cache[i]
        left -= cost
        pos[i] = q
        cache = [chunk(j) if j == i or cache[j][2] > left else cache[j]
                 for j in range(len(traj))]
    return pos
