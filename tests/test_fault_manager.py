"""The prepare timeout is checked before an output's tokens (issue #17): a rank that froze
mid-round blocks the forward, so its ready token and the deadline arrive in the same output;
the layer must time out, roll back, ignore the late token, and the next round must succeed.
Deterministic: fake clock, sync runner."""

import logging

from manager_util import NO, SWAP, RecordingPlanner, make, out, timed_out_layers


def _start_round(mgr):
    out(mgr, [[[10]], [[0]]])
    mgr.tick()
    info = mgr.eplb_info(True)
    assert (info.prepare_layer_id, info.prepare_token) == (0, 1)


def test_ready_tokens_in_the_output_that_ends_a_freeze_are_late(caplog):
    pol = RecordingPlanner([SWAP])
    mgr, clock = make(pol, timeout=1.0)
    _start_round(mgr)
    out(mgr, prepared=[1, NO])                 # rank 0 ready; rank 1 then freezes the forward
    clock.advance(8.0)                         # no tick runs: the step loop is blocked too
    with caplog.at_level(logging.WARNING):
        out(mgr, prepared=[NO, 1])             # the frozen rank's token, 8 s after the deadline
    assert timed_out_layers(caplog) == [0]
    assert "EPLB layer 0 prepare progress timed out after 1s" in caplog.text
    assert "EPLB ignoring stale prepare token got=1" in caplog.text
    st = mgr.stats()
    assert (st["layers_timed_out"], st["stale_tokens"], st["layers_committed"]) == (1, 1, 0)
    assert not st["round_in_progress"]
    assert mgr.eplb_info(True).update_layer_id == NO          # never activated
    assert mgr.active_placement.tolist() == [[0, 1]]          # rolled back: never deployed
    # the next round re-plans layer 0 from what the workers run and commits it
    mgr.tick()
    assert len(pol.calls) == 2 and pol.calls[1][2].tolist() == [[0, 1]]
    info = mgr.eplb_info(True)
    assert (info.prepare_layer_id, info.prepare_token) == (0, 2)
    out(mgr, prepared=[2, 2])
    info = mgr.eplb_info(True)
    assert (info.update_layer_id, info.activation_token) == (0, 2)
    out(mgr, act=2)
    assert mgr.active_placement.tolist() == [[1, 0]] and mgr.stats()["layers_committed"] == 1


def test_no_output_at_all_until_after_twice_the_budget_is_late_too(caplog):
    mgr, clock = make(RecordingPlanner([SWAP]), timeout=1.0)
    _start_round(mgr)
    clock.advance(2.5)                         # the first forward after dispatch froze
    with caplog.at_level(logging.WARNING):
        out(mgr, prepared=[1, 1])
    assert "EPLB layer 0 output timed out after 2s" in caplog.text
    assert mgr.stats()["stale_tokens"] == 2 and mgr.eplb_info(True).update_layer_id == NO
    assert mgr.active_placement.tolist() == [[0, 1]]


def test_tokens_inside_the_budget_still_commit():
    mgr, clock = make(RecordingPlanner([SWAP]), timeout=1.0)
    _start_round(mgr)
    out(mgr, prepared=[1, NO])
    clock.advance(0.99)
    out(mgr, prepared=[NO, 1])                 # on time (strictly within the budget)
    info = mgr.eplb_info(True)
    assert (info.update_layer_id, info.activation_token) == (0, 1)
    clock.advance(5.0)                         # the activation's own wait has no prepare budget
    out(mgr, act=1)
    assert mgr.active_placement.tolist() == [[1, 0]]
    assert mgr.stats()["layers_timed_out"] == 0
