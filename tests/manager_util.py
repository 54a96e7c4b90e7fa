"""Shared helpers of the EplbManager tests: a fake clock, a scripted planner, output builders,
commit/abort readers of the manager's log lines."""

import numpy as np

from xllm_eplb.config import EplbConfig
from xllm_eplb.eplb.gate import Round
from xllm_eplb.eplb.manager import EplbManager

NO = -1


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t

    def advance(self, dt):
        self.t += dt


class RecordingPlanner:
    """The manager's round function, scripted: returns a given (cand, update) per round and
    records every call (xLLM's test policy). It bypasses the gate, which has its own tests."""

    name = "recording"

    def __init__(self, rounds):
        self.rounds = list(rounds)             # per round: (cand [L, D*S], update [L])
        self.calls = []                        # (logical, physical, deployed) per round

    def __call__(self, logical, physical, deployed):
        self.calls.append((np.array(logical), np.array(physical), np.array(deployed)))
        cand, upd = self.rounds[min(len(self.calls), len(self.rounds)) - 1]
        return Round(np.array(cand, dtype=np.int64), np.array(upd, dtype=bool))


def make(planner, layers=1, ep=2, experts=2, redundant=0, interval=0.0, timeout=1.0, **kw):
    cfg = EplbConfig(ep_size=ep, redundant_experts_num=redundant, eplb_update_interval=interval,
                     eplb_prepare_timeout_seconds=timeout)
    clock = Clock()
    mgr = EplbManager(cfg, layers, experts, planner=planner, clock=clock, runner="sync", **kw)
    return mgr, clock


def activated_layers(caplog):
    """Layers committed, in order, from the manager's ``EPLB layer activated`` log lines."""
    return [int(r.getMessage().split("layer=")[1].split()[0]) for r in caplog.records
            if r.getMessage().startswith("EPLB layer activated")]


def timed_out_layers(caplog):
    """Layers aborted by a timeout, in order, from the manager's warning lines."""
    return [int(r.getMessage().split()[2]) for r in caplog.records
            if r.getMessage().startswith("EPLB layer ") and " timed out after " in
            r.getMessage()]


def counters(*per_rank):
    """Per-rank per-slot counts ([L][S] lists) -> prefix-sum counters."""
    return [np.cumsum(np.array(r, dtype=np.int64), axis=1) for r in per_rank]


def out(mgr, loads=None, prepared=None, act=NO):
    loads = loads if loads is not None else [[[0] * mgr.slots] * mgr.num_layers] * mgr.ep_size
    mgr.on_outputs(counters(*loads), prepared or [NO] * mgr.ep_size, act)


SWAP = ([[1, 0]], [True])
