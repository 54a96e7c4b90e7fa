"""Message schema: round trips, rejection rules, fuzzed bodies and frames never crash a reader."""

from __future__ import annotations

import os
import uuid

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xllm_eplb.eplb.info import EplbInfo
from xllm_eplb.ipc import objects
from xllm_eplb.ipc.errors import MessageError, RingTimeoutError
from xllm_eplb.ipc.messages import SCHEMA_VERSION, ForwardInput, ForwardOutput, decode, encode
from xllm_eplb.ipc.records import ExecutorStats, StepTimings, WorkerHeartbeat
from xllm_eplb.ipc.ring import InputRing
from xllm_eplb.ipc.shm import run_prefix
from xllm_eplb.model.batch import RankBatch, SeqRow

RUN = "msgtest"


def _input() -> ForwardInput:
    info = EplbInfo(prepare_layer_id=3, prepare_token=11,
                    expert_ids=np.array([5, 1, -1, 2**40], dtype=np.int64), update_layer_id=2,
                    activation_token=10)
    batches = [RankBatch([SeqRow(7, [1, 2, 3], 0, True, 0.7, 42, logprobs=3)], release=[3]),
               RankBatch(),
               RankBatch([SeqRow(8, [9], 17, False)], truncate=[[8, 17], [9, 0]])]
    return ForwardInput(step=123, batches=batches, eplb_info=info, warmup=True, pure_decode=True)


def _output() -> ForwardOutput:
    return ForwardOutput(step=123, rank=5,
                         counters=np.arange(58 * 34, dtype=np.int64).reshape(58, 34) * 2**33,
                         prepared_token=11, activation_token=-1, sampled={7: 31999, 8: 0},
                         logprobs={7: (-0.25, [(31999, -0.25), (4, -1.5)]),
                                   8: (-float("inf"), [])},
                         timings=StepTimings(0.0125, 0.01, 1e-6, [0.5, 0.25, 0.0]),
                         heartbeat=WorkerHeartbeat(12345.5, ExecutorStats(
                             prepares_ok=3, activations=2, last_transfer_ms=1.5,
                             p2p_bytes_total=2**40, last_update_layer=7, queued=1)),
                         error=None)


def test_forward_input_round_trip():
    msg = _input()
    got = decode(encode(msg, RUN), RUN)
    assert isinstance(got, ForwardInput)
    assert got.step == 123 and got.warmup and got.pure_decode and not got.shutdown
    assert got.batches == msg.batches and got.batches[0].rows[0].logprobs == 3
    assert got.batches[2].rows[0].logprobs == -1
    assert got.eplb_info.expert_ids.dtype == np.int64
    np.testing.assert_array_equal(got.eplb_info.expert_ids, msg.eplb_info.expert_ids)
    assert got.eplb_info.prepare_token == 11 and got.eplb_info.activation_token == 10
    sd = decode(encode(ForwardInput.make_shutdown(9), RUN), RUN)
    assert sd.shutdown and sd.step == 9


def test_forward_output_round_trip():
    msg = _output()
    got = decode(encode(msg, RUN), RUN, kind="out")
    assert got.counters.dtype == np.int64 and got.counters.shape == (58, 34)
    np.testing.assert_array_equal(got.counters, msg.counters)
    assert (got.step, got.rank, got.prepared_token, got.activation_token) == (123, 5, 11, -1)
    assert got.sampled == {7: 31999, 8: 0}
    assert got.logprobs == {7: (-0.25, [(31999, -0.25), (4, -1.5)]), 8: (-float("inf"), [])}
    assert got.timings == msg.timings and got.heartbeat == msg.heartbeat and got.error is None
    err = decode(encode(ForwardOutput(1, 0, error="OOM in layer 3"), RUN), RUN)
    assert err.error == "OOM in layer 3" and err.counters.shape == (0, 0)


def test_unserialisable_field_is_named():
    with pytest.raises(TypeError, match="ForwardOutput step=3: a field is not msgpack-safe"):
        encode(ForwardOutput(3, 0, heartbeat=WorkerHeartbeat(ts=object())), RUN)


