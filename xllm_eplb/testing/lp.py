"""Exact LP bounds for tests and benchmarks (needs ``highspy``, a dev / ``lp`` extra dependency;
never used by serving code)."""

from __future__ import annotations

import highspy
import numpy as np

from xllm_eplb.eplb.placement import replica_counts


def lp_peak(phy: np.ndarray, tot: np.ndarray, d: int) -> float:
    """phy2log ``[D*S]``, logical totals ``tot [E]``, ``d`` ranks -> the exact fractional min
    of the max rank load over all splits of each expert's total over its replicas."""
    ns = phy.size
    s = ns // d
    e = tot.size
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    inf = highspy.kHighsInf
    cost = np.zeros(ns + 1)
    cost[ns] = 1.0
    h.addCols(ns + 1, cost, np.zeros(ns + 1), np.full(ns + 1, inf), 0,
              np.zeros(ns + 1, np.int32), np.zeros(0, np.int32), np.zeros(0))
    order = np.argsort(phy, kind="stable")
    cnt = replica_counts(phy, e)
    starts = np.concatenate([np.concatenate(([0], np.cumsum(cnt)[:-1])),
                             ns + np.arange(d) * (s + 1)])
    idx = np.concatenate([order] + [np.append(np.arange(r * s, r * s + s), ns) for r in range(d)])
    val = np.concatenate([np.ones(ns)] + [np.append(np.ones(s), -1.0)] * d)
    lo = np.concatenate([tot.astype(float), np.full(d, -inf)])
    hi = np.concatenate([tot.astype(float), np.zeros(d)])
    h.addRows(e + d, lo, hi, idx.size, starts.astype(np.int32), idx.astype(np.int32), val)
    h.run()
    return float(h.getInfo().objective_function_value)
