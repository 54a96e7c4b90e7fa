"""What one forward step of a rank's model returns, and how it picks the next tokens.

- :class:`StepResult`: sampled tokens, slot counters (``eplb.counters`` prefix sums), optional
  logits and routing, timings;
- :func:`graph_bucket`: the graph-mode decode batch size a step pads to;
- :func:`sample`: greedy or seeded (``(seed, position)`` only, so batch-independent) sampling
  with top-k / top-p truncation;
- :func:`token_logprobs`: the sampled token's log-probability and the top alternatives;
- :class:`Laps`: a step's consecutive phases into a ``StepTimer``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from xllm_eplb.model import dispatch as dsp


@dataclass
class StepResult:
    """sampled: req_id -> next token; counters: int64 [L_moe, S] prefix sums (reference:
    [L_moe, E]); logits: [rows, V] float64 at each row's last position (when asked for);
    warmup: the forward was a warm-up (the engine ignores its counters); mode: dispatch path;
    timings: seconds (total_s, moe_s, comm_wait_s, counter_s: float wall clock; expert_cpu_s:
    list [L_moe] of this rank's local expert compute thread CPU time per MoE layer, from
    ``FusedMoE.compute``, reference: ``LogicalMoE.forward``); routed (when asked for): per MoE
    layer the logical top-k ids int64 [T, k] of every row incl. padding, and counted bool [T];
    logprobs: req_id -> :func:`token_logprobs` for the rows that asked (``SeqRow.logprobs``)."""

    sampled: dict[int, int]
    counters: np.ndarray
    logits: torch.Tensor | None = None
    warmup: bool = False
    mode: str = dsp.PLAIN
    timings: dict = field(default_factory=dict)
    routed: list | None = None
    counted: np.ndarray | None = None
    logprobs: dict[int, tuple[float, list[tuple[int, float]]]] = field(default_factory=dict)


class Laps:
    """A step's consecutive phases, each added to ``timer`` (an ``obs.step_timer.StepTimer``):
    ``lap(phase)`` adds the seconds since the previous lap (or since creation) to ``phase``;
    ``inner``/``inner_s``: ``inner_s`` of them, measured inside, go to ``inner`` instead. A
    disabled timer (``step_timer.NULL``) costs one attribute test per lap: no clock read."""

    def __init__(self, timer):
        self.timer, self.on = timer, timer.enabled
        self.t = time.perf_counter() if self.on else 0.0

    def __call__(self, phase: str, inner: str | None = None, inner_s: float = 0.0) -> None:
        if not self.on:
            return
        t = time.perf_counter()
        if inner is not None:
            self.timer.add(inner, inner_s)
        self.timer.add(phase, t - self.t - inner_s)
        self.t = t


def graph_bucket(n: int, max_batch: int) -> int:
    """Decode graph bucket for n rows: next power of two >= max(n, 1), capped at max_batch."""
    b = 1
    while b < max(n, 1):
        b *= 2
    return max(n, min(b, max_batch))


def sample(logits: torch.Tensor, temperature: float, seed: int, position: int,
           top_p: float = 1.0, top_k: int = 0) -> int:
    """Greedy when temperature == 0; else a draw seeded by (seed, position) only, so a request
    gets the same token whatever batch it shares. logits [V]. ``top_k`` > 0 keeps the k most
    likely tokens; ``top_p`` < 1 keeps the smallest most-likely set whose probability reaches
    ``top_p`` (nucleus; always at least one token)."""
    lg = logits.to(torch.float64)
    if temperature <= 0:
        return int(torch.argmax(lg))
    g = torch.Generator()
    g.manual_seed((int(seed) * 1_000_033 + int(position) * 7_919 + 1) % (1 << 62))
    p = torch.softmax(lg / temperature, dim=-1)
    if top_k > 0 or top_p < 1.0:
        p = _truncate(p, top_p, top_k)
    return int(torch.multinomial(p, 1, generator=g))


def _truncate(p: torch.Tensor, top_p: float, top_k: int) -> torch.Tensor:
    """Probabilities p [V] with everything outside top-k / the top-p nucleus set to 0."""
    sp, idx = torch.sort(p, descending=True)
    keep = torch.ones_like(sp, dtype=torch.bool)
    if top_k > 0:
        keep[top_k:] = False
    if top_p < 1.0:
        before = torch.cumsum(sp, dim=0) - sp          # mass of the more likely tokens
        keep &= before < top_p
    keep[0] = True
    out = torch.zeros_like(p)
    out[idx[keep]] = sp[keep]
    return out


def token_logprobs(logits: torch.Tensor, token: int, k: int
                   ) -> tuple[float, list[tuple[int, float]]]:
    """``(logprob of token, [(id, logprob)] of the k most likely tokens, most likely first)``.

    Log-probabilities are ``log_softmax`` of the raw logits [V] in float64: the model's own
    distribution, before temperature and top-k / top-p (what OpenAI reports). Ties in the top k
    are ordered by ``torch.topk``; k is clamped to [0, V]."""
    lp = torch.log_softmax(logits.to(torch.float64), dim=-1)
    k = max(0, min(int(k), lp.shape[0]))
    vals, ids = torch.topk(lp, k) if k else (lp[:0], lp[:0].long())
    top = [(int(i), float(v)) for i, v in zip(ids.tolist(), vals.tolist(), strict=True)]
    return float(lp[int(token)]), top
