"""EplbManager state machine, deterministic with a fake clock (xLLM eplb_manager_test scenarios,
overwrite guard, allow=False, late tokens, bad outputs). Timeouts and heartbeats:
``test_manager_timeouts.py``."""

import logging

import numpy as np
import pytest
from manager_util import NO, SWAP, Clock, RecordingPlanner, activated_layers, counters, make, out

from xllm_eplb.config import EplbConfig
from xllm_eplb.eplb.manager import EplbManager


def test_plans_against_the_active_distribution():
    pol = RecordingPlanner([SWAP])
    mgr, _ = make(pol)
    assert mgr.active_placement.tolist() == [[0, 1]] and mgr.placement_epoch == 0
    out(mgr, [[[10]], [[0]]])
    mgr.tick()
    assert pol.calls[0][2].tolist() == [[0, 1]]


def test_rebalance_timer_processes_samples_without_followup_traffic():
    pol = RecordingPlanner([SWAP])
    mgr, clock = make(pol, interval=1.0)
    mgr.tick()
    clock.advance(5.0)
    mgr.tick()
    assert not pol.calls                                   # no sample: timer not armed
    out(mgr, [[[3]], [[1]]])
    mgr.tick()                                             # arms at the first valid sample
    clock.advance(0.1)
    mgr.tick()
    assert not pol.calls
    clock.advance(0.95)
    mgr.tick()                                             # fires without more traffic
    assert len(pol.calls) == 1 and mgr.stats()["rounds"] == 1


def test_never_runs_the_policy_on_an_empty_window():
    pol = RecordingPlanner([SWAP])
    mgr, clock = make(pol, interval=0.0)
    for _ in range(3):
        clock.advance(10)
        mgr.tick()
    assert not pol.calls


def test_queued_load_uses_placement_active_at_submission(caplog):
    caplog.set_level(logging.INFO)
    pol = RecordingPlanner([SWAP, ([[1, 0]], [False])])
    mgr, clock = make(pol)
    out(mgr, [[[10]], [[0]]])
    mgr.tick()
    assert pol.calls[0][1].tolist() == [[[10], [0]]]
    info = mgr.eplb_info(True)
    assert info.prepare_layer_id == 0 and info.prepare_token == 1
    assert info.expert_ids.tolist() == [1, 0] and info.update_layer_id == NO
    out(mgr, [[[1]], [[1]]])                               # token -1: nothing acknowledged
    assert mgr.eplb_info(True).update_layer_id == NO
    out(mgr, prepared=[1, 1])
    info = mgr.eplb_info(True)
    assert (info.update_layer_id, info.activation_token) == (0, 1)
    assert mgr.active_placement.tolist() == [[0, 1]]       # not before the output returns
    out(mgr, [[[7]], [[7]]], act=1)                        # measured with the OLD weights
    assert mgr.active_placement.tolist() == [[1, 0]] and activated_layers(caplog) == [0]
    assert mgr.placement_epoch == 1 and not mgr.window_physical().any()
    out(mgr, [[[2]], [[4]]])                               # slot 0 now holds expert 1
    mgr.tick()
    logical, physical, deployed = pol.calls[1]
    assert logical.tolist() == [[4, 2]] and physical.tolist() == [[[2], [4]]]
    assert deployed.tolist() == [[1, 0]]                   # the committed row, not the seed


def test_window_halves_after_each_round():
    pol = RecordingPlanner([([[0, 1]], [False])])
    mgr, _ = make(pol)
    out(mgr, [[[10]], [[5]]])
    mgr.tick()
    assert mgr.window_physical().tolist() == [[[5], [2]]]
    mgr.tick()
    assert pol.calls[1][1].tolist() == [[[5], [2]]]        # next round: halved window


def test_publishes_next_prepare_with_pending_activation(caplog):
    caplog.set_level(logging.INFO)
    cand = [[1, 0], [1, 0]]
    pol = RecordingPlanner([(cand, [True, True])])
    mgr, _ = make(pol, layers=2)
    out(mgr, [[[10], [10]], [[0], [0]]])
    mgr.tick()
    info = mgr.eplb_info(True)
    assert (info.prepare_layer_id, info.prepare_token) == (0, 1)
    out(mgr, prepared=[1, 1])
    info = mgr.eplb_info(True)                             # activation of 0 + prepare of 1
    assert (info.update_layer_id, info.activation_token) == (0, 1)
    assert (info.prepare_layer_id, info.prepare_token) == (1, 2)
    out(mgr, prepared=[2, 2], act=1)
    assert mgr.active_placement.tolist() == [[1, 0], [0, 1]]   # layer 0 only
    info = mgr.eplb_info(True)
    assert (info.update_layer_id, info.activation_token, info.prepare_layer_id) == (1, 2, NO)
    out(mgr, act=2)
    assert mgr.active_placement.tolist() == cand and activated_layers(caplog) == [0, 1]
    st = mgr.stats()
    assert st["layers_committed"] == 2 and st["slots_moved"] == 4 and st["weight_copies"] == 4


