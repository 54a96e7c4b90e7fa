"""Elastic EP (issue #23 item 7) in one process, on the real model (float64): a void step whose
dead rank's requests are re-prefilled while the survivors' requests keep their KV caches and
recompute it gives every request exactly the tokens, finish reasons and logprobs of an
uninterrupted run. Each DP rank is its own reference ``Decoder`` (its own KV cache) driven by
the real :class:`Scheduler`; the survivors either finished the void step (KV written and
counted at the new positions) or failed inside it (written, not counted); the dead rank is
respawned empty or left out (a shrink, compact ranks). Covered at the void step: a survivor's
request in the middle of a chunked prefill, one admitted in the void step, greedy and seeded
sampling, logprobs, a stop check."""

from __future__ import annotations

import numpy as np
import pytest

from xllm_eplb.config import Config, EplbConfig, ModelConfig
from xllm_eplb.engine.scheduler import Request, Scheduler, is_pure_decode_step
from xllm_eplb.model.decoder import Decoder
from xllm_eplb.model.default_checkpoint import with_default_checkpoint

SMALL = ModelConfig(num_layers=3, num_experts=16, num_experts_per_tok=2, hidden_size=32,
                    moe_intermediate_size=16, intermediate_size=48, dtype="float64",
                    max_position_embeddings=512)


@pytest.fixture(scope="module")
def cfg():
    return with_default_checkpoint(Config(eplb=EplbConfig(ep_size=4), model=SMALL))


def _requests() -> list[Request]:
    rng = np.random.default_rng(7)

    def prompt(n):
        return [int(x) for x in rng.integers(1, 500, size=n)]

    def stop(out):          # a stop "string": any deterministic test of the output so far
        return len(out) >= 5 and out[-1] % 4 == 0

    return [Request(prompt(5), 12, logprobs=0, stop_at_eos=False),
            Request(prompt(6), 12, temperature=0.8, seed=3, logprobs=2, stop_at_eos=False),
            Request(prompt(40), 8, logprobs=1, stop_at_eos=False),     # 3 chunks of <= 16
            Request(prompt(4), 12, temperature=0.9, seed=11, logprobs=0, stop_at_eos=False),
            Request(prompt(7), 14, temperature=1.0, seed=2, logprobs=0, stop_check=stop,
                    stop_at_eos=False),
            Request(prompt(3), 12, temperature=0.7, seed=5, logprobs=0, stop_at_eos=False)]


def _run(cfg, void_at: int = -1, lost: int = 1, mode: str = "respawn",
         counted: bool = True) -> tuple[list[Request], dict]:
    """Serve :func:`_requests` on 2 DP ranks; step ``void_at`` dies with rank ``lost``."""
    s = Scheduler(dp_size=2, max_batch_size=4, max_prefill_tokens=16)
    models = [Decoder.reference(cfg), Decoder.reference(cfg)]
    reqs = _requests()
    pending = list(reqs)
    seen: dict = {}
    for step in range(200):
        if pending and step % 2 == 0:          # arrivals over time, two at a time
            for r in pending[:2]:
                s.submit(r)
            pending = pending[2:]
        s.pull()
        if not s.has_work and not pending:
            break
        batches = s.schedule()
        before = [dict(m.kv.lengths) for m in models]
        outs = [m.forward_step(b, pure_decode=is_pure_decode_step(batches))
                for m, b in zip(models, batches, strict=True) if not b.is_empty]
        for m, b in zip(models, batches, strict=True):      # an empty rank: cuts only
            if b.is_empty:
                m.release(b.release)
                m.truncate(b.truncate)
        if step != void_at:
            sampled, lps = {}, {}
            for o in outs:
                sampled.update(o.sampled)
                lps.update(o.logprobs)
            s.update(sampled, lps)
            continue
        seen = {"rows": [[(r.req_id, r.is_prefill, r.start_pos) for r in b.rows]
                         for b in batches], "running": {r.req_id: r.dp_rank
                                                        for r in s.running.values()}}
        if not counted:        # a survivor failed inside the step: written, never counted
            for m, b in zip(models, before, strict=True):
                for rid in m.kv.lengths:
                    m.kv.lengths[rid] = b.get(rid, 0)
        back = s.void_step(lost)
        seen["back"] = [r.req_id for r in back]
        seen["kept"] = sorted(s.running)
        seen["next"] = None
        if mode == "respawn":
            models[lost] = Decoder.reference(cfg)          # the replacement: empty cache
        else:
            keep = [k for k in range(2) if k != lost]
            s.resize(keep)
            models = [models[k] for k in keep]
    assert all(r.done.is_set() for r in reqs), [r.output for r in reqs]
    return reqs, seen


@pytest.fixture(scope="module")
def reference(cfg):
    reqs, _ = _run(cfg)
    assert reqs[4].finish_reason == "stop" and len(reqs[4].output) < reqs[4].max_tokens
    return reqs


@pytest.mark.parametrize(("void_at", "lost", "mode", "counted"), [
    (2, 1, "respawn", True), (3, 1, "shrink", False), (4, 1, "respawn", False),
    (4, 0, "shrink", True), (7, 0, "shrink", False), (9, 1, "respawn", True)])
def test_survivors_keep_their_kv_and_tokens_stay_those_of_a_fault_free_run(
        cfg, reference, void_at, lost, mode, counted):
    reqs, seen = _run(cfg, void_at, lost, mode, counted)
    on_lost = sorted(rid for rid, k in seen["running"].items() if k == lost)
    assert seen["back"] == on_lost and seen["kept"] == sorted(
        rid for rid, k in seen["running"].items() if k != lost)
    assert seen["kept"], seen                      # some survivor's request kept its KV
    for got, want in zip(reqs, reference, strict=True):
        assert got.output == want.output, (got.req_id, got.output, want.output)
        assert got.finish_reason == want.finish_reason
        assert len(got.token_logprobs) == len(want.token_logprobs)
        for (g, galt), (w, walt) in zip(got.token_logprobs, want.token_logprobs, strict=True):
            assert abs(g - w) < 1e-9 and [a for a, _ in galt] == [a for a, _ in walt]
    rows = seen["rows"][1 - lost]           # the survivor's rows of the void step
    if void_at == 3:                         # the long prompt in the middle of its chunks
        assert any(p and start > 0 for _, p, start in rows), rows
    if void_at in (2, 4):                    # a request admitted in the void step
        assert any(p and start == 0 for _, p, start in rows), rows


def test_a_truncated_cache_never_holds_more_than_it_had(cfg):
    from xllm_eplb.model.batch import RankBatch, SeqRow

    m = Decoder.reference(cfg)
    m.forward_step(RankBatch([SeqRow(1, [5, 6, 7], 0, True)]))
    m.truncate([[1, 2], [99, 0]])                  # 99: no cache here (skipped)
    assert m.kv.length(1) == 2
    with pytest.raises(ValueError, match="request 1: truncate to 3 positions but the KV "
                                         "cache holds 2"):
        m.truncate([[1, 3]])
