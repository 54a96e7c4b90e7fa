"""``--async_scheduling``: the scheduler plans step n+1 before step n's tokens are known.

Driven against ranks that keep a real per-request context (the KV cache's tokens) and sample
the next token as a function of the whole context (as a greedy model does), the planned-ahead
schedule gives every request the tokens and finish reasons of the synchronous one: through
chunked prefill, EOS and length stops, arrivals between steps, a cancel, and an elastic void of
both the step in flight and the one planned ahead. Every row's position is checked against the
rank's context, so a row planned at the wrong place fails at once.
"""

from __future__ import annotations

import pytest

from xllm_eplb.engine.scheduler import Request, Scheduler
from xllm_eplb.model.batch import PENDING_TOKEN, RankBatch, SeqRow

VOCAB = 40
EOS = 3


class ContextRank:
    """One DP rank: each request's context (what its KV cache holds) and its last token."""

    def __init__(self):
        self.ctx: dict[int, list[int]] = {}
        self.last: dict[int, int] = {}

    def step(self, batch: RankBatch) -> dict[int, int]:
        batch = RankBatch.from_dict(batch.to_dict())        # the worker's own decoded copy
        for rid in batch.release:
            self.ctx.pop(rid, None)
            self.last.pop(rid, None)
        for rid, n in batch.truncate:
            if rid in self.ctx:
                del self.ctx[rid][n:]
        batch.fill_pending(self.last)
        out = {}
        for row in batch.rows:
            ctx = self.ctx.setdefault(row.req_id, [])
            assert len(ctx) == row.start_pos, (row, len(ctx))
            ctx.extend(row.token_ids)
            out[row.req_id] = _next_token(ctx)
        self.last.update(out)
        return out


def _next_token(ctx: list[int]) -> int:
    """A deterministic 'greedy model': the next token is a function of the whole context."""
    h = 0
    for t in ctx:
        h = (h * 1_000_003 + t + 1) % 2_147_483_647
    return h % VOCAB


def _requests() -> list[tuple[int, Request]]:
    """(arrival step, request): short and long (chunked) prompts, EOS stops, length stops."""
    out = []
    for i in range(14):
        prompt = [(7 * i + j) % VOCAB for j in range(3 + (i * 5) % 23)]
        out.append((i // 3, Request(prompt=prompt, max_tokens=2 + (i * 3) % 9,
                                    eos_ids=frozenset({EOS}))))
    return out


def _run(ahead: bool, *, void_at: int = -1, cancel_at: int = -1) -> tuple[list, int]:
    """Serve :func:`_requests` on 3 ranks; returns ([(output, reason)] in arrival order, steps
    planned ahead). ``void_at``: that step dies with rank 1 (elastic: rank 1 comes back empty).
    ``cancel_at``: request 4 is cancelled just before that step's outputs are committed."""
    reqs = _requests()
    s = Scheduler(dp_size=3, max_batch_size=4, max_prefill_tokens=16)
    ranks = [ContextRank() for _ in range(3)]
    in_flight, step, planned = None, 0, 0
    while step < 200:
        for at, r in reqs:
            if at == step:
                s.submit(r)
        if in_flight is None:
            s.pull()
            if not s.has_work:
                if all(r.done.is_set() for _, r in reqs):
                    break
                step += 1
                continue
            in_flight = s.schedule()
        nxt = None
        if ahead:
            s.pull()
            if s.can_plan_ahead():
                nxt = s.schedule(ahead=True)
                planned += 1
        outs = [rank.step(b) for rank, b in zip(ranks, in_flight, strict=True)]
        if step == void_at:
            s.void_step(1)
            ranks[1] = ContextRank()
            in_flight, step = None, step + 1
            continue
        if step == cancel_at:
            s.cancel(reqs[4][1].req_id)
            s.pull()
        in_flight = nxt
        sampled = {rid: t for o in outs for rid, t in o.items() if rid in s.running}
        s.update(sampled)
        step += 1
    assert all(r.done.is_set() for _, r in reqs), "requests left unfinished"
    return [(r.output, r.finish_reason) for _, r in reqs], planned


def test_planned_ahead_gives_the_tokens_of_the_synchronous_schedule():
    want, _ = _run(ahead=False)
    got, planned = _run(ahead=True)
    assert got == want
    assert planned > 10
    reasons = {reason for _, reason in want}
    assert reasons == {"stop", "length"}, reasons     # both stops exercised


@pytest.mark.parametrize("void_at", [2, 5, 9])
def test_a_void_step_with_a_step_planned_ahead_rolls_both_back(void_at):
    want, _ = _run(ahead=False)
    got, _ = _run(ahead=True, void_at=void_at)
    assert got == want


def test_a_cancel_between_plan_and_commit_ends_only_that_request():
    want, _ = _run(ahead=False)
    got, _ = _run(ahead=True, cancel_at=4)
    assert got[4][1] == "cancelled"
    assert [g for k, g in enumerate(got) if k != 4] == [w for k, w in enumerate(want) if k != 4]


def _running(s: Scheduler, n_prompt: int, max_tokens: int) -> Request:
    r = s.submit(Request(prompt=list(range(1, n_prompt + 1)), max_tokens=max_tokens))
    s.pull()
    return r


def test_a_planned_ahead_row_waits_for_the_token_of_the_step_in_flight():
    s = Scheduler(dp_size=1, max_batch_size=4, max_prefill_tokens=64)
    r = _running(s, 4, max_tokens=5)
    first = s.schedule()
    ahead = s.schedule(ahead=True)
    (row,) = ahead[0].rows
    assert row.token_ids == [PENDING_TOKEN] and row.start_pos == 4 and not row.is_prefill
    s.update({r.req_id: 9})
    assert r.output == [9] and first[0].rows[0].is_prefill
    s.update({r.req_id: 11})
    assert r.output == [9, 11]


def test_a_request_its_length_ends_in_flight_gets_no_row_ahead():
    s = Scheduler(dp_size=1, max_batch_size=4, max_prefill_tokens=64)
    r = _running(s, 4, max_tokens=1)
    s.schedule()
    assert not s.can_plan_ahead()
    assert s.schedule(ahead=True)[0].rows == []
    assert s.update({r.req_id: 5}) == [r] and r.finish_reason == "length"


def test_the_token_after_a_chunk_is_dropped_even_when_the_last_chunk_is_planned_ahead():
    s = Scheduler(dp_size=1, max_batch_size=4, max_prefill_tokens=8)
    r = _running(s, 12, max_tokens=4)
    s.schedule()                           # chunk 0-8: its token is not an output
    (row,) = s.schedule(ahead=True)[0].rows
    assert row.is_prefill and row.start_pos == 8 and not r.prefilling
    s.update({r.req_id: 30})
    assert r.output == []
    s.update({r.req_id: 31})
    assert r.output == [31]


def test_a_pending_row_without_a_last_token_is_a_clear_error():
    b = RankBatch([SeqRow(7, [PENDING_TOKEN], 12, False)])
    with pytest.raises(ValueError, match=r"request 7: decode row at position 12 .* sampled none"):
        b.fill_pending({})
    b.fill_pending({7: 21})
    assert b.rows[0].token_ids == [21]