def test_allow_false_changes_no_state():
    pol = RecordingPlanner([SWAP])
    mgr, _ = make(pol)
    out(mgr, [[[10]], [[0]]])
    mgr.tick()
    st = mgr.stats()
    assert mgr.eplb_info(False).empty
    assert mgr.stats() == st
    assert mgr.eplb_info(True).prepare_token == 1          # the token was not consumed


def test_overwrite_guard_ready_layer_not_overwritten(caplog):
    """As in xLLM (its overlap-mode bug): while layer 0's activation is unsent, layer 1 is not even
    prepared, so it can never become READY and overwrite layer 0's pending activation."""
    caplog.set_level(logging.INFO)
    cand = [[1, 0], [1, 0], [1, 0]]
    pol = RecordingPlanner([(cand, [True, True, True])])
    mgr, clock = make(pol, layers=3)
    out(mgr, [[[9], [9], [9]], [[1], [1], [1]]])
    mgr.tick()
    assert mgr.eplb_info(True).prepare_layer_id == 0
    out(mgr, prepared=[1, 1])
    # overlap-style: outputs keep arriving, sends are not allowed; late foreign tokens show up
    for tok in (2, 3):
        assert mgr.eplb_info(False).empty
        out(mgr, prepared=[tok, tok])
        mgr.tick()
    st = mgr.stats()
    assert st["waiting_on"] == "activation_send:layer=0" and st["layer_in_flight"] == 0
    info = mgr.eplb_info(True)
    assert (info.update_layer_id, info.activation_token) == (0, 1)
    assert (info.prepare_layer_id, info.prepare_token) == (1, 2)
    out(mgr, prepared=[2, 2], act=1)
    info = mgr.eplb_info(True)
    assert (info.update_layer_id, info.prepare_layer_id) == (1, 2)
    out(mgr, prepared=[3, 3], act=2)
    assert mgr.eplb_info(True).update_layer_id == 2
    out(mgr, act=3)
    assert activated_layers(caplog) == [0, 1, 2] and mgr.active_placement.tolist() == cand


def test_activation_token_only_commits_once_and_stale_ones_warn(caplog):
    caplog.set_level(logging.INFO)
    pol = RecordingPlanner([SWAP, ([[1, 0]], [False])])
    mgr, _ = make(pol)
    out(mgr, [[[10]], [[0]]])
    mgr.tick()
    mgr.eplb_info(True)
    out(mgr, prepared=[1, 1])
    with caplog.at_level(logging.WARNING):
        out(mgr, act=1)                                    # activation not sent yet: foreign
    assert "stale activation completion token" in caplog.text and not activated_layers(caplog)
    mgr.eplb_info(True)
    out(mgr, act=1)
    out(mgr, act=1)                                        # duplicate
    assert activated_layers(caplog) == [0] and mgr.placement_epoch == 1
    assert mgr.stats()["stale_tokens"] == 2


def test_no_new_round_while_previous_round_in_flight():
    pol = RecordingPlanner([SWAP])
    mgr, clock = make(pol)
    out(mgr, [[[10]], [[0]]])
    mgr.tick()
    mgr.eplb_info(True)
    for _ in range(3):
        out(mgr, [[[10]], [[0]]])
        clock.advance(0.1)
        mgr.tick()
    assert len(pol.calls) == 1


def test_bad_worker_output_is_rejected_and_never_aggregated(caplog):
    pol = RecordingPlanner([SWAP])
    mgr, _ = make(pol, interval=100.0)
    with caplog.at_level(logging.WARNING):
        mgr.on_outputs([np.zeros((1, 2), np.int64), np.zeros((1, 1), np.int64)], [NO, NO], NO)
        mgr.on_outputs([np.zeros((1, 1), np.int64)], [NO, NO], NO)
        mgr.on_outputs([np.array([[5]]), np.array([[3]])], [NO], NO)
        mgr.on_outputs([np.zeros((2, 1), np.int64)] * 2, [NO, NO], NO)
    assert caplog.text.count("EPLB rejected worker output") == 4
    st = mgr.stats()
    assert st["samples_rejected"] == 4 and st["window_samples"] == 1   # tokens-only reject
    assert mgr.window_physical().tolist() == [[[5], [3]]]


