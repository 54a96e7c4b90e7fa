"""P2P planner, chunking and wave packing (single process)."""

from collections import Counter

import numpy as np
import pytest
import torch

from xllm_eplb.worker.p2p import P2PPlanError, chunk, plan_p2p, plan_waves


def plans(old, new, S):
    D = len(old) // S
    return [plan_p2p(np.array(old), np.array(new), r, S) for r in range(D)]


def test_identity_is_empty():
    old = [0, 1, 2, 3, 3, 4, 5, 6, 7, 7]
    for p in plans(old, old, 5):
        assert p.empty and not p.recv and not p.send and p.changed.size == 0
        assert p.unchanged == 10
        assert p.local_sources.tolist() == [0, 1, 2, 3, 3]


def test_cross_rank_pairing():
    old = [0, 1, 2, 3]
    new = [0, 2, 2, 3]          # rank 0 slot 1 needs expert 2 from rank 1 slot 0
    p0, p1 = plans(old, new, 2)
    assert [(t.src_rank, t.src_slot, t.dst_rank, t.dst_slot) for t in p0.recv] == [(1, 0, 0, 1)]
    assert p0.send == [] and p1.recv == [] and p1.send == p0.recv
    assert p0.changed.tolist() == [1] and p0.local_sources.tolist() == [0, -1]
    assert (p0.unchanged, p0.same_rank, p0.cross_rank) == (3, 0, 1)


def test_swap_across_ranks_and_within_rank():
    old = [0, 1, 2, 3]
    new = [2, 1, 0, 3]          # swap 0 <-> 2 across ranks
    p0, p1 = plans(old, new, 2)
    assert len(p0.recv) == 1 and len(p0.send) == 1
    assert len(p1.recv) == 1 and len(p1.send) == 1
    assert p0.recv[0] == p1.send[0] and p0.send[0] == p1.recv[0]
    same = plans([0, 1, 2, 3], [1, 0, 2, 3], 2)       # swap within rank 0: local copies only
    assert same[0].recv == [] and same[0].send == [] and same[0].same_rank == 2
    assert same[0].local_sources.tolist() == [1, 0]


def test_missing_expert_fails_on_every_rank():
    old = [0, 1, 1, 2, 3, 3]    # expert 4 is nowhere
    new = [0, 1, 4, 2, 3, 3]
    msgs = []
    for r in range(2):
        with pytest.raises(P2PPlanError, match="expert 4") as ei:
            plan_p2p(np.array(old), np.array(new), r, 3)
        msgs.append(str(ei.value))
    assert msgs[0] == msgs[1]


def test_bad_shapes():
    with pytest.raises(P2PPlanError, match="sizes differ"):
        plan_p2p(np.arange(4), np.arange(6), 0, 2)
    with pytest.raises(P2PPlanError, match="multiple"):
        plan_p2p(np.arange(5), np.arange(5), 0, 2)
    with pytest.raises(P2PPlanError, match="rank=3"):
        plan_p2p(np.arange(4), np.arange(4), 3, 2)


def test_three_rank_symmetry_random():
    rng = np.random.default_rng(0)
    E, D, S = 6, 3, 3
    for _ in range(200):
        old = np.concatenate([rng.permutation(E), rng.integers(0, E, D * S - E)])
        new = np.concatenate([rng.permutation(E), rng.integers(0, E, D * S - E)])
        ps = [plan_p2p(old, new, r, S) for r in range(D)]
        sends = sorted(t for p in ps for t in p.send)
        recvs = sorted(t for p in ps for t in p.recv)
        assert sends == recvs                               # every send has its recv
        for p in ps:
            for t in p.recv:                                # sources hold the expert now
                assert old[t.src_rank * S + t.src_slot] == new[t.dst_rank * S + t.dst_slot]
            orders = [t.order for t in sorted(p.recv + p.send, key=lambda t: t.order)]
            assert orders == sorted(set(orders))
        assert len({(p.unchanged, p.same_rank, p.cross_rank) for p in ps}) == 1


def test_sources_spread_over_holders():
    # expert 0 is held by ranks 0 and 1; ranks 2 and 3 both want it
    old = [0, 1, 0, 2, 3, 4, 5, 6]
    new = [0, 1, 0, 2, 0, 4, 0, 6]
    p = plan_p2p(np.array(old), np.array(new), 0, 2)
    senders = Counter(t.src_rank for t in p.send) + Counter(
        t.src_rank for t in plan_p2p(np.array(old), np.array(new), 1, 2).send)
    assert senders == {0: 1, 1: 1}


