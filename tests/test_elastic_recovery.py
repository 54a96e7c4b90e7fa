"""The engine's elastic recovery state machine (``elastic/recovery.py``) in one process, on a fake
transport: a scripted engine port (rings = per-rank frame queues), a dict store and a scripted
launcher channel. Every transition of :data:`TRANSITIONS` is taken, and a death lands in every
phase (detect, fence, re-form, resume, join, switch, abandon, and a re-prefill step after a
recovery); the real multi-process runs are tests/test_elastic_*.py."""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import pytest

from xllm_eplb.elastic import recovery as rec_mod
from xllm_eplb.elastic.notices import (
    JoinDropped,
    JoinReady,
    NoticeBox,
    WorkerDied,
    notice_from_dict,
    notice_to_dict,
)
from xllm_eplb.elastic.protocol import ABANDONED, attached_key, decision_key
from xllm_eplb.elastic.recovery import TRANSITIONS, EngineRecovery, Phase
from xllm_eplb.errors import WorkerFault
from xllm_eplb.ipc.errors import IpcError, RingTimeoutError
from xllm_eplb.obs.metrics import EngineMetrics

P = Phase
E, S, L = 6, 3, 2          # 4 ranks x 3 slots hold 6 experts; so do 3 and 2 ranks (the rule)


@dataclass
class Out:
    step: int
    rank: int
    error: str = ""
    peer_lost: bool = False
    activation_token: int = -1


class FakeStore:
    """The calls ``elastic/`` makes on a TCPStore; ``joiner_answers``: the joiner sets its
    ``joined`` key when the engine's go is set."""

    def __init__(self):
        self.d: dict[str, bytes] = {}
        self.joiner_answers = True
        self.on_go = self.on_decide = None

    def add(self, key, n):
        self.d[key] = str(int(self.d.get(key, b"0")) + n).encode()
        return int(self.d[key])

    def set(self, key, value):
        self.d[key] = value if isinstance(value, bytes) else str(value).encode()
        if key.startswith("join/") and self.on_go is not None:
            self.on_go(key)
        if key.startswith("join/") and self.joiner_answers:
            self.d["joined/" + key[len("join/"):]] = b"1"

    def get(self, key):
        return self.d[key]

    def wait(self, keys, timeout: timedelta):
        if not all(k in self.d for k in keys):
            raise RuntimeError("wait timeout")

    def compare_set(self, key, expected, desired):
        if key not in self.d:
            self.d[key] = desired.encode()
            if self.on_decide is not None:
                self.on_decide(desired)
        return self.d[key]


class FakeEngine:
    """The port ``EngineRecovery`` drives: each rank's output ring is a queue of frames (or
    exceptions to raise); a regroup step queues every member's answer unless ``on_regroup``
    says otherwise."""

    def __init__(self, D=4):
        self.ep_size, self.step_no, self.stopping = D, 10, False
        self.workers = list(range(D))
        self.active_placement = np.tile(np.arange(D * S) % E, (L, 1)).astype(np.int64)
        self.q: dict[int, list] = {w: [] for w in range(8)}     # worker -> frames
        self.resizes: list[list[int]] = []
        self.voided: list[int] = []
        self.idle_steps = 0
        self.on_regroup = None
        self.vote_committed = False

    def read_output(self, rank, timeout):
        q = self.q[self.workers[rank]]
        if not q:
            raise RingTimeoutError("no frame")
        item = q.pop(0)
        if isinstance(item, Exception):
            q.insert(0, item)        # a closed ring stays closed
            raise item
        return item

    def send_regroup(self, pg_generation, timeout):
        self.step_no += 1
        for r, w in enumerate(self.workers):
            self.q[w].append(Out(self.step_no, r))
        if self.on_regroup is not None:
            self.on_regroup(pg_generation, self.step_no)
        return self.step_no

    def resize(self, workers, placement):
        self.resizes.append(list(workers))
        self.workers, self.ep_size = list(workers), len(workers)
        self.active_placement = np.asarray(placement)

    def void_step(self, rank):
        self.voided.append(rank)
        return 2, 3

    def abort_eplb_round(self, switched):
        return True

    def awaited_token(self):
        return -1

    def expert_load(self):
        return None

    def idle_step(self):
        self.idle_steps += 1


