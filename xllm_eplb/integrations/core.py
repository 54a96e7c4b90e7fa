"""The planner behind every adapter: this project's policies on any physical layout the peers
plan (``R % ranks == 0`` and ``R >= E``), with the deployed map honoured.

Shapes: ``weight [L, E]`` logical loads; ``phy2log [L, R]`` rank-major (rank ``d`` owns slots
``d*S .. d*S+S-1``, ``S = R / ranks``).

Layouts beyond the engine's rules (``config.layout_rules``):

- an expert count the ranks do not divide: the policies take ``slots`` directly
  (``EplbPolicy(..., slots=S)``);
- more slots per rank than experts (``S > E``): one replica per rank is impossible, so each rank
  is split into ``V`` *virtual ranks* of ``S / V`` consecutive slots (``V`` the smallest divisor
  of ``S`` with ``S / V <= E``) and the policy plans ``ranks * V`` virtual ranks with one replica
  per virtual rank: a rank holds an expert at most ``V`` times (``ceil(S / E)``, the least
  possible, whenever that divides ``S``). Balanced virtual ranks make balanced ranks (a rank's
  load is their sum).

On a small layout (slots per rank >= half the experts, or at most ``SMALL_LAYOUT`` slots) a
layer planned fresh also gets DeepSeek's algorithm's table, where an expert may repeat on a rank
(vLLM, SGLang and TensorRT-LLM route over such replicas), and keeps the one with the lower peak
(``rank_repeats=False``, vllm-ascend's adapter: never). ``balanced`` / ``greedy`` warn once per
geometry where they plan far above a plain packing (``warn_off_bound``).

Afterwards every rank keeps the experts it keeps in their old slots (``keep_slots``), the
retained-slot rule of vLLM's and vllm-ascend's callers.
"""

from __future__ import annotations

import logging
import os

import numpy as np

from xllm_eplb.eplb.balance import rank_loads_from_phy2log
from xllm_eplb.eplb.placement import (
    PlacementError,
    check_slot_layout,
    complete_rows,
    validate_table,
)
from xllm_eplb.eplb.policy import policy_class
from xllm_eplb.eplb.policy.node_aware import check_topology
from xllm_eplb.eplb.policy.packing import (
    cyclic_fallback,
    lpt_pack,
    select_replicas_max_load,
    stabilize_slots,
)
from xllm_eplb.errors import ConfigError

log = logging.getLogger(__name__)

#: the environment variable that opts a host engine in (one of the two env reads of the library)
ENV = "XLLM_EPLB_POLICY"
#: set (1/true/on/yes) to make every adapter raise instead of falling back to the host's policy,
#: so that a host's CI can tell who planned
STRICT_ENV = "XLLM_EPLB_STRICT"
KINDS = ("incremental", "balanced", "greedy", "node_aware")
DEFAULT_KIND = "incremental"
#: incremental's ``cold_slack`` in a host engine: a deployed layer above 1.25 x its lower bound
#: is a host's initial layout (not a plan), planned like a fresh layer from that table; the
#: engine's own initial layout is marked by same-rank repeats instead
COLD_SLACK = 0.25
_TRUE = ("1", "true", "on", "yes", "default", "xllm", "xllm_eplb")


class LayoutError(ValueError, AssertionError):
    """A layout no planner can fill (``R % ranks``, ``R < E``, ...). Both a ValueError and an
    AssertionError: DeepSeek's and vLLM's own checks are asserts, and their callers and tests
    expect AssertionError."""


def env_kind(environ=None) -> str | None:
    """The policy ``XLLM_EPLB_POLICY`` asks for: None when unset or empty (the adapters then do
    nothing), one of :data:`KINDS` (case-insensitive), ``incremental`` for ``1``/``true``/...
    and, with one warning line, for anything else."""
    raw = (os.environ if environ is None else environ).get(ENV, "").strip().lower()
    if not raw:
        return None
    if raw in KINDS:
        return raw
    if raw not in _TRUE:
        log.warning("xllm-eplb: %s=%r is not one of %s; using %s", ENV, raw, ", ".join(KINDS),
                    DEFAULT_KIND)
    return DEFAULT_KIND


