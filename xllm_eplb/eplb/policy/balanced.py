"""`balanced` (default): a faithful port of xLLM's BalancedEplbPolicy.

A. replicas by the largest drop of per-replica load ``L/(c(c+1))``, at most ``ep_size`` each;
B. equal-capacity LPT packing by ``L/c`` descending (stable: physical index breaks ties), each
   replica on the least-loaded rank with a free slot that does not hold the expert yet, packing
   load ``L // c``; a cyclic fallback when LPT dead-ends;
C. slot stabilisation against the previous table.

Integer loads below ``packing.EXACT_FLOAT_LIMIT`` (and float loads) take the layer-vectorised
float64 path, which makes the same decisions as exact integer comparison; larger integer loads take
:func:`plan_layer_exact`, a pure-Python port with exact rational comparisons.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np

from xllm_eplb.eplb.policy.base import EplbPolicy
from xllm_eplb.eplb.policy.packing import (
    as_float,
    cyclic_fallback,
    fast_path_ok,
    pack_sequences,
    select_replicas_max_drop,
    stabilize_slots,
)


def plan_balanced(loads: np.ndarray, prev: np.ndarray, ep_size: int, slots: int):
    """All layers: loads [L, E] (int or float), prev [L, D*S] -> list of [D*S] or None."""
    lg = np.asarray(loads)
    if not fast_path_ok(lg):
        return [plan_layer_exact(lg[i], prev[i], ep_size, slots) for i in range(lg.shape[0])]
    items, eff, rc, ok = balanced_items(lg, ep_size, slots)
    table, packed = pack_sequences(items, eff, ep_size, slots, lg.shape[1])
    return finish_balanced(lg, prev, table, packed, rc, ok, ep_size, slots)


def balanced_items(lg: np.ndarray, ep_size: int, slots: int):
    """Steps A and the packing order of B (fast path only): (items int64 [L, D*S] in packing
    order, eff [L, D*S] packing load per item (int64 for integer loads, float64 floors for
    float loads), replica counts rc [L, E], ok [L])."""
    layers, num_e = lg.shape
    w = as_float(lg)
    rc, added, ok = select_replicas_max_drop(w, ep_size * slots - num_e, ep_size)
    items = np.concatenate([np.broadcast_to(np.arange(num_e), (layers, num_e)), added], axis=1)
    rcf = np.take_along_axis(rc, items, 1)
    wi = np.take_along_axis(w, items, 1)
    order = np.argsort(-(wi / rcf), axis=1, kind="stable")
    items = np.take_along_axis(items, order, 1)
    if lg.dtype.kind == "f":
        eff = np.floor(np.take_along_axis(wi / rcf, order, 1))
    else:
        eff = np.take_along_axis(np.asarray(lg, np.int64), items, 1) // np.take_along_axis(
            rc, items, 1)
    return items, eff, rc, ok


def finish_balanced(lg, prev, table, packed, rc, ok, ep_size: int, slots: int):
    """Step B's cyclic fallback and step C (slot stabilisation) after the packing."""
    w = as_float(lg)
    out: list[np.ndarray | None] = [None] * lg.shape[0]
    for i in np.nonzero(ok & ~packed)[0]:
        fb = cyclic_fallback(w[i], rc[i], ep_size, slots)
        if fb is not None:
            table[i] = fb
            packed[i] = True
    good = np.nonzero(ok & packed)[0]
    if good.size:
        stable = stabilize_slots(table[good], prev[good], ep_size)
        for j, i in enumerate(good):
            out[i] = stable[j]
    return out


def plan_layer_exact(load, prev, ep_size: int, slots: int):
    """One layer with exact integer/rational arithmetic (any magnitude). [E], [D*S] -> [D*S]."""
    lv = [int(x) for x in np.asarray(load).tolist()]
    num_e = len(lv)
    rc = [1] * num_e
    phy = list(range(num_e))
    for _ in range(ep_size * slots - num_e):
        best = -1
        for e in range(num_e):  # L[e]/(c(c+1)) > L[b]/(cb(cb+1)) by cross-multiplication
            if rc[e] >= ep_size:
                continue
            if best < 0 or lv[e] * rc[best] * (rc[best] + 1) > lv[best] * rc[e] * (rc[e] + 1):
                best = e
        if best < 0:
            return None
        rc[best] += 1
        phy.append(best)
    order = sorted(range(len(phy)), key=lambda p: (-Fraction(lv[phy[p]], rc[phy[p]]), p))
    dev = [0] * ep_size
    rows: list[list[int]] = [[] for _ in range(ep_size)]
    for p in order:
        e = phy[p]
        cands = [d for d in range(ep_size) if len(rows[d]) < slots and e not in rows[d]]
        if not cands:
            fb = cyclic_fallback(np.array(lv, dtype=object), np.array(rc), ep_size, slots)
            if fb is None:
                return None
            table = fb.reshape(1, -1)
            break
        d = min(cands, key=lambda d: (dev[d], d))
        rows[d].append(e)
        dev[d] += lv[e] // rc[e]
    else:
        table = np.array(rows, dtype=np.int64).reshape(1, -1)
    return stabilize_slots(table, np.asarray(prev, dtype=np.int64).reshape(1, -1), ep_size)[0]


class BalancedPolicy(EplbPolicy):
    name = "balanced"

    def plan(self, logical, deployed):
        return plan_balanced(logical, deployed, self.ep_size, self.slots)
