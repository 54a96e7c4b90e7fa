"""Elastic EP pieces in one process (issue #23): the redundancy rule at validation, the
launcher-hosted store's placement keys, the scheduler's void step (the dead rank's requests
re-prefilled from prompt + output, the survivors' kept with their KV caches cut back; on the real
model: tests/test_elastic_keepkv.py) and the re-prefill's tokens being those of an uninterrupted
run; for a shrink, the scheduler's and step watch's smaller rank set and the dead reader retired
from the input ring; the accounting of elasticity's steady-state CPU."""

from __future__ import annotations

import numpy as np
import pytest

from xllm_eplb.engine.scheduler import Request, Scheduler
from xllm_eplb.errors import ConfigError
from xllm_eplb.flags import load_config
from xllm_eplb.testing.dist import free_port


def _cfg(*flags):
    return load_config(["--ep-size", "4", "--num_experts", "8", "--num_experts_per_tok", "2",
                        *flags])[0]


def test_elastic_is_on_by_default_and_refuses_only_what_no_mode_serves():
    from xllm_eplb.elastic.supervisor import replacement_mode

    cfg = _cfg("--redundant_experts_num=0")                 # 3 x 2 < 8: no rejoin, respawn
    assert cfg.runtime.elastic_ep
    mode, why = replacement_mode(cfg, 4, 0)
    assert mode == "respawn" and "--redundant_experts_num >= 1" in why, why
    assert replacement_mode(_cfg("--redundant_experts_num=1"), 4, 0)[0] == "rejoin"
    assert replacement_mode(cfg, 4, 3)[0] == "shrink"      # restarts used up
    one = load_config(["--ep-size", "1", "--num_experts", "8", "--num_experts_per_tok", "2"])[0]
    assert replacement_mode(one, 1, 0) == ("respawn",
                                           "--ep_size=1: no other rank serves meanwhile")
    with pytest.raises(ConfigError) as e:                   # shrink only: the rule must hold
        _cfg("--elastic_restart=false", "--redundant_experts_num=0")
    msg = str(e.value)
    assert "--redundant_experts_num=0" in msg and "(ep_size-1) x slots_per_rank" in msg
    assert "needs --redundant_experts_num >= 1" in msg and "--elastic_ep=false" in msg
    assert not _cfg("--elastic_ep=false", "--elastic_restart=false").runtime.elastic_ep
    # across nodes: respawn in place (tests/test_multinode.py runs it)
    two = ("--redundant_experts_num=1", "--nnodes=2", "--master_port=1")
    assert replacement_mode(_cfg(*two), 4, 0)[0] == "respawn"
    with pytest.raises(ConfigError, match=r"--elastic_restart=false: must be true: with "
                       r"--elastic_ep and --nnodes=2"):
        _cfg(*two, "--elastic_restart=false")


def test_store_carries_the_placement_of_a_generation():
    from xllm_eplb.elastic.protocol import get_placement, put_placement
    from xllm_eplb.ipc.store import host_store, store_client

    port = free_port()
    host = host_store("127.0.0.1", port, 10)
    client = store_client("127.0.0.1", port, 10)
    table = np.arange(24, dtype=np.int64).reshape(2, 12) % 8
    put_placement(client, 3, table)
    assert np.array_equal(get_placement(store_client("127.0.0.1", port, 10), 3), table)
    del client, host