def strict_mode(flag: bool | None = None, environ=None) -> bool:
    """``flag`` when given (an adapter's ``strict`` argument), else ``XLLM_EPLB_STRICT``:
    True for 1 / true / on / yes."""
    if flag is not None:
        return bool(flag)
    raw = (os.environ if environ is None else environ).get(STRICT_ENV, "").strip().lower()
    return raw in ("1", "true", "on", "yes")


def resolve_kind(kind: str | None) -> str:
    """``kind`` if given (must be one of :data:`KINDS`), else the env's, else incremental."""
    if kind is None:
        return env_kind() or DEFAULT_KIND
    k = str(kind).strip().lower()
    if k not in KINDS:
        raise ValueError(f"policy={kind!r}: must be one of {', '.join(KINDS)}")
    return k


def to_numpy(x) -> np.ndarray:
    """A torch tensor (any device), numpy array or nested list -> numpy (host copy)."""
    if hasattr(x, "detach") and hasattr(x, "cpu"):
        x = x.detach().cpu().numpy()
    return np.asarray(x)


def as_loads(weight) -> np.ndarray:
    """Validated loads [L, E]: int64 for integer input (the policies' noise floor counts
    tokens), float64 otherwise; finite and >= 0."""
    w = to_numpy(weight)
    if w.ndim != 2 or w.shape[0] == 0 or w.shape[1] == 0:
        raise LayoutError(f"weight of shape {tuple(w.shape)}: must be a non-empty [layers, "
                          f"experts] table")
    if w.dtype.kind in "iub":
        w = w.astype(np.int64)
    else:
        w = w.astype(np.float64)
        if not np.isfinite(w).all():
            raise ValueError("weight holds NaN or inf")
    if (w < 0).any():
        raise ValueError(f"weight holds a negative load ({w.min()})")
    return w


def check_layout(num_logical: int, num_replicas: int, num_ranks: int) -> int:
    """Slots per rank (:func:`~xllm_eplb.eplb.placement.check_slot_layout`); LayoutError naming
    the rule."""
    try:
        return check_slot_layout(num_logical, num_replicas, num_ranks)
    except PlacementError as e:
        raise LayoutError(str(e)) from None