@pytest.fixture(autouse=True)
def _short_waits(monkeypatch):
    """The launcher's notice is either queued or never comes: no real waiting."""
    monkeypatch.setattr(rec_mod, "NOTICE_WAIT", 0.01)
    monkeypatch.setattr(rec_mod, "FENCE_MIN_S", 0.01)


def make(D=4, alive=True):
    eng, store, sent = FakeEngine(D), FakeStore(), []
    box = NoticeBox(lambda t: sent.pop(0) if sent else None, lambda: alive, 4242)
    store.add("pg_generation", 1)
    r = EngineRecovery(eng, box, store, num_experts=E, slots=S, num_layers=L, silence_s=0.01,
                       join_timeout_s=0.3, metrics=EngineMetrics(D, L))
    return r, eng, store, sent


def attach(store, w, g):
    """The replacement of worker ``w`` attached its rings (its key in generation ``g``)."""
    store.set(attached_key(g, w), b"1")


def died(w, g, mode):
    return WorkerDied(w, f"rank {w} (pid 1) died during serving: killed by SIGKILL", g,
                      time.time(), mode)


def step_fails(r, eng, dead: int):
    """A step (number ``eng.step_no``) in which worker ``dead`` died: the survivors' void
    outputs are queued; the engine read rank 0's already."""
    got = {}
    for rank, w in enumerate(eng.workers):
        if w == dead:
            eng.q[w] = [IpcError("producer gone")]
        elif rank == 0:
            got[0] = Out(eng.step_no, 0, error="peer lost", peer_lost=True)
        else:
            eng.q[w].append(Out(eng.step_no, rank, error="peer lost", peer_lost=True))
    return got


def test_notices_round_trip_exactly_and_refuse_bad_fields():
    for n in (died(2, 3, "rejoin"), JoinReady(3, 1.0, 2.5, 77),
              JoinDropped(3, "timeout", True)):
        assert notice_from_dict(notice_to_dict(n)) == n
    d = notice_to_dict(died(1, 2, "respawn"))
    with pytest.raises(ValueError, match="missing"):
        notice_from_dict({k: v for k, v in d.items() if k != "pg_generation"})
    with pytest.raises(ValueError, match="unknown"):
        notice_from_dict({**d, "extra": 1})
    with pytest.raises(ValueError, match="worker='1' must be int"):
        notice_from_dict({**d, "worker": "1"})
    with pytest.raises(ValueError, match="kind='Nope'"):
        notice_from_dict({"kind": "Nope"})


def test_respawn_detect_fence_reform_resume():
    r, eng, store, sent = make()
    got = step_fails(r, eng, 1)
    eng.q[1] = []                               # the replacement's ring: a fresh reader
    sent.append(died(1, 2, "respawn"))
    attach(store, 1, 2)
    r.recover(WorkerFault("rank 1: ring producer gone"), got)
    assert r.visited == [P.DETECT, P.FENCE, P.REFORM, P.RESUME, P.SERVING]
    assert r.pg_generation == 2 and r.workers == [0, 1, 2, 3] and eng.resizes == []
    assert eng.voided == [1] and r.counts.last["mode"] == "respawn"
    assert r.status()["last_recovery"]["generation"] == 2 == r.status()["pg_generation"]
    assert store.d["members/gen2"] == b"0,1,2,3" and r.health() is None


def test_shrink_resizes_the_engine_once_and_reforms_the_survivors():
    r, eng, store, sent = make()
    got = step_fails(r, eng, 2)
    sent.append(died(2, 2, "shrink"))
    r.recover(WorkerFault("rank 2: peer lost"), got)
    assert eng.resizes == [[0, 1, 3]] and r.workers == [0, 1, 3] and r.counts.shrinks == 1
    assert eng.active_placement.shape == (L, 3 * S)
    assert r.counts.last["ep_size"] == 3 and r.visited[-1] is P.SERVING


