"""`IEplbPolicy` and the shared publication gate + rollback (xLLM ``EplbPolicyBase``, §2.1-2.2).

Subclasses implement :meth:`EplbPolicyBase.plan_layers` (all layers at once, vectorised) or
:meth:`EplbPolicyBase.plan_layer` (one layer); the gate, the per-layer rollback records and the
``EPLB placement benefit`` log line live only here.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod

import numpy as np

from xllm_eplb.eplb.balance import rank_loads_from_phy2log
from xllm_eplb.eplb.placement import PlacementError, slots_per_rank, validate_phy2log
from xllm_eplb.errors import ConfigError
from xllm_eplb.obs.logs import event

log = logging.getLogger(__name__)


class IEplbPolicy(ABC):
    """What the manager drives. Tables are rank-major ``[L, D*S]`` int64."""

    name: str = "abstract"

    @abstractmethod
    def initialize(self, phy2log: np.ndarray) -> None:
        """Seed with the active placement ``[L, D*S]`` (may hold initial same-rank duplicates)."""

    @abstractmethod
    def rebalance(self, logical: np.ndarray, physical: np.ndarray | None = None):
        """logical [L, E], physical [L, D, S] or None -> (cand [L, D*S] int64, update [L] bool).
        Rows with ``update=False`` hold the previous table."""

    @abstractmethod
    def commit_layer(self, layer: int) -> None:
        """The layer's candidate is active on every rank: drop its rollback record."""

    @abstractmethod
    def abort_layer(self, layer: int) -> None:
        """The layer's candidate was never activated: restore the previous table."""


def valid_rows(table: np.ndarray, num_logical: int, ep_size: int) -> np.ndarray:
    """Strict invariants per row of ``[L, D*S]``: ids in range, every expert present, at most one
    replica per rank. Returns bool [L]."""
    t = np.asarray(table, dtype=np.int64)
    layers, nslots = t.shape
    in_range = ((t >= 0) & (t < num_logical)).all(axis=1)
    safe = np.where(in_range[:, None], t, 0)
    per_rank = np.sort(safe.reshape(layers, ep_size, -1), axis=2)
    no_dup = ~(per_rank[..., 1:] == per_rank[..., :-1]).any(axis=(1, 2))
    flat = (safe + (np.arange(layers) * num_logical)[:, None]).ravel()
    cnt = np.bincount(flat, minlength=layers * num_logical).reshape(layers, num_logical)
    return in_range & no_dup & (cnt > 0).all(axis=1)


