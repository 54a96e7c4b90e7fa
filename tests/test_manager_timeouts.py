"""EplbManager timeouts (both kinds), deferred activations and heartbeats, deterministic with a
fake clock (split from ``test_manager.py``)."""

import logging

import numpy as np
from manager_util import NO, SWAP, Clock, RecordingPlanner, make, out, timed_out_layers

from xllm_eplb.config import EplbConfig
from xllm_eplb.eplb.manager import EplbManager


def test_prepare_timeout_skips_stalled_layer_and_ignores_old_token(caplog):
    pol = RecordingPlanner([SWAP])
    mgr, clock = make(pol)
    out(mgr, [[[10]], [[0]]])
    mgr.tick()
    assert mgr.eplb_info(True).prepare_token == 1
    out(mgr, prepared=[1, NO])                             # only rank 0 is ready
    clock.advance(1.01)
    with caplog.at_level(logging.WARNING):
        mgr.tick()
    assert timed_out_layers(caplog) == [0] and mgr.stats()["layers_timed_out"] == 1
    assert "EPLB layer 0 prepare progress timed out after 1s" in caplog.text
    assert mgr.active_placement.tolist() == [[0, 1]]       # never deployed
    mgr.tick()                                             # next round republishes layer 0
    assert pol.calls[1][2].tolist() == [[0, 1]]            # planned from what workers run
    info = mgr.eplb_info(True)
    assert info.prepare_layer_id == 0 and info.prepare_token == 2
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        out(mgr, prepared=[1, 1])                          # late tokens of the aborted attempt
    assert "stale prepare token" in caplog.text
    assert mgr.eplb_info(True).update_layer_id == NO
    out(mgr, prepared=[2, 2])
    info = mgr.eplb_info(True)
    assert (info.update_layer_id, info.activation_token) == (0, 2)
    out(mgr, act=2)
    assert mgr.active_placement.tolist() == [[1, 0]]


def test_prepare_timeout_starts_after_worker_output_is_observable(caplog):
    pol = RecordingPlanner([SWAP])
    mgr, clock = make(pol, timeout=1.0)
    out(mgr, [[[10]], [[0]]])
    mgr.tick()
    mgr.eplb_info(True)
    clock.advance(1.2)                                     # no output yet: 2x budget applies
    with caplog.at_level(logging.WARNING):
        mgr.tick()
        assert not timed_out_layers(caplog) and mgr.stats()["layers_timed_out"] == 0
        out(mgr)                                           # first output: 1x budget starts now
        clock.advance(0.9)
        mgr.tick()
    assert not timed_out_layers(caplog) and mgr.stats()["layers_timed_out"] == 0
    out(mgr, prepared=[1, 1])
    assert mgr.eplb_info(True).update_layer_id == 0


def test_prepare_dispatch_without_worker_output_eventually_aborts(caplog):
    pol = RecordingPlanner([SWAP, ([[0, 1]], [False])])
    mgr, clock = make(pol, timeout=1.0)
    out(mgr, [[[10]], [[0]]])
    mgr.tick()
    mgr.eplb_info(True)
    clock.advance(2.0)
    with caplog.at_level(logging.WARNING):
        mgr.tick()
        assert not timed_out_layers(caplog)                # exactly 2x: not yet (strict >)
        clock.advance(0.01)
        mgr.tick()
    assert timed_out_layers(caplog) == [0] and mgr.stats()["layers_timed_out"] == 1
    assert "EPLB layer 0 output timed out after 2s" in caplog.text
    assert not mgr.stats()["round_in_progress"]
    assert mgr.active_placement.tolist() == [[0, 1]]


def test_defers_pending_activation_until_weight_update_is_allowed(caplog):
    pol = RecordingPlanner([SWAP])
    mgr, clock = make(pol)
    out(mgr, [[[10]], [[0]]])
    mgr.tick()
    mgr.eplb_info(True)
    out(mgr, prepared=[1, 1])
    before = mgr.stats()
    with caplog.at_level(logging.WARNING):
        for _ in range(5):
            info = mgr.eplb_info(False)
            assert info.empty and info.prepare_token == NO and info.activation_token == NO
            clock.advance(10.0)                            # longer than any timeout
            out(mgr)
            mgr.tick()
    assert mgr.stats()["waiting_on"] == before["waiting_on"] == "activation_send:layer=0"
    assert not timed_out_layers(caplog) and mgr.stats()["layers_timed_out"] == 0
    info = mgr.eplb_info(True)
    assert (info.update_layer_id, info.activation_token) == (0, 1)
    out(mgr, act=1)
    assert mgr.active_placement.tolist() == [[1, 0]]


def test_heartbeats_and_decreasing_counters(caplog):
    pol = RecordingPlanner([SWAP])
    cfg = EplbConfig(ep_size=2, redundant_experts_num=0, eplb_update_interval=0.0,
                     eplb_prepare_timeout_seconds=100.0, eplb_heartbeat_seconds=1.0)
    clock = Clock()
    with caplog.at_level(logging.INFO):
        mgr = EplbManager(cfg, 1, 2, planner=pol, clock=clock, runner="sync")
        out(mgr, [[[10]], [[0]]])
        mgr.on_outputs([np.array([[5]]), np.array([[2.0]])], [NO, NO], NO)     # float counters
        mgr.tick()
        mgr.eplb_info(True)                                # layer 0 preparing, never acked
        clock.advance(1.5)
        mgr.tick()
    assert "EPLB manager start policy=recording layers=1 devices=2 device_experts=1" \
        in caplog.text
    assert "EPLB rebalance policy=recording layers_updated=1/1" in caplog.text
    assert "EPLB heartbeat rebalance_thread policy=recording batches_since_last=1" \
        in caplog.text
    assert "EPLB heartbeat manager_thread layers_completed=0 layers_timed_out=0 " \
        "waiting_on=" in caplog.text and "prepare:layer=0:token=1" in caplog.text
    assert "dtype float64" in caplog.text and mgr.stats()["samples_rejected"] == 1


def test_stats_heartbeats_follow_the_loop_and_the_step_loop():
    """``heartbeat_at`` = end of the last rebalance pass, ``manager_heartbeat_at`` = last
    on_outputs/tick (both in the manager's clock), ``policy_cpu_seconds`` only grows."""
    pol = RecordingPlanner([SWAP])
    mgr, clock = make(pol)
    st = mgr.stats()
    assert st["heartbeat_at"] == st["manager_heartbeat_at"] == 100.0
    assert st["policy_cpu_seconds"] == 0.0
    clock.advance(2.0)
    out(mgr, [[[10]], [[0]]])
    st = mgr.stats()
    assert st["manager_heartbeat_at"] == 102.0 and st["heartbeat_at"] == 100.0
    clock.advance(3.0)
    mgr.tick()                                             # sync runner: the pass runs here
    st = mgr.stats()
    assert st["heartbeat_at"] == st["manager_heartbeat_at"] == 105.0 and st["rounds"] == 1
    cpu = st["policy_cpu_seconds"]
    assert cpu > 0.0
    assert mgr.eplb_info(True).prepare_token == 1
    assert mgr.stats()["manager_heartbeat_at"] == 105.0    # eplb_info is not a heartbeat
    clock.advance(1.0)
    mgr.tick()
    st = mgr.stats()
    assert st["heartbeat_at"] == 106.0 and st["policy_cpu_seconds"] >= cpu
