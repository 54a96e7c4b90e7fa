"""Continuous-batching scheduler: admission, pinning, budgets, release, the EPLB boundary."""

from __future__ import annotations

import json

import pytest

from xllm_eplb.engine.choices import make_requests
from xllm_eplb.engine.protocol import Plan
from xllm_eplb.engine.scheduler import Request, Scheduler, is_eplb_boundary, is_pure_decode_step
from xllm_eplb.engine.tokenizer import EOS_ID, decode, encode
from xllm_eplb.model.batch import RankBatch, SeqRow


def _req(n_prompt=4, max_tokens=3, **kw):
    return Request(prompt=list(range(1, n_prompt + 1)), max_tokens=max_tokens, **kw)


def _sample_all(s: Scheduler, batches, tok=7):
    return s.update({r.req_id: tok for b in batches for r in b.rows})


def test_admission_spreads_requests_over_ranks_and_pins_them():
    s = Scheduler(dp_size=3, max_batch_size=4, max_prefill_tokens=64)
    reqs = [s.submit(_req()) for _ in range(5)]
    s.pull()
    b = s.schedule()
    assert [len(x.rows) for x in b] == [2, 2, 1]
    assert all(r.is_prefill and r.start_pos == 0 for x in b for r in x.rows)
    ranks = {r.req_id: r.dp_rank for r in reqs}
    _sample_all(s, b)
    b2 = s.schedule()
    for k, batch in enumerate(b2):
        for row in batch.rows:
            assert not row.is_prefill and ranks[row.req_id] == k
            assert row.token_ids == [7] and row.start_pos == 4   # prompt 4 tokens in the KV


def test_budgets_limit_admission_fifo():
    s = Scheduler(dp_size=2, max_batch_size=1, max_prefill_tokens=10)
    for _ in range(3):
        s.submit(_req(n_prompt=4))
    s.pull()
    b = s.schedule()
    assert [len(x.rows) for x in b] == [1, 1] and len(s.waiting) == 1
    s2 = Scheduler(dp_size=1, max_batch_size=8, max_prefill_tokens=10)
    for _ in range(3):
        s2.submit(_req(n_prompt=4))
    s2.pull()
    assert len(s2.schedule()[0].rows) == 2                  # 4 + 4 <= 10 < 4 + 4 + 4


def test_waiting_for_slot_counts_only_requests_blocked_by_full_batches():
    s = Scheduler(dp_size=2, max_batch_size=1, max_prefill_tokens=64)
    for _ in range(5):
        s.submit(_req())
    s.pull()
    s.schedule()
    assert s.waiting_for_slot == 3                  # both ranks run their one row
    s2 = Scheduler(dp_size=1, max_batch_size=8, max_prefill_tokens=4)
    for _ in range(3):
        s2.submit(_req(n_prompt=4))
    s2.pull()
    s2.schedule()
    assert len(s2.waiting) == 2 and s2.waiting_for_slot == 0   # the prefill budget, not a slot


def test_finish_by_length_and_eos_then_release_on_next_step():
    s = Scheduler(dp_size=2, max_batch_size=4, max_prefill_tokens=64)
    a = s.submit(_req(max_tokens=2))
    e = s.submit(_req(max_tokens=9, eos_ids=frozenset({EOS_ID})))
    s.pull()
    b = s.schedule()
    assert _sample_all(s, b) == []
    b = s.schedule()
    done = s.update({a.req_id: 5, e.req_id: EOS_ID})
    assert {r.req_id for r in done} == {a.req_id, e.req_id}
    assert a.finish_reason == "length" and a.output == [7, 5] and a.done.is_set()
    assert e.finish_reason == "stop"
    nxt = s.schedule()
    assert sorted(x for bb in nxt for x in bb.release) == sorted([a.req_id, e.req_id])
    assert all(bb.is_empty for bb in nxt) and not s.has_work