def test_executor_stats_count_what_happened():
    """The executor's events land in their fields: heartbeats, prepares, and each move's
    numbers (the last one's, the totals summed); the record still round-trips exactly."""
    from xllm_eplb.worker.migration import MoveStats

    def move(layer, slots, nbytes, cross, ops, ms):
        return MoveStats(layer=layer, rank=1, dispatch_mode="plain", tensor_count=4,
                         changed_slots=slots, activation_mode="slots", recv_slots=slots,
                         send_slots=slots, p2p_operations=ops, p2p_bytes=nbytes,
                         materialize_ms=ms, post_ms=0.5, transfer_ms=2 * ms,
                         activation_ms=3 * ms, total_ms=6 * ms + 0.5, cross_node_bytes=cross)

    s = ExecutorStats()
    s.prepare_thread_woke(10.0)
    s.p2p_checked(11.0)
    s.count_prepare(True, 2.5)
    s.count_prepare(False, 4.0)
    assert (s.heartbeat_ts, s.p2p_heartbeat_ts) == (10.0, 11.0)
    assert (s.prepares_ok, s.prepares_failed, s.last_prepare_ms) == (1, 1, 4.0)
    s.count_activation(2, move(2, 3, 300, 100, 6, 1.0), 12.0)
    s.count_activation(0, move(0, 1, 50, 0, 2, 2.0), 13.0)
    assert (s.activations, s.last_update_layer, s.p2p_heartbeat_ts) == (2, 0, 13.0)
    assert (s.last_materialize_ms, s.last_transfer_ms, s.last_activation_ms,
            s.last_total_ms, s.last_slots_changed) == (2.0, 4.0, 6.0, 12.5, 1)
    assert (s.slots_changed_total, s.p2p_bytes_total, s.p2p_cross_node_bytes_total,
            s.p2p_ops_total) == (4, 350, 100, 8)
    assert s.heartbeat_ts == 10.0 and s.prepares_ok == 1      # other fields untouched
    assert ExecutorStats.from_dict(s.to_dict()) == s


def test_records_are_exact_a_missing_or_renamed_field_is_an_error():
    """A heartbeat or timings field the reader does not know (or misses) is a MessageError
    naming it, never a silent 0."""
    d = msgpack.unpackb(encode(_output(), RUN), raw=False)
    d["heartbeat"]["executor"]["last_xfer_ms"] = d["heartbeat"]["executor"].pop(
        "last_transfer_ms")
    with pytest.raises(MessageError, match=r"ExecutorStats: fields missing \['last_transfer_ms'\], "
                                           r"unknown \['last_xfer_ms'\]"):
        decode(msgpack.packb(d, use_bin_type=True), RUN)
    d = msgpack.unpackb(encode(_output(), RUN), raw=False)
    del d["timings"]["eplb_s"]
    with pytest.raises(MessageError, match=r"StepTimings: fields missing \['eplb_s'\]"):
        decode(msgpack.packb(d, use_bin_type=True), RUN)
    d = msgpack.unpackb(encode(_output(), RUN), raw=False)
    d["heartbeat"]["executor"]["activations"] = 2.5
    with pytest.raises(MessageError, match="field ExecutorStats.activations=2.5: must be int"):
        decode(msgpack.packb(d, use_bin_type=True), RUN)
    d["heartbeat"]["executor"]["activations"] = 2
    d["timings"]["expert_cpu_s"] = [0.5, "x"]
    with pytest.raises(MessageError, match=r"StepTimings.expert_cpu_s\[1\]='x': must be float"):
        decode(msgpack.packb(d, use_bin_type=True), RUN)


@pytest.mark.parametrize("bad", [[[7, 0.5, []]], [[7, -1.0, [[1, "x"]]]], [[7, -1.0]],
                                 [[True, -1.0, []]], [[7, float("nan"), []]], [[7, -1, []]]])
def test_logprobs_entries_are_validated_exactly(bad):
    d = msgpack.unpackb(encode(_output(), RUN), raw=False)
    d["logprobs"] = bad
    with pytest.raises(MessageError, match="field logprobs: entry"):
        decode(msgpack.packb(d, use_bin_type=True), RUN)
    del d["logprobs"]
    with pytest.raises(MessageError, match="'logprobs' missing"):
        decode(msgpack.packb(d, use_bin_type=True), RUN)


def test_counters_must_be_2d():
    with pytest.raises(ValueError, match=r"counters: shape \(3,\)"):
        encode(ForwardOutput(1, 0, counters=np.zeros(3, dtype=np.int64)), RUN)


