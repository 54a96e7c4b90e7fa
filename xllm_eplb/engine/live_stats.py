"""The live view of a serving engine (#27): vLLM-style per-token and per-step metrics, the
per-layer expert view (hot experts and their replicas), the KV-cache use and the periodic
console stats line (:mod:`xllm_eplb.obs.stats_line`).

Step-loop thread only: the engine calls :meth:`LiveStats.on_scheduled` with each step's batches,
:meth:`on_tokens` with its sampled tokens, :meth:`on_finished` with finished requests,
:meth:`on_slot_loads` with the step's per-slot loads and placement, and :meth:`refresh` about once a second
(gauges; returns the stats line when one is due). Times are ``time.monotonic()`` seconds.
"""

from __future__ import annotations

import collections

import numpy as np

from xllm_eplb.eplb.placement import logical_loads, replica_counts
from xllm_eplb.obs.metrics import EngineMetrics
from xllm_eplb.obs.stats_line import StatsLine

#: steps in the recent window behind the expert gauges (as ``telemetry.RECENT_STEPS``)
EXPERT_WINDOW_STEPS = 64


class LiveStats:
    """``kv_capacity``: the most tokens the scheduler can hold (``ep_size x max_batch_size x
    max_position_embeddings``), the denominator of the KV-cache use."""

    def __init__(self, metrics: EngineMetrics, *, num_layers: int, num_experts: int,
                 kv_capacity: int, stats_interval_s: float, now: float):
        self.m, self.E, self.kv_capacity = metrics, num_experts, max(1, int(kv_capacity))
        self.stats = StatsLine(stats_interval_s, now)
        self.last_token: dict[int, float] = {}
        self.window: collections.deque = collections.deque(maxlen=EXPERT_WINDOW_STEPS)
        self.expert_total = np.zeros((num_layers, num_experts), dtype=np.int64)
        self.want_experts = metrics.hot_experts > 0 or metrics.all_experts
        self.kv_tokens = 0

    def resize(self, kv_capacity: int) -> None:
        """The membership changed size (``Engine.resize``): the new KV capacity in tokens."""
        self.kv_capacity = max(1, int(kv_capacity))

    # --- per step ----------------------------------------------------------------------------
    def on_scheduled(self, batches, running: dict, now: float) -> None:
        """One step's batches (before the forward): batch size, tokens per step, the queue time
        of each request whose prefill starts now (``running``: req_id -> Request)."""
        rows = [r for b in batches for r in b.rows]
        if not rows:
            return
        self.m.batch_size.observe(len(rows))
        self.m.step_tokens.observe(sum(len(r.token_ids) for r in rows))
        prompt = 0
        for r in rows:
            if not r.is_prefill:
                continue
            prompt += len(r.token_ids)
            req = running.get(r.req_id)
            if r.start_pos == 0 and req is not None:
                self.m.queue_time.observe(max(0.0, now - req.arrival))
        self.stats.count(prompt, 0)

    def on_tokens(self, req_ids, now: float) -> None:
        """The requests that got a token this step: inter-token latencies."""
        n = 0
        for rid in req_ids:
            n += 1
            prev = self.last_token.get(rid)
            if prev is not None:
                self.m.itl.observe(now - prev)
            self.last_token[rid] = now
        self.stats.count(0, n)

    def on_finished(self, finished) -> None:
        """Finished (or cancelled) requests: time per output token; forget their last token."""
        for r in finished:
            self.last_token.pop(r.req_id, None)
            if len(r.output) > 1 and r.first_token_at and r.finished_at:
                self.m.tpot.observe((r.finished_at - r.first_token_at) / (len(r.output) - 1))

    def on_slot_loads(self, slots: np.ndarray, placement: np.ndarray) -> None:
        """The step's per-slot loads [L, P] and the placement it ran under: the recent window
        of per-logical-expert loads."""
        if not self.want_experts or slots.size == 0:
            return
        loads = logical_loads(slots, placement, self.E)
        if len(self.window) == self.window.maxlen:
            self.expert_total -= self.window[0]
        self.window.append(loads)
        self.expert_total += loads

    # --- about once a second -----------------------------------------------------------------
    def refresh(self, now: float, *, running: dict, waiting: int, placement: np.ndarray,
                balancedness: float | None, placement_epoch: int,
                last_rebalance_at: float | None, waiting_for_slot: int = 0,
                max_batch_size: int = 0) -> tuple[str, bool] | None:
        """KV and expert gauges; when a stats line is due, ``(line, busy)`` (``busy``: tokens
        in the window or requests running or waiting; an idle line is for the debug log, as
        vLLM logs idle stats), else None."""
        self.kv_tokens = sum(r.num_tokens for r in running.values())
        usage = self.kv_tokens / self.kv_capacity
        self.m.kv_tokens.set(self.kv_tokens)
        self.m.kv_usage.set(usage)
        if self.want_experts and self.window:
            self.m.set_experts(self.expert_total, replica_counts(placement, self.E))
        if not self.stats.due(now):
            return None
        busy = bool(self.stats.prompt_tokens or self.stats.generation_tokens or running
                    or waiting)
        return self.stats.line(now, running=len(running), waiting=waiting, kv_usage=usage,
                               balancedness=balancedness, placement_epoch=placement_epoch,
                               last_rebalance_at=last_rebalance_at,
                               waiting_for_slot=waiting_for_slot,
                               max_batch_size=max_batch_size), busy
