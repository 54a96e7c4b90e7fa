"""The periodic console stats line while serving (``--log_stats_interval`` seconds), as vLLM's
``Avg prompt throughput ... Running ... Waiting ... KV cache usage`` line, plus the EPLB view::

    engine stats prompt_tokens_per_s=412.3 generation_tokens_per_s=96.1 running=12 waiting=0
        kv_cache_usage=0.4% balancedness=0.812 placement_epoch=3 last_rebalance_s=14.2

(one line; ``last_rebalance_s``: seconds since the last committed layer activation, ``never``
before the first). When requests wait because every rank runs ``--max_batch_size`` rows, the
line says so after ``waiting``: ``waiting_for_slot=24 max_batch_size=8``. Pure bookkeeping: the step loop counts tokens, then asks :meth:`line` when
:meth:`due`; times are ``time.monotonic()`` seconds passed in.
"""

from __future__ import annotations

from xllm_eplb.obs.logs import event

#: the fixed prefix of the line (grep-able, docs/serving.md)
PREFIX = "engine stats"


class StatsLine:
    """Token counts since the last line and the line itself."""

    def __init__(self, interval_s: float, now: float):
        self.interval_s = float(interval_s)
        self.since = now
        self.prompt_tokens = self.generation_tokens = 0

    def count(self, prompt_tokens: int, generation_tokens: int) -> None:
        """One step's prefilled prompt tokens and sampled output tokens."""
        self.prompt_tokens += int(prompt_tokens)
        self.generation_tokens += int(generation_tokens)

    def due(self, now: float) -> bool:
        return self.interval_s > 0 and now - self.since >= self.interval_s

    def line(self, now: float, *, running: int, waiting: int, kv_usage: float,
             balancedness: float | None, placement_epoch: int, last_rebalance_at: float | None,
             waiting_for_slot: int = 0, max_batch_size: int = 0) -> str:
        """The line for the window since the previous one (then a new window starts).
        ``kv_usage``: ratio in [0, 1]; ``balancedness``: mean over MoE layers of the recent
        window (None before the first step); ``last_rebalance_at``: monotonic time of the last
        committed activation (None: never); ``waiting_for_slot``: requests waiting for a batch
        slot (every rank at ``max_batch_size`` rows), shown when > 0."""
        secs = max(now - self.since, 1e-9)
        full = ({"waiting_for_slot": waiting_for_slot, "max_batch_size": max_batch_size}
                if waiting_for_slot > 0 else {})
        text = event(PREFIX,
                     prompt_tokens_per_s=round(self.prompt_tokens / secs, 1),
                     generation_tokens_per_s=round(self.generation_tokens / secs, 1),
                     running=running, waiting=waiting, **full,
                     kv_cache_usage=f"{100.0 * kv_usage:.1f}%",
                     balancedness="-" if balancedness is None else f"{balancedness:.3f}",
                     placement_epoch=placement_epoch,
                     last_rebalance_s="never" if last_rebalance_at is None
                     else round(now - last_rebalance_at, 1))
        self.since, self.prompt_tokens, self.generation_tokens = now, 0, 0
        return text