def test_void_step_requeues_the_dead_ranks_requests_and_keeps_the_others():
    s = Scheduler(dp_size=2, max_batch_size=4, max_prefill_tokens=8)
    a = s.submit(Request(prompt=[1, 2, 3], max_tokens=9))
    b = s.submit(Request(prompt=[4, 5], max_tokens=9))
    done = s.submit(Request(prompt=[9], max_tokens=1))
    s.pull()
    batches = s.schedule()
    assert (a.dp_rank, b.dp_rank, done.dp_rank) == (0, 1, 0)
    s.update({r.req_id: 7 for x in batches for r in x.rows})       # `done` finishes
    s.update({r.req_id: 8 for x in s.schedule() for r in x.rows})
    late = s.submit(Request(prompt=[6], max_tokens=2))
    s.pull()
    s.schedule()                                # the step that dies with rank 1
    assert late.dp_rank == 0 and late.prefilled == 1     # admitted in it (least-loaded tie)
    back = s.void_step(1)
    assert back == [b] and list(s.waiting) == [b] and b.output == [7, 8]
    assert sorted(s.running) == [a.req_id, late.req_id] and late.prefilled == 0
    assert a.output == [7, 8] and not a.done.is_set()
    nxt = s.schedule()
    rows = {r.req_id: (k, r) for k, x in enumerate(nxt) for r in x.rows}
    # a and late keep rank 0 and their KV caches: the void step's rows again, each cache cut
    # back to its row's start first (the void step may have written positions 4 and 0)
    assert rows[a.req_id][0] == 0 and rows[a.req_id][1].token_ids == [8]
    assert rows[a.req_id][1].start_pos == 4 and rows[late.req_id][1].token_ids == [6]
    assert nxt[0].truncate == [[a.req_id, 4], [late.req_id, 0]] and nxt[0].release == []
    # b: re-prefilled from prompt + output on the least-loaded rank
    assert rows[b.req_id][0] == 1 and rows[b.req_id][1].token_ids == [4, 5, 7, 8]
    assert rows[b.req_id][1].start_pos == 0 and rows[b.req_id][1].is_prefill
    assert nxt[1].release == [b.req_id] and nxt[1].truncate == []
    # nothing of the void step is committed twice: the recomputed step commits once
    s.update({a.req_id: 9, late.req_id: 3})
    assert a.output == [7, 8, 9] and late.output == [3]
    # a prefill chunk of a survivor's request is rolled back and sent again (8 + 3 tokens)
    long = Request(prompt=list(range(1, 12)), max_tokens=20)
    s2 = Scheduler(dp_size=2, max_batch_size=4, max_prefill_tokens=8)
    s2.submit(long)
    s2.pull()
    s2.schedule()
    s2.update({long.req_id: 99})                # the partial chunk's token: dropped
    s2.schedule()                               # chunk 2 (8..11) dies with rank 1
    assert s2.void_step(1) == [] and long.prefilled == 8 and long.output == []
    nxt = s2.schedule()
    assert [(r.start_pos, len(r.token_ids)) for r in nxt[0].rows] == [(8, 3)]
    assert nxt[0].truncate == [[long.req_id, 8]]
    s2.update({long.req_id: 5})
    assert long.output == [5]


def test_void_step_sends_the_void_steps_releases_again():
    """A survivor may fail before it applied the void step's releases (a cancelled or finished
    request's KV cache): they ride its next batch too; the dead rank's are not re-sent."""
    s = Scheduler(dp_size=2, max_batch_size=4, max_prefill_tokens=8)
    reqs = [s.submit(Request(prompt=[1, 2], max_tokens=n)) for n in (1, 1, 5, 5)]
    s.pull()
    s.update({r.req_id: 7 for x in s.schedule() for r in x.rows})      # 0 and 1 finish
    void = s.schedule()
    assert void[0].release == [reqs[0].req_id] and void[1].release == [reqs[1].req_id]
    assert s.void_step(1) == [reqs[3]]
    nxt = s.schedule()
    assert nxt[0].release == [reqs[0].req_id]
    assert nxt[1].release == [reqs[3].req_id]            # the requeued one only
    s.update({r.req_id: 8 for x in nxt for r in x.rows})     # committed: sent once more only
    assert [(x.release, x.truncate) for x in s.schedule()] == [([], []), ([], [])]


@pytest.mark.slow
def test_reprefill_continues_with_the_tokens_of_an_uninterrupted_run():
    """float64, greedy and seeded sampling: prefill(prompt) + decode == prefill(prompt +
    first outputs) + decode, token for token (the single-process model)."""
    import tempfile
    from pathlib import Path

    from xllm_eplb.model.batch import RankBatch, SeqRow
    from xllm_eplb.model.checkpoint import make_checkpoint
    from xllm_eplb.model.decoder import Decoder
    from xllm_eplb.model.resolve import resolve_config

    with tempfile.TemporaryDirectory() as d:
        ckpt = make_checkpoint("deepseek_v3", Path(d) / "c", num_experts=8, top_k=2)
        cfg = resolve_config(load_config(["--ep-size", "2", "--model", str(ckpt),
                                          "--dtype=float64"])[0])
        # --model: the shrink-only rule is checked on the checkpoint's expert count (8 here,
        # not 64); with restarts on (the default) a death is respawned and nothing is refused
        from xllm_eplb.model.validate import validate_model_config

        bad = resolve_config(load_config(["--ep-size", "4", "--model", str(ckpt),
                                          "--elastic_ep=true", "--elastic_restart=false",
                                          "--redundant_experts_num=0"])[0])
        with pytest.raises(ConfigError, match=r"config.json: routed experts 8: "
                                              r"--redundant_experts_num=0: .* >= 1"):
            validate_model_config(bad)
        validate_model_config(resolve_config(load_config(["--ep-size", "4", "--model", str(ckpt),
                                                          "--redundant_experts_num=0"])[0]))
        m = Decoder.reference(cfg)
        for temp, seed in ((0.0, 0), (0.9, 5)):
            full = _generate(m, [3, 9, 27, 81], 12, temp, seed, RankBatch, SeqRow, rid=1)
            head = full[:5]
            rest = _generate(m, [3, 9, 27, 81] + head, 7, temp, seed, RankBatch, SeqRow,
                             rid=2)
            assert head + rest == full, (temp, full, head + rest)