class EplbPolicyBase(IEplbPolicy):
    """Gate + rollback shared by every policy.

    State: ``_dist`` [L, D*S] (the table handed to the manager; -1 before any seed),
    ``_prev[l]`` what the policy believes is deployed or in flight (None = never seeded),
    ``_rollback[l] = (old dist row, old prev row)`` for a published, uncommitted layer.
    """

    name = "base"

    def __init__(self, ep_size: int, num_logical: int, redundant: int,
                 min_improvement: float = 0.05, **opts):
        try:
            self.slots = slots_per_rank(num_logical, ep_size, redundant)
        except PlacementError as e:
            raise ConfigError(str(e)) from None
        if self.slots > num_logical:
            raise ConfigError(f"redundant_experts_num={redundant}: {self.slots} slots per rank "
                              f"exceed the {num_logical} experts (one replica of an expert per "
                              f"rank)")
        if not 0.0 <= float(min_improvement) <= 1.0:
            raise ConfigError(f"eplb_min_peak_load_improvement={min_improvement} must be in [0, 1]")
        self.ep_size, self.num_logical, self.redundant = ep_size, num_logical, redundant
        self.min_improvement = float(min_improvement)
        self.num_slots = ep_size * self.slots
        if opts:
            log.debug(event("EPLB policy options ignored", policy=self.name,
                            keys=",".join(sorted(opts))))
        self._dist: np.ndarray | None = None
        self._prev: list[np.ndarray | None] = []
        self._rollback: dict[int, tuple[np.ndarray, np.ndarray | None]] = {}
        self.last_gate: list[dict] = []

    # ---- planning hooks ---------------------------------------------------------------------
    def plan_layers(self, loads: np.ndarray, prev: np.ndarray) -> list[np.ndarray | None]:
        """loads [L, E], prev [L, D*S] (-1 rows = never seeded) -> one candidate [D*S] or None
        (skip) per layer. Default: :meth:`plan_layer` per layer."""
        return [self.plan_layer(loads[i], prev[i]) for i in range(loads.shape[0])]

    def plan_layer(self, load: np.ndarray, prev: np.ndarray) -> np.ndarray | None:
        raise NotImplementedError

    # ---- IEplbPolicy --------------------------------------------------------------------------
    def initialize(self, phy2log: np.ndarray) -> None:
        p = np.atleast_2d(np.asarray(phy2log, dtype=np.int64))
        if p.ndim != 2 or p.shape[1] != self.num_slots:
            raise PlacementError(f"seed placement of shape {p.shape} is not [layers, "
                                 f"{self.num_slots}] (ep_size={self.ep_size} x {self.slots})")
        for i, row in enumerate(p):
            validate_phy2log(row, self.num_logical, self.ep_size, f"seed placement layer {i}",
                             allow_rank_duplicates=True)
        self._dist = p.copy()
        self._prev = [row.copy() for row in p]
        self._rollback = {}

    def _ensure_layers(self, layers: int) -> None:
        if self._dist is None:
            self._dist = np.full((layers, self.num_slots), -1, dtype=np.int64)
            self._prev = [None] * layers
        elif self._dist.shape[0] != layers:
            raise ValueError(f"load has {layers} layers, the policy holds {self._dist.shape[0]}")

    def prev_table(self) -> np.ndarray:
        """[L, D*S]: the table the policy believes is deployed (-1 rows = never seeded)."""
        return np.stack([np.full(self.num_slots, -1, dtype=np.int64) if p is None else p
                         for p in self._prev])

    def rebalance(self, logical, physical=None):
        lg = np.asarray(logical)
        if lg.ndim != 2 or lg.shape[1] != self.num_logical:
            raise ValueError(f"logical load of shape {lg.shape} is not [layers, "
                             f"{self.num_logical}]")
        layers = lg.shape[0]
        if physical is not None:
            physical = np.asarray(physical, dtype=np.float64)
            if physical.shape != (layers, self.ep_size, self.slots):
                raise ValueError(f"physical load of shape {physical.shape} is not "
                                 f"{(layers, self.ep_size, self.slots)}")
        self._ensure_layers(layers)
        prev = self.prev_table()
        cands = self.plan_layers(lg, prev)
        table = np.stack([prev[i] if c is None else np.asarray(c, dtype=np.int64)
                          for i, c in enumerate(cands)])
        planned = np.array([c is not None for c in cands])
        valid = valid_rows(table, self.num_logical, self.ep_size)
        for i in np.nonzero(planned & ~valid)[0]:
            log.warning(event("EPLB policy produced an invalid placement; layer skipped",
                              policy=self.name, layer=int(i)))
        planned &= valid
        seeded = np.array([p is not None for p in self._prev])
        changed = planned & (~seeded | (table != prev).any(axis=1))
        gated = changed & seeded
        publish = changed.copy()
        self.last_gate = []
        if gated.any():
            publish[gated] = self._gate(np.nonzero(gated)[0], lg, prev, table, physical)
        update = np.zeros(layers, dtype=bool)
        for i in np.nonzero(publish)[0]:
            self._rollback[int(i)] = (self._dist[i].copy(), self._prev[i])
            self._prev[i] = table[i].copy()
            self._dist[i] = table[i]
            update[i] = True
        return self._dist.copy(), update

    def _gate(self, idx, lg, prev, table, physical) -> np.ndarray:
        """xLLM compare_peak for the layers ``idx``: measured current peak (when physical is
        given), candidate peak estimated with even split and rescaled into physical units."""
        w = np.asarray(lg[idx], dtype=np.float64)
        cur = rank_loads_from_phy2log(prev[idx], w, self.ep_size).max(axis=1)
        prop = rank_loads_from_phy2log(table[idx], w, self.ep_size).max(axis=1)
        if physical is not None:
            dev = physical[idx].sum(axis=2)
            cur = dev.max(axis=1)
            tot = w.sum(axis=1)
            prop = np.where(tot > 0, prop * dev.sum(axis=1) / np.where(tot > 0, tot, 1.0), prop)
        with np.errstate(invalid="ignore", divide="ignore"):
            ratio = np.where(cur > 0, (cur - prop) / np.where(cur > 0, cur, 1.0), 0.0)
        ok = (ratio > 0) & (ratio >= self.min_improvement)
        for j, i in enumerate(idx):
            rec = dict(layer=int(i), current_peak=float(cur[j]), proposed_peak=float(prop[j]),
                       improvement_ratio=float(ratio[j]),
                       min_improvement_ratio=self.min_improvement,
                       placement_changed=bool(ok[j]))
            self.last_gate.append(rec)
            log.info(event("EPLB placement benefit", policy=self.name, **rec))
        return ok

    def commit_layer(self, layer: int) -> None:
        self._rollback.pop(int(layer), None)

    def abort_layer(self, layer: int) -> None:
        rec = self._rollback.pop(int(layer), None)
        if rec is not None and self._dist is not None:
            self._dist[layer], self._prev[layer] = rec
