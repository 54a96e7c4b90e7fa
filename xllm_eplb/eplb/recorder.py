"""`ExpertRecorder`: the live expert distribution of a server, recorded on request.

The engine hands it every forward's slot counters (the ``[L, S]`` prefix sums each rank reports,
:mod:`~xllm_eplb.eplb.counters`) together with the placement that forward ran under; it decodes
them exactly as the aggregator does (:func:`~xllm_eplb.eplb.aggregator.decode_counters`, then
:func:`~xllm_eplb.eplb.placement.logical_loads`: replicas of one expert sum) and adds the
logical counts. What it produces:

- :meth:`dump`: SGLang's expert-distribution dump, ``{"logical_count": [[E] x L], ...}`` (MoE
  layers only, token-expert picks summed over the recorded steps), the file ``xllm-eplb plan
  --load`` and ``simulate --generate 'sglang:FILE.json'`` read as they are;
- :meth:`trace_loads`: the per-step logical loads, int64 ``[steps, L, E]``, the ``loads`` array of
  the ``.npz`` that ``simulate --trace`` reads (only when started with ``trace=True``; at most
  ``trace_max_steps`` steps are kept, the totals keep counting).

Off (never started, or stopped) it costs one attribute read per step: the engine checks
:attr:`active` before building anything. Thread-safe: the step loop adds, HTTP handlers start,
stop and dump.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np

from xllm_eplb.eplb.aggregator import CounterShapeError, decode_counters
from xllm_eplb.eplb.placement import logical_loads
from xllm_eplb.obs.logs import event

log = logging.getLogger(__name__)


class RecordStateError(RuntimeError):
    """start while recording, stop while not, dump or trace of nothing (HTTP 409)."""


class ExpertRecorder:
    """See the module docstring. Shapes: ``L`` MoE layers, ``D`` ranks, ``S`` slots per rank,
    ``E`` logical experts."""

    def __init__(self, num_layers: int, ep_size: int, slots_per_rank: int, num_logical: int,
                 trace_max_steps: int, clock=time.time):
        self.L, self.D, self.S, self.E = num_layers, ep_size, slots_per_rank, num_logical
        self.trace_max_steps = int(trace_max_steps)
        self.clock = clock
        self.active = False          # read unlocked by the step loop (a plain bool)
        self._lock = threading.Lock()
        self._total: np.ndarray | None = None          # int64 [L, E]; None = never started
        self._rows: list[np.ndarray] | None = None     # int32 [L, E] per step, or None
        self._steps = self._rejected = 0
        self._started_at = self._stopped_at = 0.0

    # --- control (HTTP thread) ------------------------------------------------------------
    def start(self, trace: bool = False) -> dict:
        """Begin a new recording (the previous one is discarded)."""
        with self._lock:
            if self.active:
                raise RecordStateError("a recording is already running; POST /eplb/record/stop "
                                       "first")
            self._total = np.zeros((self.L, self.E), dtype=np.int64)
            self._rows = [] if trace else None
            self._steps = self._rejected = 0
            self._started_at, self._stopped_at = self.clock(), 0.0
            self.active = True
            info = self._status()
        log.info(event("EPLB record start", trace=trace, trace_max_steps=self.trace_max_steps))
        return info

    def stop(self) -> dict:
        with self._lock:
            if not self.active:
                raise RecordStateError("no recording is running; POST /eplb/record/start first")
            self.active = False
            self._stopped_at = self.clock()
            info = self._status()
        log.info(event("EPLB record stop", steps=info["steps"], trace_steps=info["trace_steps"]))
        return info

    # --- data (step loop) -----------------------------------------------------------------
    def add(self, counters: list[np.ndarray], placement: np.ndarray) -> None:
        """One forward: ``counters`` (one ``[L, S]`` prefix-sum array per rank, rank order)
        measured under ``placement`` ``[L, D*S]``. A malformed output is counted and skipped."""
        if not self.active:
            return
        try:
            deltas = decode_counters(counters, self.L, self.S, self.D)
        except CounterShapeError as e:
            with self._lock:
                self._rejected += 1
            log.warning(event("EPLB record rejected worker output", reason=str(e)))
            return
        logical = logical_loads(deltas, np.asarray(placement, dtype=np.int64), self.E)
        with self._lock:
            if not self.active:
                return
            self._total += logical
            self._steps += 1
            if self._rows is not None and len(self._rows) < self.trace_max_steps:
                self._rows.append(logical.astype(np.int32))

    # --- results (HTTP thread) ------------------------------------------------------------
    def status(self) -> dict:
        with self._lock:
            return self._status()

    def _status(self) -> dict:
        rows = self._rows
        return {"recording": self.active, "recorded": self._total is not None,
                "steps": self._steps, "trace": rows is not None,
                "trace_steps": len(rows) if rows is not None else 0,
                "trace_truncated": rows is not None and self._steps > len(rows),
                "rejected_outputs": self._rejected,
                "seconds": round((self._stopped_at or self.clock()) - self._started_at, 3)
                if self._total is not None else 0.0}

    def dump(self) -> dict:
        """SGLang's dump: ``logical_count`` int ``[L][E]`` plus this recording's status fields
        (``plan`` and ``simulate`` read only ``logical_count``)."""
        with self._lock:
            if self._total is None:
                raise RecordStateError("nothing recorded; POST /eplb/record/start first")
            return {"logical_count": self._total.tolist(), "num_moe_layers": self.L,
                    "num_experts": self.E, "ep_size": self.D, **self._status()}

    def trace_loads(self) -> np.ndarray:
        """Per-step logical loads, int64 ``[steps, L, E]`` (steps >= 1)."""
        with self._lock:
            if self._total is None:
                raise RecordStateError("nothing recorded; POST /eplb/record/start first")
            if self._rows is None:
                raise RecordStateError("this recording keeps no per-step trace; start it with "
                                       "{\"trace\": true}")
            if not self._rows:
                raise RecordStateError("no forward step recorded yet (send some requests)")
            return np.stack(self._rows).astype(np.int64)