def _generate(m, prompt, n, temp, seed, RankBatch, SeqRow, rid):
    out = []
    res = m.forward_step(RankBatch([SeqRow(rid, list(prompt), 0, True, temp, seed)]))
    out.append(res.sampled[rid])
    while len(out) < n:
        pos = len(prompt) + len(out) - 1
        res = m.forward_step(RankBatch([SeqRow(rid, [out[-1]], pos, False, temp, seed)]))
        out.append(res.sampled[rid])
    m.release([rid])
    return out


def test_abort_round_drops_the_round_unless_an_activation_is_awaited():
    from xllm_eplb.eplb.manager_state import LayerPipeline

    p = LayerPipeline(3, 2)
    p.start_round(np.zeros((3, 4), dtype=np.int64), np.array([True, False, True]))
    t = p.command(0.0).prepare_token                 # layer 0 preparing
    assert p.in_progress and p.abort_round() and not p.in_progress
    assert p.command(1.0).prepare_layer_id == -1     # nothing left of that round
    p.start_round(np.zeros((3, 4), dtype=np.int64), np.array([True, False, False]))
    t = p.command(2.0).prepare_token
    p.observe_prepared([t, t], 2.5)
    assert p.command(3.0).update_layer_id == 0       # activation sent: awaited
    assert not p.abort_round() and p.in_progress     # settle the activation first
    p.drop_awaited()                                 # no rank switched it: not deployed
    assert p.abort_round() and not p.in_progress and p.layers_completed == 0


def test_shrink_resizes_the_scheduler_and_the_step_watch():
    from xllm_eplb.engine.health import StepWatch

    s = Scheduler(dp_size=3, max_batch_size=4, max_prefill_tokens=8)
    reqs = [s.submit(Request(prompt=[1, 2, 3], max_tokens=9)) for _ in range(3)]
    s.pull()
    s.update({r.req_id: 7 for x in s.schedule() for r in x.rows})
    with pytest.raises(RuntimeError, match=r"still running on a rank not in keep=\[0, 2\]"):
        s.resize([0, 2])
    assert [r.dp_rank for r in reqs] == [0, 1, 2]
    s.schedule()                                # the step that dies with rank 1
    assert s.void_step(1) == [reqs[1]]
    s.resize([0, 2])                           # rank 1 died: old 0 -> 0, old 2 -> 1
    nxt = s.schedule()                         # reqs[1] re-prefilled on rank 0 (a tie)
    assert len(nxt) == 2 and [r.dp_rank for r in reqs] == [0, 0, 1]
    assert [x.release for x in nxt] == [[], []]      # the dead rank's releases went with it
    cuts = {rid: k for k, x in enumerate(nxt) for rid, _ in x.truncate}
    assert cuts == {reqs[0].req_id: 0, reqs[2].req_id: 1}     # kept: caches follow the ranks
    rows = {r.req_id: (k, r.is_prefill) for k, x in enumerate(nxt) for r in x.rows}
    assert rows == {reqs[0].req_id: (0, False), reqs[2].req_id: (1, False),
                    reqs[1].req_id: (0, True)}           # re-prefilled on a survivor
    s.grow()                                   # a rejoin: one more empty rank
    assert len(s.schedule()) == 3
    w = StepWatch(4, 10.0)
    w.resize([0, 1, 3])
    w.begin()
    w.answer(2)
    assert w.D == 3 and w.readers == [0, 1, 3] and w.answered == [False, False, True]