def test_max_tokens_zero_finishes_at_submit_and_ignore_eos():
    s = Scheduler(dp_size=1, max_batch_size=4, max_prefill_tokens=64)
    r = s.submit(_req(max_tokens=0))
    assert r.done.is_set() and r.output == [] and not s.has_work
    k = s.submit(_req(max_tokens=2, stop_at_eos=False, eos_ids=frozenset({EOS_ID})))
    s.pull()
    s.update({row.req_id: EOS_ID for row in s.schedule()[0].rows})
    assert not k.done.is_set()


def test_fail_all_finishes_waiting_and_running():
    s = Scheduler(dp_size=1, max_batch_size=1, max_prefill_tokens=64)
    a, b = s.submit(_req()), s.submit(_req())
    s.pull()
    s.schedule()
    s.fail_all("stopping")
    assert a.finish_reason == b.finish_reason == "error" and a.error == "stopping"


def test_eplb_boundary_rule():
    pre, dec = SeqRow(1, [1, 2], 0, True), SeqRow(2, [3], 5, False)
    empty = RankBatch()
    assert is_eplb_boundary([RankBatch([dec]), empty], warmup=False)
    assert not is_eplb_boundary([RankBatch([dec]), empty], warmup=True)
    assert not is_eplb_boundary([empty, empty], warmup=False)
    assert not is_eplb_boundary([RankBatch([dec]), RankBatch([pre])], warmup=False)
    assert not is_eplb_boundary([RankBatch([dec, pre])], warmup=False)


def test_pure_decode_step_flag():
    """The step flag the engine puts on ForwardInput: warm-up does not change it (the model's
    dispatch mode follows the batches), empty ranks do not veto, one prefill row does."""
    pre, dec = SeqRow(1, [1, 2], 0, True), SeqRow(2, [3], 5, False)
    empty = RankBatch()
    assert is_pure_decode_step([RankBatch([dec]), empty])
    assert not is_pure_decode_step([empty, empty])
    assert not is_pure_decode_step([RankBatch([dec]), RankBatch([pre])])
    assert not is_pure_decode_step([RankBatch([dec, pre]), empty])
    for batches in ([RankBatch([dec]), empty], [empty, empty], [RankBatch([pre])]):
        assert is_eplb_boundary(batches, warmup=False) == is_pure_decode_step(batches)
        assert not is_eplb_boundary(batches, warmup=True)


def test_byte_tokenizer_round_trip():
    ids = encode("héllo")
    assert ids[0] == 256 and decode(ids) == "héllo"
    assert decode([104, 300, EOS_ID, 105]) == "hi"


def test_cancel_retires_waiting_and_running_requests_with_the_reason():
    s = Scheduler(dp_size=1, max_batch_size=1, max_prefill_tokens=64)
    running, waiting = s.submit(_req(max_tokens=9)), s.submit(_req(max_tokens=9))
    s.pull()
    _sample_all(s, s.schedule())
    assert running.req_id in s.running and list(s.waiting) == [waiting]
    s.cancel(running.req_id, "timeout")
    s.cancel(waiting.req_id)
    s.cancel(running.req_id, "client disconnected")    # the first reason given wins
    s.pull()
    assert s.reap_cancelled() == [waiting, running] and not s.running and not s.waiting
    assert (running.finish_reason, running.error) == ("cancelled", "timeout")
    assert (waiting.finish_reason, waiting.error) == ("cancelled", "client gone")
    assert s.has_work                                  # one step sends the KV release
    assert s.schedule()[0].release == [running.req_id] and not s.has_work


def _run_to_end(s: Scheduler, req: Request, tokens: list[int]) -> None:
    """Feed ``tokens`` one step at a time until ``req`` finishes (or they run out)."""
    s.submit(req)
    s.pull()
    for t in tokens:
        s.schedule()
        s.update({req.req_id: t})
        if req.done.is_set():
            return


