"""The launcher's elastic component (``elastic/supervisor.py``) in one process: which mode a death
gets, the notices the engine is sent, and every worker-state change along the table, on fake
processes (no child is started, no signal is sent)."""

from __future__ import annotations

import itertools

from xllm_eplb.elastic.notices import JoinDropped, JoinReady, WorkerDied
from xllm_eplb.elastic.supervisor import WORKER_TRANSITIONS, ElasticSupervisor, WorkerState
from xllm_eplb.flags import load_config

W = WorkerState
PIDS = itertools.count(1000)


class Proc:
    def __init__(self):
        self.pid, self.exitcode = next(PIDS), None

    def join(self, timeout=None):
        pass

    def close(self):
        pass


class Events:
    def __init__(self):
        self.sent = []

    def notify(self, who, notice):
        self.sent.append(notice)
        return True


class Store:
    def __init__(self):
        self.n = 1

    def add(self, key, n):
        self.n += n
        return self.n


class FakeLauncher:
    """The launcher's side of the port (``elastic/ports.py`` ``LauncherPort``) on fake
    processes: it owns ``procs``; the supervisor asks."""

    def __init__(self, procs, events, spawn):
        self.procs, self.events, self.spawn = procs, events, spawn
        self.errors: dict[str, str] = {}

    def worker_proc(self, who):
        return self.procs.get(who)

    def worker_names(self):
        return [w for w in self.procs if w.startswith("ep")]

    def spawn_worker(self, who, pg_generation=0, join=False):
        self.spawn(who, pg_generation, join)

    def retire(self, who):
        self.procs.pop(who).close()

    def clear_error(self, who):
        self.errors.pop(who, None)

    def replaced_message(self, who, during="serving"):
        return f"{who} died"

    def stop_requested(self):
        return False

    def engine_gone(self):
        return False

    def notify_engine(self, notice):
        return self.events.notify("engine", notice)


def make(*flags):
    cfg = load_config(["--ep-size", "4", "--num_experts", "8", "--num_experts_per_tok", "2",
                       *flags])[0]
    procs = {f"ep{r}": Proc() for r in range(4)}
    events, spawned, killed = Events(), [], []

    def spawn(who, g, join):
        procs[who] = Proc()
        spawned.append((who, g, join))

    sup = ElasticSupervisor(cfg, Store(), FakeLauncher(procs, events, spawn))
    sup._kill = killed.append
    return sup, procs, events, spawned, killed


def die(procs, who, code=-9):
    procs[who].exitcode = code


def test_rejoin_death_joiner_ready_joined_and_a_serving_death_that_drops_it():
    taken = []
    sup, procs, events, spawned, killed = make("--redundant_experts_num=2",    # 2 x 4 >= 8
                                               "--elastic_max_restarts=10")
    real = sup._to
    sup._to = lambda who, st: (taken.append((sup.states.get(who, W.SERVING), st)),
                               real(who, st))
    die(procs, "ep1")
    assert sup.replace("ep1")
    assert events.sent[-1] == WorkerDied(1, "ep1 died", 2, events.sent[-1].seen_at, "rejoin")
    assert sup.states["ep1"] is W.JOINING and spawned[-1] == ("ep1", 0, True)
    sup.on_event("ep1", "join_ready", f"12.5,{procs['ep1'].pid}")
    assert events.sent[-1] == JoinReady(1, sup.joining["ep1"]["wall"], 12.5, procs["ep1"].pid)
    sup.on_event("ep1", "joined", "")
    assert sup.states["ep1"] is W.SERVING and not sup.joining
    # a second death: rejoin again; while it loads, a serving rank dies: it is dropped
    die(procs, "ep2")
    assert sup.replace("ep2") and sup.states["ep2"] is W.JOINING
    die(procs, "ep0")
    assert sup.replace("ep0")
    assert sup.states["ep2"] is W.DROPPED and killed == ["ep2"]
    assert JoinDropped(2, "serving worker ep0 died", True) in events.sent
    die(procs, "ep2")                        # reaped: started again (counted at the drop)
    assert sup.replace("ep2") and sup.states["ep2"] is W.JOINING
    # a joiner not ready in time is dropped, then reaped: retired
    sup.joining["ep0"]["t0"] -= 10_000
    sup.check_joiners()
    assert sup.states["ep0"] is W.DROPPED and events.sent[-1] == JoinDropped(0, "timeout")
    die(procs, "ep0")
    assert sup.replace("ep0") and sup.states["ep0"] is W.RETIRED
    n = len(events.sent)
    sup.on_event("ep3", "attached", "5")     # no relay: the key is in the store (protocol)
    assert len(events.sent) == n
    assert sup.illegal == 0
    assert {(a, b) for a, b in taken} <= {(a, b) for a, bs in WORKER_TRANSITIONS.items()
                                          for b in bs}


def test_respawn_where_the_rule_fails_then_shrink_when_restarts_are_used_up():
    sup, procs, events, spawned, _ = make("--redundant_experts_num=0", "--elastic_max_restarts=1")
    die(procs, "ep3")
    assert sup.replace("ep3") and events.sent[-1].mode == "respawn"
    assert spawned[-1] == ("ep3", 2, False) and sup.states["ep3"] is W.SERVING
    die(procs, "ep3")
    assert sup.replace("ep3") and events.sent[-1].mode == "shrink"
    assert sup.states["ep3"] is W.RETIRED and "ep3" not in procs
    assert sup.illegal == 0


def test_an_exit_0_or_a_node_out_of_restarts_is_no_replacement():
    sup, procs, events, _, _ = make()
    die(procs, "ep1", 0)                     # the engine's shutdown reached it: a stop
    assert not sup.replace("ep1") and events.sent == []
    sup, procs, events, _, _ = make("--elastic_max_restarts=0")
    sup.respawn_only = True
    die(procs, "ep1")
    assert not sup.replace("ep1")


def test_an_illegal_transition_is_counted_not_raised():
    sup, *_ = make()
    sup._to("ep1", W.READY)                  # serving -> ready is not in the table
    assert sup.illegal == 1
