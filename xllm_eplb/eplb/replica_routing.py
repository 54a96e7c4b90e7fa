"""Per-step replica routing: which replica serves each source rank's tokens of each expert.

Replicas of a logical expert hold identical weights, so choosing the replica per token changes no
output; it only changes how the step's load lands on the ranks. Inputs of one MoE layer and step:
``counts [D, E]`` int64, the tokens (top-k occurrences) source rank ``r`` routes to logical expert
``e``, and the layer's placement (``phy2log [D*S]``, see ``eplb/placement.py``). Outputs:
``route(...) -> int64 [D, D*S]``, tokens source ``r`` sends to global slot ``p`` (or
``source_row`` for one source, what a rank computes for itself), ``slot_loads -> [D*S]``.

Modes:

- ``static``: source ``r`` sends all of expert ``e``'s tokens to replica ``r % logcnt[e]`` (global
  rank-major order), exactly ``placement.build_log2phy`` (xLLM's rule);
- ``spread``: source ``r`` splits its ``c`` tokens of ``e`` evenly over e's ``k`` replicas:
  replica ``j`` gets ``c // k`` plus one if ``(j - r) mod k < c mod k`` (remainders rotate with
  the source rank);
- ``balanced``: every rank computes the same split of each expert's step total over its replicas
  that minimises the maximum rank load, exactly, in whole tokens (``eplb/replica_balance.py``),
  then source ``r`` takes its share by the north-west-corner rule: e's tokens are lined up source
  by source (rank order) and cut into e's replicas in replica order (``balanced_rank`` computes
  one source's share directly, as the serving path does).

NOTE (cross-rank rule): ``balanced`` needs the counts of every source (an all-gather of
``counts [D, E]`` on the EP group each step and layer); every rank then runs the same integer
arithmetic on the same array with stable tie-breaks (stable sorts, lowest index first), so each
reaches the identical assignment with no broadcast. No float enters the solve: keep it so.

The placement's precomputation lives in ``eplb/replica_plan.py`` (:func:`prepare`).
"""

from __future__ import annotations

import numpy as np

from xllm_eplb.eplb.replica_balance import (  # noqa: F401  (re-exported)
    CELLS_PY,
    ROUNDS,
    ROWS_PY,
    balanced_flex,
    balanced_rank,
    balanced_rows,
    balanced_share,
    balanced_split,
    project,
)
from xllm_eplb.eplb.replica_plan import (  # noqa: F401  (re-exported)
    MODES,
    RoutingPlan,
    check_counts,
    prepare,
    sum_at,
)


# ---- slot loads and per-source rows -----------------------------------------------------------
def _flex_to_slots(x: np.ndarray, tot: np.ndarray, plan: RoutingPlan) -> np.ndarray:
    ns = plan.phy2log.size
    y = np.zeros(ns + 1, dtype=np.int64)
    y[plan.slot_of[plan.single_e, 0]] = tot[plan.single_e]
    y[plan.slot_of[plan.flex_e][plan.flex_mask]] = x[plan.flex_mask]
    return y[:ns]


def slot_loads(counts, plan: RoutingPlan, mode: str, rounds: int = ROUNDS) -> np.ndarray:
    """Tokens each global slot serves this step: int64 [D*S]."""
    c = check_counts(counts, plan)
    if mode == "balanced":
        x, tot = balanced_split(c, plan, rounds)
        return _flex_to_slots(np.asarray(x, dtype=np.int64).reshape(plan.flex_mask.shape), tot,
                              plan)
    return route(c, plan, mode).sum(axis=0)


def _northwest(cs, ce, y, plan: RoutingPlan) -> np.ndarray:
    """Share of the sources with token intervals ``[cs, ce)`` (``[..., E]``) in each slot, when
    e's line of tokens is cut into its replicas (replica order) of sizes ``y [D*S]``."""
    cum = np.cumsum(np.append(y, 0)[plan.slot_of], axis=1)   # [E, K] end of each replica
    ye = cum[plan.phy2log, plan.rep_index]
    ys = ye - y
    e = plan.phy2log
    hi = np.minimum(ce[..., e], ye)
    lo = np.maximum(cs[..., e], ys)
    return np.maximum(hi - lo, 0)


def route(counts, plan: RoutingPlan, mode: str, rounds: int = ROUNDS) -> np.ndarray:
    """Tokens source rank ``r`` sends to global slot ``p``: int64 [D, D*S] (see module doc)."""
    c = check_counts(counts, plan)
    d = plan.ep_size
    e = plan.phy2log
    if mode == "static":
        out = np.zeros((d, e.size), dtype=np.int64)
        r = np.repeat(np.arange(d), plan.num_logical)
        out[r, plan.static_slot.ravel()] = c.ravel()
        return out
    if mode == "spread":
        k = plan.cnt[e]
        cr = c[:, e]
        shift = (plan.rep_index[None, :] - np.arange(d)[:, None]) % k[None, :]
        return cr // k + (shift < cr % k)
    if mode == "balanced":
        y = slot_loads(c, plan, "balanced", rounds)
        ce = np.cumsum(c, axis=0)
        return _northwest(ce - c, ce, y, plan)
    raise ValueError(f"replica routing: mode {mode!r} is not one of {', '.join(MODES)}")


def source_row(counts, plan: RoutingPlan, mode: str, rank: int,
               rounds: int = ROUNDS) -> np.ndarray:
    """Row ``rank`` of :func:`route` (what one rank computes for its own tokens): int64 [D*S]."""
    c = check_counts(counts, plan)
    if mode != "balanced":
        return route(c, plan, mode)[rank]
    y = slot_loads(c, plan, "balanced", rounds)
    cs = c[:rank].sum(axis=0)
    return _northwest(cs, cs + c[rank], y, plan)


def rank_loads(slot_load: np.ndarray, ep_size: int) -> np.ndarray:
    """Per-slot loads ``[..., D*S]`` -> per-rank loads ``[..., D]``."""
    s = np.asarray(slot_load)
    return s.reshape(*s.shape[:-1], ep_size, -1).sum(axis=-1)


def assign_tokens(topk_ids: np.ndarray, row: np.ndarray, plan: RoutingPlan) -> np.ndarray:
    """Physical slot of each routed token of one source: ``topk_ids [N, K]`` logical ids and the
    source's ``row [D*S]`` (from :func:`source_row`) -> int64 [N, K] global slots. Expert e's
    occurrences, in row-major (token, k) order, fill e's replicas in replica order, ``row[p]``
    each; ``row`` must hold exactly each expert's occurrence count."""
    ids = np.asarray(topk_ids, dtype=np.int64)
    flat = ids.ravel()
    per_e = np.bincount(flat, minlength=plan.num_logical)
    by_e = sum_at(plan.phy2log, np.asarray(row), plan.num_logical)
    if (per_e != by_e).any():
        e = int(np.argmax(per_e != by_e))
        raise ValueError(f"replica routing: expert {e} has {int(per_e[e])} tokens but the row "
                         f"assigns {int(by_e[e])}")
    order = np.argsort(flat, kind="stable")
    g = np.empty(flat.size, dtype=np.int64)
    g[order] = np.arange(flat.size)                           # global rank among all occurrences
    slots = plan.slot_of[plan.slot_of < plan.phy2log.size]   # by expert, then replica index
    ends = np.cumsum(np.asarray(row, dtype=np.int64)[slots])
    pos = np.searchsorted(ends, g, side="right")
    return slots[pos].reshape(ids.shape)
