"""The first EPLB round runs after ``eplb_first_round_samples`` samples, not after
``eplb_update_interval`` (issue 41 item 2: xLLM's 1000 s default left EPLB idle for 17 minutes);
the interval paces the later rounds; ``next_round`` says which comes next."""

from __future__ import annotations

import numpy as np
from manager_util import SWAP, Clock, RecordingPlanner, out

from xllm_eplb.config import EplbConfig
from xllm_eplb.eplb.manager import EplbManager

KEEP = ([[0, 1]], [False])          # a round that publishes nothing


def _manager(first: int, interval: float = 1000.0, rounds=(KEEP,)):
    cfg = EplbConfig(ep_size=2, redundant_experts_num=0, eplb_update_interval=interval,
                     eplb_first_round_samples=first)
    planner, clock = RecordingPlanner(list(rounds)), Clock()
    mgr = EplbManager(cfg, 1, 2, planner=planner, clock=clock, runner="sync")
    return mgr, clock, planner


def _skewed(mgr) -> None:
    out(mgr, loads=[[[9]], [[1]]])


def test_the_first_round_runs_at_the_sample_count_not_the_interval():
    mgr, clock, planner = _manager(first=5)
    assert mgr.next_round() == ("after 5 load samples (0 so far; --eplb_first_round_samples) "
                                "or 1000 s after the next load sample (--eplb_update_interval), "
                                "whichever comes first")
    for _ in range(4):
        _skewed(mgr)
        clock.advance(1.0)
        mgr.tick()
    assert planner.calls == [] and "(4 so far" in mgr.next_round()
    assert "or in 997.0 s" in mgr.next_round()
    _skewed(mgr)
    mgr.tick()
    assert len(planner.calls) == 1 and mgr.stats()["rounds"] == 1
    # the window of the round: the 5 skewed samples (rank 0's slot 0 served 9 a step)
    assert np.array(planner.calls[0][1]).sum() == 5 * 10
    # later rounds wait the interval, counted from the first round
    assert mgr.next_round() == "1000 s after the next load sample (--eplb_update_interval)"
    _skewed(mgr)
    mgr.tick()
    assert mgr.next_round() == "in 1000.0 s (--eplb_update_interval)"
    for _ in range(20):
        _skewed(mgr)
        clock.advance(10.0)
        mgr.tick()
    assert len(planner.calls) == 1 and mgr.stats()["next_round"].startswith("in 800.0 s")
    clock.advance(800.0)
    _skewed(mgr)
    mgr.tick()
    assert len(planner.calls) == 2


def test_zero_keeps_xllms_timer_for_the_first_round_too():
    mgr, clock, planner = _manager(first=0, interval=50.0)
    assert mgr.next_round() == "50 s after the next load sample (--eplb_update_interval)"
    for _ in range(40):
        _skewed(mgr)
        clock.advance(1.0)
        mgr.tick()
    assert planner.calls == []
    clock.advance(20.0)
    mgr.tick()
    assert len(planner.calls) == 1


def test_a_first_round_that_commits_restarts_the_interval():
    mgr, clock, planner = _manager(first=3, rounds=(SWAP,))
    for _ in range(3):
        _skewed(mgr)
    mgr.tick()
    assert len(planner.calls) == 1 and mgr.next_round() == "when the round in flight ends"