def test_rejoin_shrinks_then_joins_and_switches_at_a_boundary():
    r, eng, store, sent = make()
    got = step_fails(r, eng, 1)
    store.add("pg_generation", 1)                       # the launcher draws g=2 for the death
    sent.append(died(1, 2, "rejoin"))
    r.recover(WorkerFault("rank 1 died"), got)
    assert r.joining and eng.workers == [0, 2, 3]
    eng.q[1] = []                                       # the joiner's ring
    sent.append(JoinReady(1, time.time() - 1, time.time(), 99))
    r.visited.clear()
    r.at_boundary()
    assert r.visited == [P.JOIN, P.SWITCH, P.SERVING]
    assert eng.workers == [0, 2, 3, 1] and r.pg_generation == 3 and r.counts.joins == 1
    assert r.counts.last_join["ep_size"] == "3->4" and not r.joining
    assert store.d["join/ep1/pid99"] == b"3"


def test_a_join_the_plan_refuses_goes_back_to_serving():
    r, eng, store, sent = make()
    r.joining[1] = time.time()
    eng.resize([0, 2, 3], eng.active_placement[:, :3 * S])
    r.workers = [0, 2, 3]
    r.E = 10                                            # 4 x 3 slots cannot hold 10 experts
    sent.append(JoinReady(1, 0.0, 1.0, 5))
    eng.resizes.clear()
    r.at_boundary()
    assert r.visited == [P.JOIN, P.SERVING] and eng.resizes == []


# --- a death in every phase ------------------------------------------------------------------

def test_detect_without_an_elastic_notice_stops():
    r, eng, _, _ = make()
    with pytest.raises(WorkerFault, match="bad frame"):
        r.recover(WorkerFault("bad frame"), {})
    assert r.visited == [P.DETECT, P.STOPPED] and r.health()["phase"] == "stopped"


def test_a_dead_launcher_stops_at_once_naming_it():
    r, eng, _, _ = make(alive=False)
    t0 = time.monotonic()
    with pytest.raises(WorkerFault):
        r.recover(WorkerFault("rank 0: ring producer (pid 9) is gone"), {})
    assert time.monotonic() - t0 < 0.2
    assert "the launcher (pid 4242) is gone" in r.box.death


def test_a_survivor_dead_in_the_fence_stops():
    r, eng, _, sent = make()
    got = step_fails(r, eng, 1)
    eng.q[2] = [IpcError("producer gone")]             # a second death: no void output
    sent.append(died(1, 2, "respawn"))
    with pytest.raises(WorkerFault, match="rank 2 did not finish step"):
        r.recover(WorkerFault("x"), got)
    assert r.visited == [P.DETECT, P.FENCE, P.STOPPED]


def test_a_second_death_in_the_reform_stops():
    r, eng, store, sent = make()
    got = step_fails(r, eng, 1)
    eng.q[1] = []
    sent.append(died(1, 2, "respawn"))
    attach(store, 1, 2)

    def second(g, step):
        eng.q[3] = [IpcError("producer gone")]
        sent.append(died(3, 3, "respawn"))
    eng.on_regroup = second
    with pytest.raises(WorkerFault, match="did not re-form|second death"):
        r.recover(WorkerFault("x"), got)
    assert r.visited[-2:] == [P.REFORM, P.STOPPED]


def test_a_shrink_the_rule_refuses_stops_in_the_reform():
    r, eng, _, sent = make(D=2)
    eng.active_placement = np.tile(np.arange(2 * S) % 6, (L, 1))    # 6 experts on 2x3 slots
    got = step_fails(r, eng, 0)
    sent.append(died(0, 2, "shrink"))
    with pytest.raises(WorkerFault, match="the run stops"):
        r.recover(WorkerFault("x"), got)
    assert r.visited == [P.DETECT, P.FENCE, P.REFORM, P.STOPPED]


def test_a_death_during_resume_is_the_next_steps():
    r, eng, store, sent = make()
    got = step_fails(r, eng, 1)
    eng.q[1] = []
    sent += [died(1, 2, "respawn"), died(2, 3, "respawn")]
    attach(store, 1, 2)
    r.recover(WorkerFault("x"), got)                    # the second notice waits its turn
    assert r.phase is P.SERVING
    r.when_idle()
    assert eng.idle_steps == 1 and isinstance(r.box.died, WorkerDied) and r.box.died.worker == 2