def test_rejections_name_the_problem():
    body = encode(_input(), RUN)
    with pytest.raises(MessageError, match="run 'msgtest' != this run 'other'"):
        decode(body, "other")
    with pytest.raises(MessageError, match="kind 'in' unexpected"):
        decode(body, RUN, kind="out")
    d = msgpack.unpackb(body, raw=False)
    d["v"] = SCHEMA_VERSION + 1
    with pytest.raises(MessageError, match=f"schema version {SCHEMA_VERSION + 1} != {SCHEMA_VERSION}"):
        decode(msgpack.packb(d, use_bin_type=True), RUN)
    d = msgpack.unpackb(encode(_output(), RUN), raw=False)
    d["cshape"] = [58, 35]
    with pytest.raises(MessageError, match="counters"):
        decode(msgpack.packb(d, use_bin_type=True), RUN)
    d["cshape"] = [58, 34]
    del d["step"]
    with pytest.raises(MessageError, match="'step' missing"):
        decode(msgpack.packb(d, use_bin_type=True), RUN)
    with pytest.raises(MessageError, match="not msgpack"):
        decode(body[:-5], RUN)
    with pytest.raises(TypeError):
        encode({"step": 1}, RUN)


def _decode_or_message_error(data: bytes):
    try:
        decode(data, RUN)
    except MessageError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_fuzz_random_bytes_only_raise_message_error(data):
    _decode_or_message_error(data)


VALID = [encode(_input(), RUN), encode(_output(), RUN)]


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(VALID), st.integers(0, 10**6), st.integers(0, 255),
       st.integers(0, 10**6))
def test_fuzz_mutated_and_truncated_bodies(body, pos, byte, cut):
    b = bytearray(body)
    b[pos % len(b)] = byte
    _decode_or_message_error(bytes(b)[: max(1, cut % (len(b) + 1))])


@st.composite
def _structured(draw):
    leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**63 - 1), st.floats(),
                     st.text(max_size=8), st.binary(max_size=16))
    tree = st.recursive(leaf, lambda c: st.lists(c, max_size=3)
                        | st.dictionaries(st.text(max_size=6), c, max_size=3), max_leaves=8)
    d = msgpack.unpackb(draw(st.sampled_from(VALID)), raw=False)
    key = draw(st.sampled_from(sorted(d)))
    d[key] = draw(tree)
    return msgpack.packb(d, use_bin_type=True)


@settings(max_examples=300, deadline=None)
@given(_structured())
def test_fuzz_wrong_field_types(body):
    _decode_or_message_error(body)


@pytest.fixture(scope="module", params=[False, True], ids=["default", "checksum"])
def fuzz_ring(request):
    rid = "t" + uuid.uuid4().hex[:10]
    eng = InputRing.create(rid, 1, slots=4, frame_bytes=1024, checksum=request.param)
    reader = InputRing.attach(rid, 0)
    yield eng, reader
    reader.close()
    eng.close()
    objects.clean(rid, force=True)
    assert not [f for f in os.listdir("/dev/shm") if run_prefix(rid) in f]


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(garbage=st.binary(min_size=1, max_size=96), where=st.integers(0, 1023))
def test_fuzz_corrupted_frames_never_crash_the_reader(fuzz_ring, garbage, where):
    eng, reader = fuzz_ring
    ring = eng.ring
    seq = eng.put(ForwardInput(1, [RankBatch([SeqRow(5, [1, 2, 3], 0, True)])]), timeout=1)
    off = ring._frames + (seq % ring.slots) * ring.frame_bytes
    where = where % (ring.frame_bytes - len(garbage) + 1)
    ring.seg.write(off + where, garbage)   # header, length, seq, checksum or body: anything goes
    eng.put(ForwardInput(2), timeout=1)
    got = []
    while True:                             # only RingTimeoutError may end the drain
        try:
            got.append(reader.get(timeout=0))
        except RingTimeoutError:
            break
    assert got and got[-1].step == 2 and got[-1].batches == []   # the intact frame, last
    assert len(got) <= 2
    if ring.checksum and len(got) == 2:     # accepted despite the write: it changed nothing
        assert got[0].step == 1 and got[0].batches[0].rows[0].token_ids == [1, 2, 3]