def test_a_retired_reader_never_holds_the_producer_back(run_id):
    from xllm_eplb.ipc.messages import ForwardInput
    from xllm_eplb.ipc.ring import InputRing

    with InputRing.create(run_id, 2, slots=2, frame_bytes=1024) as eng, \
            InputRing.attach(run_id, 0) as w0:
        eng.put(ForwardInput(0, []), timeout=1)      # reader 1 (dead) never reads it
        eng.retire_reader(1)
        for step in range(1, 6):                     # more than the slots: never blocks
            eng.put(ForwardInput(step, []), timeout=1)
            assert w0.get(timeout=1).step in (step - 1, step)


def test_elastic_cpu_is_accounted_only_with_elasticity():
    """The steady-state cost of ``--elastic_ep`` (docs/benchmarks.md): the silent-rank check
    between output slices reports its CPU only with elasticity (its recovery object); the telemetry sums
    it (``/eplb/status`` ``critical_path``), idle wakes apart."""
    import numpy as np

    from xllm_eplb.elastic.notices import NoticeBox
    from xllm_eplb.elastic.recovery import EngineRecovery
    from xllm_eplb.engine.failures import FailureWatch
    from xllm_eplb.engine.health import StepWatch
    from xllm_eplb.engine.telemetry import Telemetry
    from xllm_eplb.obs.metrics import EngineMetrics

    class Port:                  # what EngineRecovery reads at construction
        ep_size, active_placement = 2, np.zeros((1, 4), dtype=np.int64)

    m = EngineMetrics(2, 1)
    tele = Telemetry(m, 1, 2)
    fw = FailureWatch(None, StepWatch(2, 100.0), 100.0)
    fw.between_slices(1, None, None)                     # elasticity off: nothing accounted
    assert tele.critical_path_summary()["elastic_engine_s"] == 0.0
    rec = EngineRecovery(Port(), NoticeBox(), None, num_experts=2, slots=2, num_layers=1,
                         silence_s=5.0, join_timeout_s=5.0, metrics=m, on_cpu=tele.on_elastic,
                         kill=lambda w: None)
    for _ in range(3):
        fw.between_slices(1, None, None)
        rec.between_slices(1, 0.1, lambda: [])
    tele.on_elastic(0.001, idle=True)
    tele.on_elastic(0.002, idle=True)
    cp = tele.critical_path_summary()
    assert 0.0 < cp["elastic_engine_s"] < 0.1
    assert cp["elastic_idle_s"] == pytest.approx(0.003) and cp["elastic_idle_wakes"] == 2


def test_a_silent_rank_shows_in_health_within_a_second_and_the_fence_clock_starts_at_it(
        run_id):
    # issue 41 item 5: /health said 200 "serving" for the --elastic_silence_seconds of a
    # freeze, then "phase":"fence","phase_seconds":14 less than a second into the fence
    import time
    from types import SimpleNamespace

    from xllm_eplb.elastic.recovery import EngineRecovery
    from xllm_eplb.elastic.recovery import Phase as P
    from xllm_eplb.engine.health import SUSPECT_SECONDS, StepWatch
    from xllm_eplb.ipc.messages import ForwardInput
    from xllm_eplb.ipc.ring import InputRing

    with InputRing.create(run_id, 2, slots=2, frame_bytes=1024) as eng, \
            InputRing.attach(run_id, 0) as w0, InputRing.attach(run_id, 1):
        w = StepWatch(2, 10.0)
        eng.put(ForwardInput(1, []), timeout=1)
        w.begin()
        assert w0.get(timeout=1).step == 1         # rank 0 read the step; rank 1 is frozen
        assert w.suspect(eng) is None               # a step under a second: nothing to say
        w.started -= SUSPECT_SECONDS + 0.1
        assert w.suspect(eng) == [1] and w.stalled(eng) is None    # degraded, not stalled
        w.answer(0)
        w.end()
        assert w.suspect(eng) is None
    now = time.monotonic()
    fenced = SimpleNamespace(phase=P.SERVING, fence=SimpleNamespace(active=True, at=now - 0.4),
                             phase_since=now - 14.0)
    got = EngineRecovery.health(fenced)
    assert got["phase"] == "fence" and 0.4 <= got["phase_seconds"] < 1.0, got
    fenced.phase_since, fenced.phase = now - 2.0, P.REFORM    # a real transition's clock
    assert EngineRecovery.health(fenced)["phase"] == "reform"
    assert EngineRecovery.health(fenced)["phase_seconds"] >= 2.0
