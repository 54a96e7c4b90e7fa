"""Shared helpers of the EplbManager tests: a fake clock, a scripted policy, output builders."""

import numpy as np

from xllm_eplb.config import EplbConfig
from xllm_eplb.eplb.manager import EplbManager

NO = -1


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t

    def advance(self, dt):
        self.t += dt


class RecordingPolicy:
    """Returns a scripted candidate per round and records every call (xLLM's test policy)."""

    name = "recording"

    def __init__(self, candidates):
        self.candidates = list(candidates)    # per round: (cand [L, D*S], update [L])
        self.seed = None
        self.calls = []                        # (logical, physical) per round
        self.commits, self.aborts = [], []

    def initialize(self, phy2log):
        self.seed = np.array(phy2log)

    def rebalance(self, logical, physical=None):
        self.calls.append((np.array(logical), np.array(physical)))
        cand, upd = self.candidates[min(len(self.calls), len(self.candidates)) - 1]
        return np.array(cand, dtype=np.int64), np.array(upd, dtype=bool)

    def commit_layer(self, layer):
        self.commits.append(layer)

    def abort_layer(self, layer):
        self.aborts.append(layer)


def make(policy, layers=1, ep=2, experts=2, redundant=0, interval=0.0, timeout=1.0, **kw):
    cfg = EplbConfig(ep_size=ep, redundant_experts_num=redundant, eplb_update_interval=interval,
                     eplb_prepare_timeout_seconds=timeout)
    clock = Clock()
    mgr = EplbManager(cfg, layers, ep, experts, policy=policy, clock=clock, runner="sync",
                      use_estimator=False, **kw)
    return mgr, clock


def counters(*per_rank):
    """Per-rank per-slot counts ([L][S] lists) -> prefix-sum counters."""
    return [np.cumsum(np.array(r, dtype=np.int64), axis=1) for r in per_rank]


def out(mgr, loads=None, prepared=None, act=NO):
    loads = loads if loads is not None else [[[0] * mgr.slots] * mgr.num_layers] * mgr.ep_size
    mgr.on_outputs(counters(*loads), prepared or [NO] * mgr.ep_size, act)


SWAP = ([[1, 0]], [True])