def test_a_death_during_a_reprefill_step_is_recovered_again():
    r, eng, store, sent = make()
    for dead, g in ((1, 2), (2, 3)):                   # the second step re-prefills the first's
        got = step_fails(r, eng, dead)
        eng.q[dead] = []
        sent.append(died(dead, g, "respawn"))
        attach(store, dead, g)
        r.recover(WorkerFault("x"), got)
    assert r.counts.recoveries == 2 and r.counts.reprefilled == 4 and eng.voided == [1, 2]
    assert r.pg_generation == 3


def _rejoined_world(monkeypatch=None):
    """3 ranks serving after a rejoin-mode death of worker 1; its joiner is ready."""
    r, eng, store, sent = make()
    got = step_fails(r, eng, 1)
    store.add("pg_generation", 1)
    sent.append(died(1, 2, "rejoin"))
    r.recover(WorkerFault("x"), got)
    eng.q[1] = []
    r.visited.clear()
    return r, eng, store, sent


def test_a_serving_death_while_the_joiner_takes_its_ring_abandons_then_recovers():
    r, eng, store, sent = _rejoined_world()
    store.joiner_answers = False                        # the joiner has not answered the go
    store.on_go = lambda key: sent.append(died(3, 4, "rejoin"))     # g=3: the engine's grow
    eng.q[3] = [IpcError("producer gone")]
    for w in (0, 2):                                    # the survivors' void outputs
        eng.q[w].append(Out(eng.step_no, eng.workers.index(w), error="peer", peer_lost=True))
    sent.append(JoinReady(1, 0.0, 1.0, 7))
    r.at_boundary()
    assert r.visited == [P.JOIN, P.ABANDON, P.DETECT, P.FENCE, P.REFORM, P.RESUME, P.SERVING]
    assert eng.resizes[-1] == [0, 2] and r.counts.switches_abandoned == 1


def test_a_serving_death_during_the_switch_abandons_resizes_back_and_recovers():
    r, eng, store, sent = _rejoined_world()

    def death(g, step):                   # worker 3 dies after the regroup step was sent
        for w in (0, 1, 2):               # the members wait in the vote: no answer yet
            eng.q[w] = []
        eng.q[3] = [IpcError("producer gone")]
        store.add("pg_generation", 1)
        sent.append(died(3, 4, "rejoin"))
        eng.on_regroup = None

        def abandoned(decision):          # the serving ranks answer the engine's abort
            assert decision == "abort"
            for w in (0, 2):
                eng.q[w].append(Out(step, eng.workers.index(w), error=ABANDONED,
                                    peer_lost=True))
        store.on_decide = abandoned
    eng.on_regroup = death
    sent.append(JoinReady(1, 0.0, 1.0, 7))
    r.at_boundary()
    assert r.visited == [P.JOIN, P.SWITCH, P.ABANDON, P.DETECT, P.FENCE, P.REFORM, P.RESUME,
                         P.SERVING]
    assert eng.resizes[-3:] == [[0, 2, 3, 1], [0, 2, 3], [0, 2]]
    assert store.d[decision_key(3)] == b"abort" and r.workers == [0, 2]


def test_the_joiner_lost_during_the_switch_abandons_and_keeps_serving():
    r, eng, store, sent = _rejoined_world()

    def drop(g, step):
        eng.q[1] = [IpcError("producer gone")]
        sent.append(JoinDropped(1, "rank 1 died during its rejoin", True))
        eng.on_regroup = None
    eng.on_regroup = drop
    sent.append(JoinReady(1, 0.0, 1.0, 7))
    r.at_boundary()
    assert r.visited == [P.JOIN, P.SWITCH, P.ABANDON, P.SERVING]
    assert eng.workers == [0, 2, 3] and r.joining      # restart: still joining


def test_the_joiner_lost_after_every_member_voted_go_stops():
    r, eng, store, sent = _rejoined_world()

    def drop(g, step):
        store.d[decision_key(g)] = b"go"                # every member voted go
        eng.q[1] = [IpcError("producer gone")]
        sent.append(JoinDropped(1, "died", False))
        eng.on_regroup = None
    eng.on_regroup = drop
    sent.append(JoinReady(1, 0.0, 1.0, 7))
    with pytest.raises(WorkerFault, match="after every rank had committed"):
        r.at_boundary()
    assert r.visited[-2:] == [P.ABANDON, P.STOPPED]


