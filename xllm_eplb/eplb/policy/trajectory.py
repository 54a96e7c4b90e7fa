"""The incremental policy's move trajectories: replaying search moves on a slot table, and
choosing where to cut a layer's trajectory (one layer: :func:`best_cut`; a move budget shared
by every layer: :func:`spend_budget`). A trajectory is ``[(moved_slots, peak), ...]``, point 0
being the deployed table."""

from __future__ import annotations

import numpy as np


def replay(table: np.ndarray, moves) -> np.ndarray:
    """Apply search moves ``(kind, x, y, ...)`` to a flat table [D*S] (in place): kind 0 swaps
    slots x and y, kind 1 sets slot x to expert y."""
    for kind, x, y, *_ in moves:
        if kind == 0:
            table[x], table[y] = table[y], table[x]
        else:
            table[x] = y
    return table


def replay_undo(table: np.ndarray, moves) -> np.ndarray:
    """Undo swap moves (kind 0) on a [D, S] table, last first (in place). Rewrites (kind 1)
    cannot be undone without the old expert, so they are not allowed here."""
    flat = table.reshape(-1)
    for kind, x, y, *_ in reversed(moves):
        if kind != 0:
            raise ValueError("replay_undo: only swaps can be undone")
        flat[x], flat[y] = flat[y], flat[x]
    return table


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