def test_pairwise_order_low_sends_first():
    old = [0, 1, 2, 3]
    new = [2, 3, 0, 1]
    p0, p1 = plans(old, new, 2)
    kinds0 = ["send" if t in p0.send else "recv" for t in sorted(p0.send + p0.recv,
                                                                 key=lambda t: t.order)]
    kinds1 = ["send" if t in p1.send else "recv" for t in sorted(p1.send + p1.recv,
                                                                 key=lambda t: t.order)]
    assert kinds0 == ["send", "send", "recv", "recv"]
    assert kinds1 == ["recv", "recv", "send", "send"]


def test_chunk_and_waves():
    t = torch.zeros(10, 3)                        # 120 bytes
    cs = chunk(t[2], 8)                           # 12 bytes -> 8 + 4
    assert [c.numel() for c in cs] == [2, 1]
    assert cs[0].data_ptr() == t[2].data_ptr()    # views, no copy
    assert len(chunk(t, 1 << 20)) == 1
    assert plan_waves([4, 4, 4, 4, 4], 8) == [(0, 2), (2, 4), (4, 5)]
    assert plan_waves([10, 1], 8) == [(0, 1), (1, 2)]
    assert plan_waves([], 8) == []


# --- wave deadlock freedom (rendezvous semantics, as gloo: a send completes only once the
# --- matching receive is posted) -------------------------------------------------------------

def _rank_ops(msgs, chunk_bytes):
    """Chunk and tag like BatchedTransfer: (kind, peer, tag, nbytes) per posted operation."""
    ops, tags = [], {}
    for m in msgs:
        for c in chunk(m.tensor, chunk_bytes):
            k = (m.kind, m.peer)
            tags[k] = tags.get(k, 0) + 1
            ops.append((m.kind, m.peer, tags[k] - 1, c.numel() * c.element_size()))
    return ops


def _simulate(per_rank_ops, limit):
    """True if every rank finishes all its waves; False on a deadlock."""
    waves = {r: plan_waves([o[3] for o in ops], limit) for r, ops in per_rank_ops.items()}
    cur = {r: 0 for r in per_rank_ops}
    posted = set()

    def post(r):
        if cur[r] < len(waves[r]):
            a, b = waves[r][cur[r]]
            for kind, peer, tag, _ in per_rank_ops[r][a:b]:
                posted.add((r, kind, peer, tag))

    for r in per_rank_ops:
        post(r)
    progress = True
    while progress:
        progress = False
        for r, ops in per_rank_ops.items():
            if cur[r] >= len(waves[r]):
                continue
            a, b = waves[r][cur[r]]
            other = {"send": "recv", "recv": "send"}
            if all((peer, other[kind], r, tag) in posted for kind, peer, tag, _ in ops[a:b]):
                cur[r] += 1
                post(r)
                progress = True
    return all(cur[r] >= len(waves[r]) for r in per_rank_ops)


def _tensors(S, sizes):
    return {f"t{i}": torch.zeros(S, n) for i, n in enumerate(sizes)}


def test_waves_in_global_order_never_deadlock():
    from migration_util import random_placement

    from xllm_eplb.worker.p2p import plan_messages

    rng = np.random.default_rng(3)
    E, D, S = 8, 4, 4
    for _ in range(150):
        old, new = random_placement(rng, E, D, S), random_placement(rng, E, D, S)
        chunk_b = int(rng.choice([4, 8, 16, 64]))
        limit = chunk_b * int(rng.integers(1, 6))
        per_rank = {}
        for r in range(D):
            ts = _tensors(S, [1, 3, 8])
            msgs = plan_messages(plan_p2p(old, new, r, S), ts, _tensors(S, [1, 3, 8]),
                                 list(range(D)))
            per_rank[r] = _rank_ops(msgs, chunk_b)
        assert _simulate(per_rank, limit)


def test_rank_local_order_can_deadlock():
    # the hazard plan_messages avoids: a ring where every rank interleaves
    # "send left, receive right" per tensor; 2 chunks per tensor, 4 chunks per wave
    from xllm_eplb.worker.p2p import Message

    D = 4
    per_rank = {}
    for r in range(D):
        msgs = []
        for n in (1, 8, 4):
            msgs += [Message("send", (r - 1) % D, torch.zeros(n)),
                     Message("recv", (r + 1) % D, torch.zeros(n))]
        per_rank[r] = _rank_ops(msgs, 16)
    assert not _simulate(per_rank, 64)
    assert _simulate(per_rank, 1 << 20)          # one wave: fine