# --- the table itself ------------------------------------------------------------------------

def test_a_join_timeout_and_a_switch_error_stop():
    r, eng, store, sent = _rejoined_world()
    store.joiner_answers = False
    r.join_timeout = 0.05
    sent.append(JoinReady(1, 0.0, 1.0, 7))
    with pytest.raises(WorkerFault, match="did not take its input ring"):
        r.at_boundary()
    assert r.visited == [P.JOIN, P.STOPPED]
    r, eng, store, sent = _rejoined_world()

    def bad(g, step):
        eng.q[0] = [Out(step, 0, error="canary mismatch")]
        eng.on_regroup = None
    eng.on_regroup = bad
    sent.append(JoinReady(1, 0.0, 1.0, 7))
    with pytest.raises(WorkerFault, match="canary mismatch"):
        r.at_boundary()
    assert r.visited == [P.JOIN, P.SWITCH, P.STOPPED]


def test_a_silent_worker_is_fenced_once_and_health_says_so():
    killed = []
    r, eng, _, _ = make()
    r.fence.kill = killed.append
    r.between_slices(11, 0.001, lambda: [2])            # not silent long enough
    assert killed == [] and r.health() is None
    r.between_slices(11, 1.0, lambda: [2])
    r.between_slices(11, 1.0, lambda: [2])              # once per step
    assert killed == [2] and r.health()["phase"] == "fence"
    eng.step_no = 12
    r.at_boundary()
    assert r.health() is None


SCENARIOS = [
    test_respawn_detect_fence_reform_resume,
    test_shrink_resizes_the_engine_once_and_reforms_the_survivors,
    test_rejoin_shrinks_then_joins_and_switches_at_a_boundary,
    test_a_join_the_plan_refuses_goes_back_to_serving,
    test_detect_without_an_elastic_notice_stops, test_a_survivor_dead_in_the_fence_stops,
    test_a_second_death_in_the_reform_stops, test_a_shrink_the_rule_refuses_stops_in_the_reform,
    test_a_serving_death_while_the_joiner_takes_its_ring_abandons_then_recovers,
    test_a_serving_death_during_the_switch_abandons_resizes_back_and_recovers,
    test_the_joiner_lost_during_the_switch_abandons_and_keeps_serving,
    test_the_joiner_lost_after_every_member_voted_go_stops,
    test_a_join_timeout_and_a_switch_error_stop,
]


def test_every_transition_is_taken_and_no_other_is_allowed(monkeypatch):
    """The scenarios above, run again with every phase change recorded, take every edge of
    TRANSITIONS; an edge outside it raises."""
    taken = set()
    real = EngineRecovery._to

    def record(self, phase, **why):
        taken.add((self.phase, phase))
        real(self, phase, **why)
    monkeypatch.setattr(EngineRecovery, "_to", record)
    t0 = time.monotonic()
    for scenario in SCENARIOS:
        scenario()
    assert time.monotonic() - t0 < 1.0
    assert taken == {(a, b) for a, bs in TRANSITIONS.items() for b in bs}
    r, _, _, _ = make()
    with pytest.raises(RuntimeError, match="no transition serving -> reform"):
        r._to(P.REFORM)


def test_a_respawn_waits_for_the_replacements_attached_key_and_a_death_meanwhile_stops():
    """The replacement's ``attached`` is a key of the conversation (``elastic/protocol.py``),
    not a launcher relay: no key within the join timeout, or a second death while waiting,
    stops the run naming it; the regroup step is not sent before the key."""
    r, eng, store, sent = make()
    got = step_fails(r, eng, 1)
    eng.q[1] = []
    sent.append(died(1, 2, "respawn"))
    step = eng.step_no
    with pytest.raises(WorkerFault, match="did not attach within"):
        r.recover(WorkerFault("x"), got)
    assert eng.step_no == step and r.visited[-2:] == [P.REFORM, P.STOPPED]
    r, eng, store, sent = make()
    got = step_fails(r, eng, 1)
    eng.q[1] = []
    sent += [died(1, 2, "respawn"), died(3, 3, "respawn")]
    with pytest.raises(WorkerFault, match=r"did not attach: a second death \(rank 3"):
        r.recover(WorkerFault("x"), got)
