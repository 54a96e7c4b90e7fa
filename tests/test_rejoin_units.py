"""Elastic rejoin pieces in one process (issue #23 item 8): a joiner's input-ring reader claimed
at the newest frame and un-retired reads exactly the frames put after it; the scheduler grows
by one empty DP rank with the running requests in place; the engine's notice box keeps
join notices for the step boundary, and a joiner dropped during its switch marks the switch
lost (no death: the engine abandons the switch); the store handshake (go / joined) per joiner
pid; the vote of a grow (the last member decides go unless the engine decided abort first)."""

from __future__ import annotations

import os

import pytest

from xllm_eplb.elastic.notices import JoinDropped, JoinReady, NoticeBox
from xllm_eplb.engine.scheduler import Request, Scheduler


def test_a_joiner_reads_from_the_frame_after_its_claim(run_id):
    from xllm_eplb.ipc.messages import ForwardInput
    from xllm_eplb.ipc.ring import InputRing

    with InputRing.create(run_id, 2, slots=2, frame_bytes=1024) as eng, \
            InputRing.attach(run_id, 0) as w0:
        eng.retire_reader(1)                       # worker 1 died: N-1 serve
        for step in range(5):                      # more than the slots: never blocks
            eng.put(ForwardInput(step, []), timeout=1)
            assert w0.get(timeout=1).step == step
        with InputRing.attach(run_id, 1, skip=True) as joiner:   # the go, nothing put
            eng.unretire_reader(1)
            eng.put(ForwardInput(5, [], regroup=3), timeout=1)
            got = joiner.get(timeout=1)
            assert got.step == 5 and got.regroup == 3
            assert w0.get(timeout=1).step == 5
            eng.put(ForwardInput(6, []), timeout=1)
            assert joiner.get(timeout=1).step == 6 and w0.get(timeout=1).step == 6


def test_scheduler_grows_by_one_empty_rank_and_keeps_the_running_requests():
    s = Scheduler(dp_size=2, max_batch_size=4, max_prefill_tokens=8)
    reqs = [s.submit(Request(prompt=[1, 2, 3], max_tokens=9)) for _ in range(2)]
    s.pull()
    s.update({r.req_id: 7 for x in s.schedule() for r in x.rows})
    ranks = {r.req_id: r.dp_rank for r in reqs}
    s.grow()
    assert s.dp_size == 3
    nxt = s.schedule()
    assert len(nxt) == 3 and nxt[2].rows == []                  # decodes stay on their ranks
    assert {r.req_id: r.dp_rank for r in reqs} == ranks
    new = s.submit(Request(prompt=[4, 5], max_tokens=3))
    s.pull()
    s.update({r.req_id: 7 for x in nxt for r in x.rows})
    nxt = s.schedule()
    assert new.dp_rank == 2 and [r.req_id for r in nxt[2].rows] == [new.req_id]


def test_notice_box_keeps_join_notices_and_a_switch_drop_loses_the_switch():
    q = [JoinReady(2, 1.0, 2.0, 123), JoinDropped(1, "timeout")]
    box = NoticeBox(lambda t: q.pop(0) if q else None)
    box.drain()
    assert box.take_joins() == [JoinReady(2, 1.0, 2.0, 123), JoinDropped(1, "timeout")]
    assert box.take_joins() == [] and not box.death
    box.watch_joiner(2)
    drop = JoinDropped(2, "rank 2 died during its rejoin", True)
    q.append(drop)
    assert not box.poll(0.0) and not box.death          # not a death: the switch is abandoned
    assert "the joiner ep2 died during the switch" in box.joiner_lost
    assert box.take_joins() == [drop]                   # the boundary keeps it joining (restart)


def test_switch_vote_go_and_abort():
    """Two members and the engine on the launcher's store: all arrive -> go for everyone; the
    engine's abort before the last arrival -> abandoned for everyone (first decision wins)."""
    import threading

    from xllm_eplb.elastic import protocol
    from xllm_eplb.elastic.protocol import decide
    from xllm_eplb.ipc.store import host_store, store_client
    from xllm_eplb.testing.dist import free_port

    port = free_port()
    host = host_store("127.0.0.1", port, 10)
    a, b = (store_client("127.0.0.1", port, 10) for _ in range(2))
    got: dict = {}

    def member(name, client, g):
        got[name] = protocol.vote(client, g, 2, 10.0, lambda: True)

    th = [threading.Thread(target=member, args=(n, c, 5)) for n, c in (("a", a), ("b", b))]
    for t in th:
        t.start()
    for t in th:
        t.join(10)
    assert got == {"a": True, "b": True} and decide(host, 5, "abort") == "go"
    t = threading.Thread(target=member, args=("a", a, 6))
    t.start()
    assert decide(host, 6, "abort") == "abort"
    member("b", b, 6)                                  # the last arrival: too late
    t.join(10)
    assert got == {"a": False, "b": False}


def test_store_go_and_joined_keys_are_per_joiner():
    from xllm_eplb.elastic import protocol
    from xllm_eplb.ipc.store import host_store, store_client
    from xllm_eplb.testing.dist import free_port

    port = free_port()
    host = host_store("127.0.0.1", port, 10)
    client = store_client("127.0.0.1", port, 10)
    host.set(protocol.join_key(2, os.getpid()), b"7")
    assert protocol.wait_go(client, 2, 5, lambda: True) == 7
    protocol.announce_joined(client, 2)
    host.wait([protocol.joined_key(2, os.getpid())])
    with pytest.raises(TimeoutError, match="elastic_join_timeout_seconds"):
        protocol.wait_go(client, 3, 0.5, lambda: True)
    with pytest.raises(RuntimeError, match="launcher is gone"):
        protocol.wait_go(client, 3, 5, lambda: False)