def virtual_split(num_logical: int, slots: int) -> int:
    """V: the smallest divisor of ``slots`` with ``slots / V <= num_logical``."""
    return next(v for v in range(1, slots + 1) if slots % v == 0 and slots // v <= num_logical)


def deployed_rows(old, layers: int, num_replicas: int, num_logical: int) -> np.ndarray:
    """The deployed table the policy starts from, int64 [L, R]: ``old`` row by row where it is
    a full map (width R, every id in range, every expert present), ``-1`` rows ("nothing
    deployed": plan fresh) elsewhere, e.g. for ``-1`` slots or a narrower map after an elastic
    scale-down."""
    out = np.full((layers, num_replicas), -1, dtype=np.int64)
    if old is None:
        return out
    o = to_numpy(old)
    if o.ndim != 2 or o.shape != (layers, num_replicas):
        return out
    o = o.astype(np.int64)
    full = complete_rows(o, num_logical)
    out[full] = o[full]
    return out


def keep_slots(table: np.ndarray, old: np.ndarray, num_ranks: int) -> np.ndarray:
    """Per rank, an expert that stays (as many of its replicas as stay) keeps its old slot;
    the incoming ones fill the freed slots in order. table, old int64 [L, R] (``-1`` old rows
    change nothing)."""
    layers, nslots = table.shape
    s = nslots // num_ranks
    c = table.reshape(layers, num_ranks, s)
    srt = np.sort(c, axis=2)
    if not (srt[..., 1:] == srt[..., :-1]).any():                 # one replica per rank
        return stabilize_slots(table, old, num_ranks)
    out = table.copy().reshape(layers, num_ranks, s)
    o = old.reshape(layers, num_ranks, s)
    for i in range(layers):
        for d in range(num_ranks):
            want = list(c[i, d])
            row = [-1] * s
            for j, e in enumerate(o[i, d]):
                if e in want:
                    want.remove(e)
                    row[j] = int(e)
            it = iter(want)
            out[i, d] = [x if x >= 0 else next(it) for x in row]
    return out.reshape(layers, nslots)


def verify(table: np.ndarray, num_logical: int, num_ranks: int, per_rank_cap: int) -> None:
    """RuntimeError unless every layer holds every expert (ids in range) and no rank holds an
    expert more than ``per_rank_cap`` times (the toolkit's ``validate_table``)."""
    validate_table(table, num_logical, num_ranks, "planned table: layer {}", RuntimeError,
                   per_rank_cap)


def fill_fresh(table: np.ndarray, w: np.ndarray, ranks: int, slots: int) -> None:
    """A row a policy left unplanned with nothing deployed (``-1``; balanced/greedy can give up
    on a layer) gets the cyclic layout of the min-max replica counts, in place."""
    for i in np.nonzero((table < 0).any(axis=1))[0]:
        cnt = select_replicas_max_load(w[i][None, :], ranks * slots - w.shape[1], ranks)[0]
        table[i] = cyclic_fallback(w[i], cnt, ranks, slots)


def make_layout_policy(kind: str, ranks: int, num_logical: int, slots: int,
                       num_nodes: int = 1, num_groups: int | None = None):
    """The policy object for ``ranks`` (virtual) ranks of ``slots`` slots. node_aware uses
    ``num_nodes`` / ``num_groups`` when DeepSeek's rule allows it (``num_groups % num_nodes ==
    0`` and the node topology fits), else one node and one expert per group (global)."""
    cls = policy_class(kind)
    if kind == "incremental":
        return cls(ranks, num_logical, 0, slots, cold_slack=COLD_SLACK)
    if kind != "node_aware":
        return cls(ranks, num_logical, 0, slots)
    nodes, groups = int(num_nodes or 1), int(num_groups or 0)
    try:
        if groups < 1 or groups % nodes:
            raise ConfigError("global")
        check_topology(num_logical, ranks, slots, nodes, groups)
    except ConfigError:
        nodes, groups = 1, num_logical
    return cls(ranks, num_logical, 0, slots, num_nodes=nodes, num_groups=groups)


#: layouts of at most this many slots also get DeepSeek's plan as a candidate
SMALL_LAYOUT = 64


def repeat_candidates(w: np.ndarray, num_replicas: int, num_ranks: int, kind: str,
                      num_nodes: int, num_groups: int | None) -> np.ndarray | None:
    """DeepSeek's algorithm's table (an expert may repeat on a rank) where that can beat this
    project's plan: slots per rank >= half the experts (the granularity of a few slots per rank is
    coarse there, and two replicas of one expert on a rank split its load under vLLM's, SGLang's
    and TensorRT-LLM's routing), or a small layout (``R <=`` :data:`SMALL_LAYOUT` slots, where the
    extra plan costs well under a millisecond per layer). node_aware keeps DeepSeek's node grouping when its
    rule holds. None elsewhere."""
    from xllm_eplb.integrations import deepseek_ref

    num_e = w.shape[1]
    if 2 * (num_replicas // num_ranks) < num_e and num_replicas > SMALL_LAYOUT:
        return None
    nodes, groups = int(num_nodes or 1), int(num_groups or 1)
    if kind != "node_aware" or groups % nodes or num_e % groups or num_ranks % nodes:
        nodes, groups = 1, 1
    return deepseek_ref.rebalance_experts(w, num_replicas, groups, nodes, num_ranks)[0]


def lowest_peak(table: np.ndarray, other: np.ndarray | None, w: np.ndarray, num_ranks: int,
                free: np.ndarray) -> np.ndarray:
    """Per layer where ``free`` (bool [L]), ``other``'s row when its peak rank load is lower than
    ``table``'s by more than 1e-9 relative; in place on ``table``."""
    if other is None:
        return table
    pk = rank_loads_from_phy2log(table, w, num_ranks).max(axis=1)
    po = rank_loads_from_phy2log(other, w, num_ranks).max(axis=1)
    win = free & (po < pk * (1 - 1e-9))
    table[win] = other[win]
    return table


def plan_physical(weight, num_replicas: int, num_ranks: int, *, kind: str | None = None,
                  old=None, num_nodes: int = 1, num_groups: int | None = None,
                  rank_repeats: bool = True) -> np.ndarray:
    """Plan ``num_replicas`` slots on ``num_ranks`` ranks for ``weight [L, E]`` -> phy2log int64
    [L, R] (numpy). ``old`` [L, R] is the deployed map (rows that are not full maps are
    planned fresh); ``kind`` one of :data:`KINDS` (None: ``XLLM_EPLB_POLICY``, else
    incremental). ``rank_repeats``: the host routes over replicas on one rank too (vLLM,
    SGLang, DeepSeek, TensorRT-LLM), so where slots per rank >= half the experts a layer takes
    the table with repeats (:func:`repeat_candidates`) when its peak is lower; False (vllm-ascend)
    keeps one replica per rank whenever ``S <= E``. LayoutError for an impossible layout."""
    w = as_loads(weight)
    layers, num_e = w.shape
    slots = check_layout(num_e, int(num_replicas), int(num_ranks))
    k = resolve_kind(kind)
    deployed = deployed_rows(old, layers, int(num_replicas), num_e)
    v = virtual_split(num_e, slots)
    dv, sv = int(num_ranks) * v, slots // v
    if dv == 1:                                     # one rank holding every expert once
        table = np.tile(np.arange(num_e, dtype=np.int64), (layers, 1))
    else:
        pol = make_layout_policy(k, dv, num_e, sv, num_nodes, num_groups)
        rows = pol.plan(w, deployed)
        table = np.stack([np.asarray(deployed[i] if r is None else r, dtype=np.int64)
                          for i, r in enumerate(rows)])
        fill_fresh(table, w, dv, sv)
        if rank_repeats:
            other = repeat_candidates(w, int(num_replicas), int(num_ranks), k, num_nodes,
                                      num_groups)
            # incremental keeps a deployed layer's slots (its hysteresis decides when it moves);
            # a from-scratch candidate competes on the layers planned fresh
            free = (deployed < 0).any(axis=1) | (k != "incremental")
            table = lowest_peak(table, other, w, int(num_ranks), free)
        warn_off_bound(k, table, w, int(num_ranks))
    table = keep_slots(table, deployed, int(num_ranks))
    verify(table, num_e, int(num_ranks), slots if rank_repeats else v)
    return table


#: balanced / greedy warn (once per process and geometry) when a plan's peak is this far above
#: the layer's lower bound: the geometry is the wrong one for them (docs/integrations.md)
WARN_SLACK = 0.01
_warned: set = set()


def warn_off_bound(kind: str, table: np.ndarray, w: np.ndarray, num_ranks: int) -> None:
    """One warning line when ``balanced`` / ``greedy`` plan more than :data:`WARN_SLACK` above a
    plain reference on this geometry (min-max replica counts packed heaviest replica first onto
    the least-loaded rank), naming the policy that fits it."""
    if kind not in ("balanced", "greedy"):
        return
    layers, nslots = table.shape
    wf = np.asarray(w, dtype=np.float64)
    num_e = wf.shape[1]
    slots = nslots // num_ranks
    if slots > num_e:
        return
    cnt = select_replicas_max_load(wf, nslots - num_e, num_ranks)
    ref, ok = lpt_pack(wf, cnt, num_ranks, slots)
    if not ok.all():
        return
    pk = rank_loads_from_phy2log(table, wf, num_ranks).max(axis=1).sum()
    pr = rank_loads_from_phy2log(ref, wf, num_ranks).max(axis=1).sum()
    key = (kind, num_e, nslots, num_ranks)
    if pr > 0 and pk > pr * (1 + WARN_SLACK) and key not in _warned:
        _warned.add(key)
        log.warning("xllm-eplb: %s plans %.4f x a plain packing's peak on %d experts, %d slots, "
                    "%d ranks (a geometry it does not fit: use incremental, see "
                    "docs/integrations.md)", kind, pk / pr, num_e, nslots, num_ranks)
