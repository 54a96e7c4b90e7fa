"""Built-in synthetic workload (``--workload synthetic``): skewed, drifting topic traffic.

Requests arrive as a Poisson process (``workload_rate`` per second). Each picks a topic by a
Zipf law over topic *ranks* (``P(rank k) ~ 1 / (k + 1) ** workload_skew``); the topic holding
rank k is ``(k + shift) % T`` where ``shift`` grows by one every ``workload_drift_seconds``, so
the hot topic -- and with it the hot experts -- moves. Prompts are BOS + token ids of the topic
(``workload_prompt_len`` in all); outputs are exactly ``workload_output_len`` tokens (EOS
ignored) so the load is steady.

Where prompt tokens come from (:class:`TopicPrompts`):

- a checkpoint made by ``make-checkpoint`` (``xllm_eplb_topics.json``; the generated default
  checkpoint served without ``--model`` is one): the
  ordinary (non-special) ids of its tokenizer's vocabulary, topic ``t`` = the ids ``v`` with
  ``v % num_topics == t`` (the rule its embedding and routers were built with, see
  :mod:`xllm_eplb.model.checkpoint`), BOS = the tokenizer's;
- any other checkpoint: one topic, all ordinary ids of its tokenizer (or of ``config.json``'s
  ``vocab_size`` without one): no designed skew, so no drift to follow.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np

from xllm_eplb.config import Config
from xllm_eplb.engine.scheduler import Request
from xllm_eplb.engine.tokenizer import load_tokenizer
from xllm_eplb.obs.logs import event

log = logging.getLogger(__name__)


def zipf_probs(num_topics: int, skew: float) -> np.ndarray:
    """P(rank k), k = 0..T-1, float64 [T] summing to 1 (``skew=0``: uniform)."""
    w = 1.0 / np.arange(1, num_topics + 1, dtype=np.float64) ** float(skew)
    return w / w.sum()


def topic_of_rank(rank: int, elapsed: float, num_topics: int, drift_seconds: float) -> int:
    """The topic that holds popularity ``rank`` after ``elapsed`` seconds of drift."""
    shift = int(elapsed // drift_seconds) if drift_seconds > 0 else 0
    return (rank + shift) % num_topics


class TopicPrompts:
    """Token pools per topic. ``pools``: one int64 array of token ids per topic; ``bos_id``:
    prepended to every prompt (None: nothing is)."""

    def __init__(self, pools: list[np.ndarray], bos_id: int | None, source: str):
        if not pools or any(len(p) == 0 for p in pools):
            raise ValueError(f"{source}: every topic needs at least one token id")
        self.pools, self.bos_id, self.source = pools, bos_id, source
        self.num_topics = len(pools)

    @classmethod
    def for_config(cls, cfg: Config) -> "TopicPrompts":
        """The pools of ``cfg.model.model`` (the launcher fills it with the generated default
        checkpoint when ``--model`` is empty)."""
        if not cfg.model.model:
            raise ValueError("TopicPrompts.for_config: cfg.model.model is empty (resolve it with "
                             "model.default_checkpoint.with_default_checkpoint first)")
        return cls.for_checkpoint(cfg.model.model)

    @classmethod
    def for_checkpoint(cls, model_dir: str) -> "TopicPrompts":
        """Pools of a checkpoint folder (see the module docstring)."""
        import json
        from pathlib import Path

        from xllm_eplb.model.checkpoint import read_topics

        tok = load_tokenizer(model_dir)
        info = read_topics(model_dir)
        if info is not None:
            T = int(info["num_topics"])
            lo, hi = (int(x) for x in info["text_token_ids"])
            return cls([np.arange(lo + (t - lo) % T, hi, T) for t in range(T)], tok.bos_id,
                       str(model_dir))
        n = getattr(tok, "num_text_tokens", None)
        if n is None:
            n = int(json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"])
        return cls([np.arange(n)], tok.bos_id, str(model_dir))

    def sample(self, topic: int, n: int, rng: np.random.Generator) -> list[int]:
        """``n`` token ids of ``topic`` drawn with ``rng`` (uniformly from its pool)."""
        if not 0 <= topic < self.num_topics:
            raise ValueError(f"topic={topic} outside [0, {self.num_topics})")
        return [int(x) for x in rng.choice(self.pools[topic], size=n)]

    def prompt(self, topic: int, length: int, rng: np.random.Generator) -> list[int]:
        """A prompt of ``length`` ids: BOS (if any) + topic tokens."""
        head = [] if self.bos_id is None else [self.bos_id]
        return head + self.sample(topic, max(0, length - len(head)), rng)


class SyntheticWorkload:
    """Generates requests on a daemon thread and hands them to ``submit``.

    ``seed`` makes the sequence of topics, prompts and gaps reproducible; ``prompts``: where
    prompt tokens come from (default :meth:`TopicPrompts.for_config`).
    """

    def __init__(self, cfg: Config, submit, *, seed: int = 1234, clock=time.monotonic,
                 backlog=None, max_backlog: int = 0, prompts: TopicPrompts | None = None):
        self.cfg, self.submit, self.clock = cfg, submit, clock
        self.prompts = prompts or TopicPrompts.for_config(cfg)
        self.num_topics = self.prompts.num_topics
        self.probs = zipf_probs(self.num_topics, cfg.serve.workload_skew)
        self.rng = np.random.default_rng(seed)
        self.sent = self.skipped = 0
        # NOTE: an engine slower than the arrival rate would queue without bound; arrivals
        # that find ``backlog() >= max_backlog`` are skipped (counted, never queued).
        self.backlog, self.max_backlog = backlog, max_backlog
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = clock()
        self._last_shift = -1

    def make_request(self, now: float) -> Request:
        """One request at time ``now`` (seconds since start are taken from the clock)."""
        s = self.cfg.serve
        elapsed = now - self._t0
        rank = int(self.rng.choice(self.num_topics, p=self.probs))
        topic = topic_of_rank(rank, elapsed, self.num_topics, s.workload_drift_seconds)
        self._log_drift(elapsed)
        prompt = self.prompts.prompt(topic, s.workload_prompt_len, self.rng)
        seed = int(self.rng.integers(0, 1 << 31))
        return Request(prompt=prompt, max_tokens=s.workload_output_len,
                       temperature=0.0, seed=seed, source="workload", stop_at_eos=False)

    def _log_drift(self, elapsed: float) -> None:
        d = self.cfg.serve.workload_drift_seconds
        shift = int(elapsed // d) if d > 0 else 0
        if shift != self._last_shift:
            self._last_shift = shift
            hot = topic_of_rank(0, elapsed, self.num_topics, d)
            log.info(event("workload topics", hot_topic=hot, shift=shift,
                           skew=self.cfg.serve.workload_skew, topics=self.num_topics))

    def start(self) -> None:
        self._t0 = self.clock()
        self._thread = threading.Thread(target=self._run, name="workload", daemon=True)
        self._thread.start()
        s = self.cfg.serve
        log.info(event("workload start", kind="synthetic", tokens=self.prompts.source,
                       topics=self.num_topics, rate=s.workload_rate,
                       prompt_len=s.workload_prompt_len, output_len=s.workload_output_len,
                       skew=s.workload_skew, drift_seconds=s.workload_drift_seconds))

    def _run(self) -> None:
        s = self.cfg.serve
        while not self._stop.is_set():
            if s.workload_max_requests and self.sent >= s.workload_max_requests:
                return
            if self._stop.wait(float(self.rng.exponential(1.0 / s.workload_rate))):
                return
            if self.backlog is not None and self.max_backlog and \
                    self.backlog() >= self.max_backlog:
                self.skipped += 1
                continue
            self.submit(self.make_request(self.clock()))
            self.sent += 1

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)


def workload_status(s) -> dict:
    """``/eplb/status``'s ``workload``: the built-in generator's settings (``s``: the serve
    config). ``{"kind": "none"}`` when the server only answers its clients."""
    if s.workload != "synthetic":
        return {"kind": s.workload}
    return {"kind": "synthetic", "rate_per_s": s.workload_rate,
            "prompt_len": s.workload_prompt_len, "output_len": s.workload_output_len,
            "skew": s.workload_skew, "drift_seconds": s.workload_drift_seconds,
            "max_requests": s.workload_max_requests}