@pytest.mark.timeout(60)
def test_thread_runner_smoke():
    """Real background thread, real clock: one round end to end, then close."""
    pol = RecordingPlanner([SWAP, ([[1, 0]], [False])])
    cfg = EplbConfig(ep_size=2, redundant_experts_num=0, eplb_update_interval=0.0)
    with EplbManager(cfg, 1, 2, planner=pol, runner="thread") as mgr:
        thread = mgr._runner.thread
        import time
        mgr.on_outputs(counters([[10]], [[0]]), [NO, NO], NO)
        deadline = time.monotonic() + 30
        while mgr.eplb_info(False).empty and not mgr.stats()["round_in_progress"]:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        info = mgr.eplb_info(True)
        assert info.prepare_token == 1
        mgr.on_outputs(counters([[1]], [[1]]), [1, 1], NO)
        info = mgr.eplb_info(True)
        mgr.on_outputs(counters([[1]], [[1]]), [NO, NO], info.activation_token)
        assert mgr.active_placement.tolist() == [[1, 0]]
        st = mgr.stats()
        assert st["policy_cpu_seconds"] > 0.0              # the thread ran a round
        assert time.monotonic() - 30 < st["heartbeat_at"] <= time.monotonic()
        assert st["manager_heartbeat_at"] <= time.monotonic()
    assert not thread.is_alive()


def test_real_balanced_policy_round():
    """The manager built from config with the real `balanced` policy moves the hot expert."""
    pytest.importorskip("xllm_eplb.eplb.policy.balanced")
    cfg = EplbConfig(ep_size=2, redundant_experts_num=1, eplb_update_interval=0.0,
                     eplb_policy_kind="balanced")
    clock = Clock()
    mgr = EplbManager(cfg, 1, 4, clock=clock, runner="sync")
    assert mgr.active_placement.tolist() == [[0, 1, 1, 2, 3, 3]]
    # experts 0 and 1 are hot, both on rank 0
    mgr.on_outputs(counters([[100, 80, 0]], [[5, 5, 0]]), [NO, NO], NO)
    mgr.tick()
    st = mgr.stats()
    assert st["rounds"] == 1 and st["layers_published"] == 1
    info = mgr.eplb_info(True)
    mgr.on_outputs(counters([[0, 0, 0]], [[0, 0, 0]]), [info.prepare_token] * 2, NO)
    info = mgr.eplb_info(True)
    mgr.on_outputs(counters([[0, 0, 0]], [[0, 0, 0]]), [NO, NO], info.activation_token)
    new = mgr.active_placement.reshape(2, 3)
    assert {0, 1} & set(new[1].tolist())                   # a hot expert reached rank 1


def test_policy_gets_the_estimate_and_the_gate_the_raw_window():
    pol = RecordingPlanner([([[0, 1]], [False])])
    cfg = EplbConfig(ep_size=2, redundant_experts_num=0, eplb_update_interval=0.0,
                     eplb_use_estimator=True, eplb_estimator_window=2, eplb_estimator_decay=1.0)
    mgr = EplbManager(cfg, 1, 2, planner=pol, clock=Clock(), runner="sync")
    for loads in ([[[100]], [[0]]], [[[0]], [[10]]], [[[0]], [[30]]]):
        out(mgr, loads)
    mgr.tick()
    logical, physical, _ = pol.calls[0]
    assert logical.tolist() == [[0, 40]]                   # last 2 batches: mean 20 x 2
    assert physical.tolist() == [[[100], [40]]]            # raw measured window


def test_a_replacing_manager_continues_the_cumulative_counters():
    """An elastic shrink or rejoin rebuilds the manager: /eplb/status and the metrics (deltas
    of these totals) must not go back to 0."""
    pol = RecordingPlanner([SWAP])
    old, _ = make(pol)
    out(old, [[[10]], [[0]]])
    old.tick()
    before = old.stats()
    assert before["rounds"] == 1 and before["samples"] >= 1
    new, _ = make(RecordingPlanner([SWAP]))
    new.inherit_counters(old)
    after = new.stats()
    assert {k: after[k] for k in ("rounds", "samples", "layers_published")} == \
        {k: before[k] for k in ("rounds", "samples", "layers_published")}
    out(new, [[[10]], [[0]]])
    new.tick()
    assert new.stats()["rounds"] == 2
