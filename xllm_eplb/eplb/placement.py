"""Placement of logical experts on physical slots, per MoE layer: the one toolkit of slot
tables (the policies, the gate, shrink/join planning, the loader checks and ``integrations/``
use it; a rule is written here once).

Glossary: ``phy2log[global_slot] -> logical id`` (length ``ep_size * slots_per_rank``, rank-major:
slot ``s`` lives on rank ``s // slots_per_rank``); ``log2phy`` = logical -> its global slots;
``logcnt[e]`` = replica count of logical expert ``e``.

- replica counts and loads: :func:`replica_counts` (``logcnt``), :func:`complete_rows` (ids in
  range, every expert present), :func:`logical_loads` (per-slot loads summed per expert);
- validity: :func:`valid_rows` (a mask over layers), :func:`validate_phy2log` (one row, the
  message naming the rule), :func:`validate_table` (every row, one error class);
- layout rules: :func:`check_slot_layout` (any layout the peers plan) and
  :func:`slots_per_rank` (this engine's flag rules, ``config.layout_error``);
- maps: :func:`log2phy` (one row or a table), :func:`build_log2phy` (a rank's routing map);
- local-search moves (the vocabulary of ``policy/excess.py``, ``policy/localsearch.py`` and
  ``cost_search.py``): ``(SWAP, x, y)`` exchanges the experts of flat slots ``x`` and ``y``;
  ``(SET, x, e)`` points slot ``x`` at expert ``e`` (a replica moves from one expert to another);
  :func:`apply_moves`, :func:`undo_swaps`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from xllm_eplb.config import layout_error, rank_slots


class PlacementError(ValueError):
    """A slot table that breaks an invariant; the message names the rule and the offender."""


def slots_per_rank(num_logical: int, ep_size: int, redundant: int) -> int:
    """``num_logical / ep_size + redundant`` (``config.rank_slots``); PlacementError when the
    layout rules (:func:`xllm_eplb.config.layout_rules`) fail."""
    err = layout_error(num_logical, ep_size, redundant)
    if err:
        raise PlacementError(err)
    return rank_slots(num_logical, ep_size, redundant)


def initial_phy2log(num_logical: int, ep_size: int, redundant: int) -> np.ndarray:
    """xLLM's initial layout: rank r holds r*k..r*k+k-1 (k = E/ep_size), then its redundant
    slots repeat its last expert. E=8, D=2, R=1 -> [0,1,2,3,3, 4,5,6,7,7]. int64 [D*S]."""
    s = slots_per_rank(num_logical, ep_size, redundant)
    k = num_logical // ep_size
    out = np.empty((ep_size, s), dtype=np.int64)
    for r in range(ep_size):
        out[r, :k] = np.arange(r * k, r * k + k)
        out[r, k:] = r * k + k - 1
    return out.reshape(-1)


def initial_phy2log_any(num_logical: int, ep_size: int, slots: int) -> np.ndarray:
    """An initial layout for any ``ep_size * slots >= num_logical``, ``slots <= num_logical``:
    expert ``e`` on rank ``e * D // E`` (contiguous blocks; xLLM's initial layout when D divides
    E), each rank's other slots repeat its last expert, a rank without a block of its own
    (E < D) takes expert ``r % E``. Every expert at least once; int64 [D*S]."""
    if num_logical % ep_size == 0 and slots >= num_logical // ep_size:
        return initial_phy2log(num_logical, ep_size, slots - num_logical // ep_size)
    owner = np.arange(num_logical) * ep_size // num_logical
    out = np.empty((ep_size, slots), dtype=np.int64)
    for r in range(ep_size):
        mine = np.nonzero(owner == r)[0]
        if mine.size == 0:
            mine = np.array([r % num_logical])
        out[r, :mine.size] = mine
        out[r, mine.size:] = mine[-1]
    return out.reshape(-1)


def check_slot_layout(num_logical: int, num_slots: int, ep_size: int) -> int:
    """Slots per rank of any layout the peers plan: ``ep_size >= 1``, ``num_slots`` a multiple of
    it and at least ``num_logical`` (every expert needs a slot: the router still picks an expert
    without one, so a partial plan is refused). PlacementError naming the rule."""
    if ep_size < 1:
        raise PlacementError(f"num_ranks={ep_size}: must be >= 1")
    if num_slots % ep_size:
        raise PlacementError(f"num_replicas={num_slots} must be a multiple of "
                             f"num_ranks={ep_size}")
    if num_slots < num_logical:
        raise PlacementError(f"num_replicas={num_slots} must be >= the {num_logical} logical "
                             f"experts (every expert needs a slot: the router still picks an "
                             f"expert without one; a partial plan is refused)")
    return num_slots // ep_size


def replica_counts(table: np.ndarray, num_logical: int) -> np.ndarray:
    """Replica count per logical expert: int64 ``[E]`` for one row ``[D*S]``, ``[L, E]`` for a
    table ``[L, D*S]`` (one bincount). Ids outside ``[0, E)`` (free slots: -1) are not counted."""
    p = np.asarray(table, dtype=np.int64)
    t = np.atleast_2d(p)
    layers = t.shape[0]
    key = np.where((t >= 0) & (t < num_logical), t + (np.arange(layers) * num_logical)[:, None],
                   layers * num_logical)
    cnt = np.bincount(key.ravel(), minlength=layers * num_logical + 1)[:-1]
    cnt = cnt.reshape(layers, num_logical)
    return cnt if p.ndim == 2 else cnt[0]


def complete_rows(table: np.ndarray, num_logical: int) -> np.ndarray:
    """Per row of ``[L, D*S]`` (or one row ``[D*S]``): every id in ``[0, E)`` and every expert
    present (a full map; no per-rank rule). bool ``[L]``."""
    t = np.atleast_2d(np.asarray(table, dtype=np.int64))
    cnt = replica_counts(t, num_logical)
    return (cnt.sum(axis=1) == t.shape[1]) & (cnt.min(axis=1, initial=1) > 0)


def logical_loads(slot_loads: np.ndarray, table: np.ndarray, num_logical: int) -> np.ndarray:
    """Per-slot loads ``[L, D*S]`` (or ``[L, D, S]``) under ``table`` (phy2log ``[L, D*S]``)
    -> per logical expert loads, int64 ``[L, E]`` (the replicas of one expert sum; one
    bincount). Ids outside ``[0, E)`` are an error of the caller (not checked).

    NOTE: bincount works in float64; exact for loads below 2**53 per expert."""
    t = np.asarray(table, dtype=np.int64)
    layers = t.shape[0]
    idx = t + (np.arange(layers, dtype=np.int64) * num_logical)[:, None]
    w = np.asarray(slot_loads).reshape(layers, -1)
    out = np.bincount(idx.ravel(), weights=w.ravel(), minlength=layers * num_logical)
    return np.rint(out).astype(np.int64).reshape(layers, num_logical)


def valid_rows(table: np.ndarray, num_logical: int, ep_size: int,
               per_rank_cap: int = 1) -> np.ndarray:
    """Per row of ``[L, D*S]``: ids in range, every expert present, no rank holding an expert
    more than ``per_rank_cap`` times (1: the strict invariant). bool [L]; one bincount over
    (layer, rank, expert)."""
    t = np.atleast_2d(np.asarray(table, dtype=np.int64))
    layers, nslots = t.shape
    in_range = ((t >= 0) & (t < num_logical)).all(axis=1)
    safe = np.where(in_range[:, None], t, 0)
    rank = np.arange(nslots) // (nslots // ep_size)
    key = (np.arange(layers)[:, None] * ep_size + rank) * num_logical + safe
    cnt = np.bincount(key.ravel(), minlength=layers * ep_size * num_logical).reshape(
        layers, ep_size, num_logical)
    return in_range & (cnt.max(axis=(1, 2)) <= per_rank_cap) & (cnt.sum(axis=1) > 0).all(axis=1)


def validate_table(table: np.ndarray, num_logical: int, ep_size: int, label: str,
                   error: type[Exception] = PlacementError, per_rank_cap: int = 1,
                   first_layer: int = 0) -> None:
    """Every row of ``[L, D*S]`` through :func:`validate_phy2log`; the first broken rule raises
    ``error``, its message starting with ``label.format(first_layer + i)`` (e.g. ``"plan.json:
    layer {}"``)."""
    t = np.asarray(table, dtype=np.int64)
    for i in np.nonzero(~valid_rows(t, num_logical, ep_size, per_rank_cap))[0]:
        try:
            validate_phy2log(t[i], num_logical, ep_size, label.format(first_layer + int(i)),
                             per_rank_cap=per_rank_cap)
        except PlacementError as e:
            raise error(str(e)) from None


def validate_phy2log(phy2log: np.ndarray, num_logical: int, ep_size: int,
                     what: str = "placement", allow_rank_duplicates: bool = False,
                     per_rank_cap: int = 1) -> None:
    """Raise PlacementError unless every expert is present, ids are in range and no rank holds
    an expert more than ``per_rank_cap`` times (default one). phy2log: [D*S] for one layer.

    NOTE: xLLM's *initial* layout fills redundant slots with the rank's last expert, so it holds
    same-rank duplicates; pass ``allow_rank_duplicates=True`` for it (no cap). Every policy
    output must pass the strict check."""
    p = np.asarray(phy2log)
    if p.ndim != 1 or p.size % ep_size:
        raise PlacementError(f"{what}: slot table of shape {p.shape} is not [ep_size*slots] "
                             f"with ep_size={ep_size}")
    if p.size < num_logical:
        raise PlacementError(f"{what}: {p.size} slots cannot hold {num_logical} experts")
    bad = (p < 0) | (p >= num_logical)
    if bad.any():
        i = int(np.argmax(bad))
        raise PlacementError(f"{what}: slot {i} holds expert {int(p[i])}, outside [0, {num_logical})")
    missing = np.setdiff1d(np.arange(num_logical), p)
    if missing.size:
        raise PlacementError(f"{what}: logical expert {int(missing[0])} has no replica "
                             f"({missing.size} missing)")
    if allow_rank_duplicates:
        return
    cnt = np.stack([np.bincount(r, minlength=num_logical) for r in p.reshape(ep_size, -1)])
    if cnt.max() > per_rank_cap:
        r, e = (int(x[0]) for x in np.nonzero(cnt > per_rank_cap))
        rule = "one replica" if per_rank_cap == 1 else f"{per_rank_cap} replicas"
        raise PlacementError(f"{what}: rank {r} holds expert {e} {int(cnt[r, e])} times "
                             f"(at most {rule} per rank)")


def log2phy(phy2log: np.ndarray, num_logical: int, width: int | None = None) -> np.ndarray:
    """logical -> its global slots, ascending, left-packed, padded with -1: int64 [E, X] for one
    row [D*S], [L, E, X] for a table [L, D*S]; ``X`` = ``width`` or the largest replica count
    (over every layer; at least 1)."""
    p = np.asarray(phy2log, dtype=np.int64)
    t = np.atleast_2d(p)
    layers, nslots = t.shape
    cnt = replica_counts(t, num_logical)
    x = max(1, int(cnt.max())) if width is None else int(width)
    order = np.argsort(t, axis=1, kind="stable")                 # slots grouped by expert
    expert = np.take_along_axis(t, order, 1)
    start = np.concatenate([np.zeros((layers, 1), np.int64), np.cumsum(cnt, axis=1)[:, :-1]],
                           axis=1)
    col = np.arange(nslots)[None, :] - np.take_along_axis(start, expert, 1)
    out = np.full((layers, num_logical, x), -1, dtype=np.int64)
    li = np.repeat(np.arange(layers), nslots)
    out[li, expert.ravel(), col.ravel()] = order.ravel()
    return out if p.ndim == 2 else out[0]


#: local-search move kinds (module doc): exchange two slots' experts / point a slot at an expert
SWAP, SET = 0, 1


def apply_moves(table: np.ndarray, moves) -> np.ndarray:
    """Apply moves ``(kind, x, y, ...)`` to a flat table [D*S] in place (``SWAP``: slots x and
    y exchange experts; ``SET``: slot x holds expert y). Returns the table."""
    for kind, x, y, *_ in moves:
        if kind == SWAP:
            table[x], table[y] = table[y], table[x]
        else:
            table[x] = y
    return table


def undo_swaps(table: np.ndarray, moves) -> np.ndarray:
    """Undo ``SWAP`` moves on a table (any shape; flat slot indices), last first, in place. A
    ``SET`` cannot be undone without the expert it replaced: ValueError."""
    flat = table.reshape(-1)
    for kind, x, y, *_ in reversed(moves):
        if kind != SWAP:
            raise ValueError("undo_swaps: only swaps can be undone")
        flat[x], flat[y] = flat[y], flat[x]
    return table


def build_log2phy(phy2log: np.ndarray, num_logical: int, ep_rank: int) -> np.ndarray:
    """The routing map one rank uses: logical e -> the replica with index ``ep_rank % count``
    among e's slots in global (rank-major) order, as xLLM does; -1 if e is missing.

    Every source rank sends a given expert's tokens to one replica, and different source
    ranks spread over the replicas. int64 [E].
    """
    table = log2phy(phy2log, num_logical)
    cnt = (table >= 0).sum(axis=1)
    idx = np.where(cnt > 0, ep_rank % np.maximum(cnt, 1), 0)
    out = table[np.arange(num_logical), idx]
    return np.where(cnt > 0, out, -1)


@dataclass(frozen=True)
class PlacementDiff:
    moved_slots: int      # slots whose logical expert changed
    weight_copies: int    # changed slots whose new expert was not on that rank before (cross-rank)


def diff(old: np.ndarray, new: np.ndarray, ep_size: int) -> PlacementDiff:
    """Compare two slot tables of equal shape ([D*S] or [layers, D*S])."""
    o = np.atleast_2d(np.asarray(old, dtype=np.int64))
    n = np.atleast_2d(np.asarray(new, dtype=np.int64))
    if o.shape != n.shape:
        raise PlacementError(f"cannot diff placements of shapes {o.shape} and {n.shape}")
    moved = int((o != n).sum())
    layers, nslots = o.shape
    ro = o.reshape(layers, ep_size, 1, -1)
    rn = n.reshape(layers, ep_size, -1)
    # a changed slot costs a cross-rank copy unless its new expert was already on that rank
    resident = (rn[..., :, None] == ro).any(axis=-1)
    copies = int(((o != n).reshape(rn.shape) & ~resident).sum())
    return PlacementDiff(moved, copies)
