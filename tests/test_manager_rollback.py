"""The manager is the one owner of the deployed placement: with the real policy and gate, an
aborted layer is planned again from what the workers run, a committed one is not re-published,
and the gate threshold comes from the config. Also: typed config only, stats defaults."""

import logging

import numpy as np
import pytest
from manager_util import Clock

from xllm_eplb.config import Config, EplbConfig
from xllm_eplb.eplb.info import NO_LAYER
from xllm_eplb.eplb.manager import EplbManager
from xllm_eplb.eplb.manager_stats import ManagerStats
from xllm_eplb.eplb.placement import initial_phy2log
from xllm_eplb.sim.workers import SimWorkers

D, E, R = 4, 16, 1
LOAD = np.array([[4000, 2000, 1500, 1000] + [50] * 12], dtype=np.int64)


def manager(**kw):
    cfg = EplbConfig(ep_size=D, redundant_experts_num=R, eplb_update_interval=0.0,
                     eplb_prepare_timeout_seconds=1.0, eplb_policy_kind="balanced", **kw)
    clock = Clock()
    mgr = EplbManager(cfg, 1, E, clock=clock, runner="sync")
    return mgr, clock, SimWorkers(mgr.active_placement, D, delays=1)


def step(mgr, clock, workers, prepared: list):
    """One forward with the same load; records the expert ids of every prepare sent."""
    info = mgr.eplb_info(True)
    if info.prepare_layer_id != NO_LAYER:
        prepared.append(info.expert_ids.tolist())
    workers.before_forward(info)
    cnt = workers.counters(LOAD)
    mgr.on_outputs(cnt, *workers.after_forward(info))
    clock.advance(0.05)
    mgr.tick()
    assert (mgr.active_placement == workers.placement).all()


def test_aborted_layer_is_replanned_from_the_deployed_table_then_committed_once(caplog):
    init = initial_phy2log(E, D, R).tolist()
    mgr, clock, workers = manager()
    workers.delays = [1, None, 1, 1]                       # rank 1 never finishes a prepare
    sent: list = []
    for _ in range(3):
        step(mgr, clock, workers, sent)
    assert len(sent) == 1 and sent[0] != init              # round 1 published layer 0
    clock.advance(1.5)                                     # past the 1 s prepare timeout
    with caplog.at_level(logging.WARNING):
        mgr.tick()
    assert mgr.stats()["layers_timed_out"] == 1 and "timed out" in caplog.text
    assert mgr.active_placement[0].tolist() == init        # never deployed
    workers.delays = [1, 1, 1, 1]
    for _ in range(6):
        step(mgr, clock, workers, sent)
    st = mgr.stats()
    assert len(sent) == 2 and sent[1] == sent[0]           # same plan from the same table
    assert st["layers_committed"] == 1 and mgr.active_placement[0].tolist() == sent[0]
    published = st["layers_published"]
    for _ in range(10):                                    # more rounds, same load
        step(mgr, clock, workers, sent)
    st = mgr.stats()
    assert st["rounds"] > 2 and st["layers_published"] == published == 2 and len(sent) == 2


def test_gate_threshold_comes_from_the_config():
    mgr, clock, workers = manager(eplb_min_peak_load_improvement=1.0)
    sent: list = []
    for _ in range(10):
        step(mgr, clock, workers, sent)
    st = mgr.stats()
    assert st["rounds"] >= 5 and st["layers_published"] == 0 and not sent


def test_manager_takes_the_eplb_section_only():
    cfg = Config(eplb=EplbConfig(ep_size=D))
    with pytest.raises(TypeError, match=r"EplbConfig \(cfg.eplb\), got Config"):
        EplbManager(cfg, 1, E, runner="sync")
    mgr = EplbManager(cfg.eplb, 1, E, runner="sync")
    assert mgr.ep_size == D and mgr.slots == E // D + R


def test_fresh_manager_reports_the_declared_defaults():
    mgr, clock, _ = manager()
    st = mgr.stats()
    want = ManagerStats(heartbeat_at=clock.t, manager_heartbeat_at=clock.t, policy="balanced",
                        timer_deadline=None, next_round=mgr.next_round()).as_dict()
    assert st == want