@pytest.mark.parametrize("gen_eos", [9, [300, 9]])
def test_generation_stops_on_the_checkpoints_eos_not_on_byte_eos(tmp_path, gen_eos):
    """A checkpoint's EOS comes from its generation_config.json (an int or a list) through the
    served tokenizer into every request: id 257 (the byte tokenizer's EOS) is an ordinary token
    of a checkpoint and does not stop it; ``ignore_eos`` runs to max_tokens."""
    from xllm_eplb.engine.tokenizer import load_tokenizer

    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2, "vocab_size": 512}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": gen_eos}))
    tok = load_tokenizer(str(tmp_path))
    assert set(tok.eos_ids) == set(gen_eos if isinstance(gen_eos, list) else [gen_eos])
    stream = [EOS_ID, 2, 41, 9, 8, 7]
    for ignore_eos, want, reason in ((False, stream[:4], "stop"), (True, stream, "length")):
        plan = Plan("completion", [[1, 2, 3]], max_tokens=len(stream), seeds=[0],
                    ignore_eos=ignore_eos)
        (req,) = make_requests(plan, tok, None)
        _run_to_end(Scheduler(1, 4, 64), req, stream)
        assert (req.output, req.finish_reason) == (want, reason)


def test_request_without_eos_ids_never_stops_on_257():
    s = Scheduler(dp_size=1, max_batch_size=4, max_prefill_tokens=64)
    r = _req(max_tokens=3)
    _run_to_end(s, r, [EOS_ID, EOS_ID, EOS_ID])
    assert r.output == [EOS_ID] * 3 and r.finish_reason == "length"


def test_logprobs_ride_the_rows_and_are_formatted_per_choice():
    """A request that asks gets SeqRow.logprobs = its k on every row and one token_logprobs
    entry per output token; one that does not costs nothing. Choice.logprobs: legacy
    completions dict (sampled token added, offsets cumulative across stream slices) and the
    chat content list."""
    from xllm_eplb.engine.choices import Choice
    from xllm_eplb.engine.tokenizer import ByteTokenizer

    s = Scheduler(dp_size=1, max_batch_size=4, max_prefill_tokens=64)
    a, b = s.submit(_req(max_tokens=2, logprobs=1)), s.submit(_req(max_tokens=2))
    s.pull()
    for step, tok in enumerate((ord("h"), ord("i"))):
        rows = s.schedule()[0].rows
        assert {r.req_id: r.logprobs for r in rows} == {a.req_id: 1, b.req_id: -1}
        lp = {a.req_id: (-0.5 - step, [(ord("x"), -0.1), (ord("y"), -0.2)][:1])}
        s.update({a.req_id: tok, b.req_id: tok}, lp)
    assert a.token_logprobs == [(-0.5, [(ord("x"), -0.1)]), (-1.5, [(ord("x"), -0.1)])]
    assert b.token_logprobs == []
    ch = Choice(0, a.prompt, ByteTokenizer(), [], a.token_logprobs)
    ch.add(a.output, "length")
    full = ch.logprobs("completion", 0, 2)
    assert full == {"tokens": ["h", "i"], "token_logprobs": [-0.5, -1.5],
                    "top_logprobs": [{"x": -0.1, "h": -0.5}, {"x": -0.1, "i": -1.5}],
                    "text_offset": [0, 1]}
    assert ch.logprobs("completion", 1, 2)["text_offset"] == [1]
    chat = ch.logprobs("chat", 0, 1)["content"]
    assert chat == [{"token": "h", "logprob": -0.5, "bytes": [104],
                     "top_logprobs": [{"token": "x", "logprob": -0.1, "bytes": [120]}]}]
    assert Choice(0, [], ByteTokenizer(), []).logprobs("chat", 0, 0) is None


def _rows(batches) -> list[list[tuple[int, int, int, bool]]]:
    """Per rank: (req_id, start_pos, tokens, is_prefill) of each row."""
    return [[(r.req_id, r.start_pos, len(r.token_ids), r.is_prefill) for r in b.rows]
            for b in batches]


