"""Placement of logical experts on physical slots, per MoE layer.

Glossary: ``phy2log[global_slot] -> logical id`` (length ``ep_size * slots_per_rank``, rank-major:
slot ``s`` lives on rank ``s // slots_per_rank``); ``log2phy`` = logical -> its global slots;
``logcnt[e]`` = replica count of logical expert ``e``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from xllm_eplb.config import layout_error


class PlacementError(ValueError):
    """A slot table that breaks an invariant; the message names the rule and the offender."""


def slots_per_rank(num_logical: int, ep_size: int, redundant: int) -> int:
    """``num_logical / ep_size + redundant``; PlacementError when the layout rules
    (:func:`xllm_eplb.config.layout_rules`) fail."""
    err = layout_error(num_logical, ep_size, redundant)
    if err:
        raise PlacementError(err)
    return num_logical // ep_size + redundant


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


def validate_phy2log(phy2log: np.ndarray, num_logical: int, ep_size: int,
                     what: str = "placement", allow_rank_duplicates: bool = False) -> None:
    """Raise PlacementError unless every expert is present, ids are in range and no rank holds
    two replicas of one expert. phy2log: [D*S] for one layer.

    NOTE: xLLM's *initial* layout fills redundant slots with the rank's last expert, so it holds
    same-rank duplicates; pass ``allow_rank_duplicates=True`` for it. Every policy output must
    pass the strict check."""
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
    per_rank = np.sort(p.reshape(ep_size, -1), axis=1)
    dup = per_rank[:, 1:] == per_rank[:, :-1]
    if dup.any():
        r, j = (int(x[0]) for x in np.nonzero(dup))
        e = int(per_rank[r, j])
        n = int((per_rank[r] == e).sum())
        raise PlacementError(f"{what}: rank {r} holds expert {e} {n} times "
                             f"(at most one replica per rank)")


def logcnt(phy2log: np.ndarray, num_logical: int) -> np.ndarray:
    """Replica count per logical expert, int64 [E] (or [layers, E] for a 2-D table)."""
    p = np.asarray(phy2log, dtype=np.int64)
    if p.ndim == 1:
        return np.bincount(p, minlength=num_logical)
    return np.stack([np.bincount(row, minlength=num_logical) for row in p])


def log2phy(phy2log: np.ndarray, num_logical: int) -> np.ndarray:
    """logical -> its global slots, padded with -1: int64 [E, max_replicas] (one layer)."""
    p = np.asarray(phy2log, dtype=np.int64)
    cnt = np.bincount(p, minlength=num_logical)
    out = np.full((num_logical, max(1, int(cnt.max()))), -1, dtype=np.int64)
    order = np.argsort(p, kind="stable")
    starts = np.concatenate(([0], np.cumsum(cnt)[:-1]))
    for e in range(num_logical):
        out[e, : cnt[e]] = order[starts[e]: starts[e] + cnt[e]]
    return out


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


@dataclass(frozen=True)
class Placement:
    """One MoE layer's slot table with its derived views.

    ``phy2log``: int64 [ep_size * slots_per_rank], rank-major. ``log2phy``: int64
    [E, max_replicas] padded with -1. ``logcnt``: int64 [E] replica counts.
    """

    phy2log: np.ndarray
    num_logical: int
    ep_size: int

    @classmethod
    def initial(cls, num_logical: int, ep_size: int, redundant: int) -> "Placement":
        return cls(initial_phy2log(num_logical, ep_size, redundant), num_logical, ep_size)

    @property
    def slots_per_rank(self) -> int:
        return int(np.asarray(self.phy2log).size // self.ep_size)

    @property
    def log2phy(self) -> np.ndarray:
        return log2phy(self.phy2log, self.num_logical)

    @property
    def logcnt(self) -> np.ndarray:
        return logcnt(self.phy2log, self.num_logical)

    def by_rank(self) -> np.ndarray:
        """int64 [ep_size, slots_per_rank]."""
        return np.asarray(self.phy2log, dtype=np.int64).reshape(self.ep_size, -1)

    def validate(self, what: str = "placement", allow_rank_duplicates: bool = False) -> None:
        validate_phy2log(self.phy2log, self.num_logical, self.ep_size, what,
                         allow_rank_duplicates)

    def diff(self, other: "Placement") -> PlacementDiff:
        return diff(self.phy2log, other.phy2log, self.ep_size)
