"""What one worker (one DP rank) is asked to compute in one forward step."""

from __future__ import annotations

from dataclasses import dataclass, field

#: a decode row's token when the engine planned the step before the previous one's outputs
#: arrived (``--async_scheduling``): the worker puts in the token it sampled for that request
#: in the previous step (:meth:`RankBatch.fill_pending`)
PENDING_TOKEN = -1


@dataclass
class SeqRow:
    """One request's share of a step.

    Prefill rows carry the whole prompt in ``token_ids``; decode rows carry exactly one token
    (the last sampled one, or :data:`PENDING_TOKEN`: the one this rank sampled for the request
    in the step before). ``start_pos`` is the KV-cache length before this step.
    ``temperature == 0`` means greedy; otherwise sampling uses ``seed`` and the position, so
    the same request gives the same tokens whatever batch it shares, restricted to the ``top_k``
    most likely tokens (0 = all) and to the smallest set whose probability reaches ``top_p``.
    ``logprobs`` >= 0: the worker also returns the sampled token's log-probability and the
    ``logprobs`` most likely alternatives (``ForwardOutput.logprobs``); -1 = none (no cost).
    """

    req_id: int
    token_ids: list[int]
    start_pos: int
    is_prefill: bool
    temperature: float = 0.0
    seed: int = 0
    top_p: float = 1.0
    top_k: int = 0
    logprobs: int = -1

    def fill_pending(self, last: dict[int, int]) -> None:
        """This :data:`PENDING_TOKEN` decode row takes its token from ``last`` (req_id -> the
        token this rank sampled for it in the previous step); one without it is an error (the
        engine planned ahead of a step this rank did not run). :meth:`RankBatch.fill_pending`
        calls it for the pending rows only."""
        tok = last.get(self.req_id)
        if tok is None:
            raise ValueError(f"request {self.req_id}: decode row at position "
                             f"{self.start_pos} waits for this rank's last sampled "
                             f"token, but this rank sampled none for it")
        self.token_ids = [tok]

    def to_dict(self) -> dict:
        return {"r": self.req_id, "t": list(self.token_ids), "p": self.start_pos,
                "f": self.is_prefill, "T": self.temperature, "s": self.seed,
                "tp": self.top_p, "tk": self.top_k, "lp": self.logprobs}

    @classmethod
    def from_dict(cls, d: dict) -> "SeqRow":
        return cls(d["r"], list(d["t"]), d["p"], d["f"], d["T"], d["s"], d.get("tp", 1.0),
                   d.get("tk", 0), d["lp"])


@dataclass
class RankBatch:
    """The rows of one DP rank for one step; ``release`` lists requests whose KV cache to free.
    ``truncate`` lists ``[req_id, length]``: cut that request's KV cache back to ``length``
    positions before the step (``--elastic_ep``: a survivor's request recomputes a void step
    that may have written, and even counted, that step's positions; applied after ``release``;
    a request without a cache is skipped).

    An empty ``rows`` list is legal: the rank still takes part in every MoE all-to-all.
    """

    rows: list[SeqRow] = field(default_factory=list)
    release: list[int] = field(default_factory=list)
    truncate: list[list[int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.rows

    @property
    def is_pure_decode(self) -> bool:
        return bool(self.rows) and not any(r.is_prefill for r in self.rows)

    def fill_pending(self, last: dict[int, int]) -> None:
        """Put each :data:`PENDING_TOKEN` decode row's token in from ``last`` (req_id -> the
        token this rank sampled for it in the previous step); a row without one is an error
        (the engine planned ahead of a step this rank did not run): :meth:`SeqRow.fill_pending`
        per pending row."""
        for row in self.rows:
            if row.token_ids and row.token_ids[0] == PENDING_TOKEN:
                row.fill_pending(last)

    def to_dict(self) -> dict:
        d = {"rows": [r.to_dict() for r in self.rows], "release": list(self.release)}
        if self.truncate:          # only after an elastic recovery: no bytes otherwise
            d["trunc"] = [[int(r), int(n)] for r, n in self.truncate]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "RankBatch":
        return cls([SeqRow.from_dict(r) for r in d["rows"]], list(d["release"]),
                   [[int(r), int(n)] for r, n in d.get("trunc", [])])