def test_chunked_prefill_splits_a_long_prompt_over_steps_beside_decode_rows():
    """A prompt over the per-rank budget is prefilled in budget-sized chunks (start_pos = the
    prompt tokens already cached) while the running request keeps its decode row; the tokens
    sampled after non-final chunks are dropped; every chunk step is not a pure-decode step."""
    s = Scheduler(dp_size=1, max_batch_size=4, max_prefill_tokens=10)
    short = s.submit(_req(n_prompt=3, max_tokens=9))
    s.pull()
    _sample_all(s, s.schedule(), tok=5)
    long = s.submit(Request(prompt=list(range(100, 125)), max_tokens=2))
    s.pull()
    seen = []
    for _ in range(3):
        b = s.schedule()
        seen.append(_rows(b)[0])
        assert not is_pure_decode_step(b) and not is_eplb_boundary(b, warmup=False)
        assert b[0].rows[1].token_ids == long.prompt[b[0].rows[1].start_pos:][:10]
        _sample_all(s, b, tok=6)
    a, L = short.req_id, long.req_id
    assert seen == [[(a, 3, 1, False), (L, 0, 10, True)],
                    [(a, 4, 1, False), (L, 10, 10, True)],
                    [(a, 5, 1, False), (L, 20, 5, True)]]
    assert long.output == [6] and short.output == [5, 6, 6, 6]     # one token per real step
    b = s.schedule()
    assert _rows(b)[0] == [(a, 6, 1, False), (L, 25, 1, False)] and is_pure_decode_step(b)


def test_chunked_prefill_shares_the_budget_fifo_and_waits_for_room():
    """Chunks of one rank share its budget in admission order; a waiting request is admitted
    once a rank has room for its first chunk (a whole budget for a long prompt)."""
    s = Scheduler(dp_size=2, max_batch_size=4, max_prefill_tokens=8)
    a = s.submit(Request(prompt=list(range(1, 13)), max_tokens=1))   # 12 tokens: 8 + 4
    b = s.submit(Request(prompt=list(range(1, 21)), max_tokens=1))   # 20 tokens: 8 + 8 + 4
    c = s.submit(_req(n_prompt=3, max_tokens=1))
    s.pull()
    assert _rows(s.schedule()) == [[(a.req_id, 0, 8, True)], [(b.req_id, 0, 8, True)]]
    assert list(s.waiting) == [c]
    s.update({})
    assert _rows(s.schedule()) == [[(a.req_id, 8, 4, True), (c.req_id, 0, 3, True)],
                                   [(b.req_id, 8, 8, True)]]
    assert s.update({a.req_id: 1, b.req_id: 1, c.req_id: 1}) == [a, c]
    assert b.output == [] and not b.done.is_set()
    assert _rows(s.schedule())[1] == [(b.req_id, 16, 4, True)]
    assert s.update({b.req_id: 4}) == [b] and b.output == [4]


def test_cancel_during_chunked_prefill_releases_the_partial_cache():
    s = Scheduler(dp_size=1, max_batch_size=4, max_prefill_tokens=4)
    r = s.submit(Request(prompt=list(range(1, 11)), max_tokens=3))
    s.pull()
    s.update({row.req_id: 9 for row in s.schedule()[0].rows})
    s.cancel(r.req_id)
    s.pull()
    assert r.finish_reason == "cancelled" and r.output == []
    assert s.schedule()[0].release == [r.req_id] and not s.has_work


def test_fail_in_flight_ends_every_request_and_releases_running_kv():
    # a stalled step (engine/failures.py): running and waiting requests end with the error, the
    # step's late tokens are ignored and the next step releases the running ones' KV caches
    s = Scheduler(dp_size=2, max_batch_size=1, max_prefill_tokens=64)
    reqs = [s.submit(_req()) for _ in range(3)]
    s.pull()
    b = s.schedule()                       # two admitted (one per rank), one waiting
    late = s.submit(_req())                # still in the inbox
    failed = s.fail_in_flight("engine stalled: rank 1")
    assert sorted(r.req_id for r in failed) == sorted(r.req_id for r in reqs + [late])
    assert all(r.finish_reason == "error" and r.error == "engine stalled: rank 1"
               for r in reqs + [late])
    assert _sample_all(s, b) == [] and all(r.output == [] for r in reqs)
    assert s.has_work
    nxt = s.schedule()
    assert sorted(x for batch in nxt for x in batch.release) == sorted(
        r.req_id for batch in b for r in batch.rows)
    assert not s.has_work and all(not batch.rows for batch in nxt)
