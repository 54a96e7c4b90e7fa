"""`EplbManager(initial=)`: a server started from a placement file (``--eplb_init_placement``)
deploys, measures and plans from that table, and commits on top of it."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from manager_util import RecordingPlanner, activated_layers, make, out

# 2 layers, 2 ranks, 2 experts, 1 redundant slot: [D*S] = 4; the file's table per layer
START = [[1, 0, 0, 1], [0, 1, 1, 0]]
NEXT = [[0, 1, 1, 0], [0, 1, 1, 0]]


def test_measures_plans_and_commits_from_the_initial_table(caplog):
    caplog.set_level(logging.INFO)
    pol = RecordingPlanner([(NEXT, [True, False])])
    mgr, _ = make(pol, layers=2, redundant=1, initial=np.array(START))
    assert mgr.active_placement.tolist() == START and mgr.placement_epoch == 0
    # rank 0 slots (3, 1), rank 1 slots (0, 2) in both layers, scattered under START
    out(mgr, [[[3, 1], [3, 1]], [[0, 2], [0, 2]]])
    mgr.tick()
    logical, _, deployed = pol.calls[0]
    assert deployed.tolist() == START
    assert logical.tolist() == [[1 + 0, 3 + 2], [3 + 2, 1 + 0]]
    info = mgr.eplb_info(True)
    assert info.prepare_layer_id == 0 and info.expert_ids.tolist() == NEXT[0]
    out(mgr, prepared=[info.prepare_token] * 2)
    act = mgr.eplb_info(True)
    out(mgr, act=act.activation_token)
    assert activated_layers(caplog) == [0]
    assert mgr.active_placement.tolist() == [NEXT[0], START[1]]   # layer 1 kept the file's row
    assert mgr.stats()["slots_moved"] == 4


def test_a_table_of_the_wrong_shape_is_refused():
    with pytest.raises(ValueError, match=r"initial placement of shape \(1, 4\), expected"):
        make(RecordingPlanner([]), layers=2, redundant=1, initial=np.array([START[0]]))
    mgr, _ = make(RecordingPlanner([]), layers=2, redundant=1)
    assert mgr.active_placement.tolist() == [[0, 0, 1, 1]] * 2     # default: xLLM's layout
