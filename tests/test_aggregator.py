"""EplbAggregator: prefix-sum decode, physical/logical windows, placement epochs (xLLM
eplb_aggregator_test scenarios plus epoch, decay and bad-input checks)."""

import numpy as np
import pytest

from xllm_eplb.eplb.aggregator import (
    CounterShapeError,
    EplbAggregator,
    aggregate,
    decode_counters,
)
from xllm_eplb.eplb.placement import logical_loads


def _c(*rows):
    """One rank's counters [L, S] from per-layer prefix-sum rows."""
    return np.array(rows, dtype=np.int64)


def test_single_layer_two_devices_scatters_deltas_into_global_load():
    logical = np.zeros((1, 4), dtype=np.int64)
    aggregate(logical, None, np.array([[0, 1, 2, 3]]), [_c([5, 8]), _c([2, 9])])
    assert logical.tolist() == [[5, 3, 2, 7]]


def test_preserves_measured_physical_slot_load():
    logical = np.zeros((1, 4), dtype=np.int64)
    physical = np.zeros((1, 2, 2), dtype=np.int64)
    aggregate(logical, physical, np.array([[0, 1, 2, 3]]), [_c([5, 8]), _c([2, 9])])
    assert physical.tolist() == [[[5, 3], [2, 7]]]


def test_accumulates_across_calls():
    logical = np.zeros((1, 4), dtype=np.int64)
    physical = np.zeros((1, 2, 2), dtype=np.int64)
    ids = np.array([[0, 1, 2, 3]])
    aggregate(logical, physical, ids, [_c([5, 8]), _c([2, 9])])
    aggregate(logical, physical, ids, [_c([1, 1]), _c([0, 4])])   # fresh per-step counters
    assert logical.tolist() == [[6, 3, 2, 11]]
    assert physical.tolist() == [[[6, 3], [2, 11]]]


def test_honors_post_migration_expert_id_map():
    # expert 0 lives on slot 0 (rank 0) and slot 2 (rank 1): its replicas sum (4 + 9 = 13)
    logical = np.zeros((1, 3), dtype=np.int64)
    aggregate(logical, None, np.array([[0, 1, 0, 2]]), [_c([4, 6]), _c([9, 10])])
    assert logical.tolist() == [[13, 2, 1]]


def test_processes_layers_independently():
    logical = np.zeros((2, 4), dtype=np.int64)
    ids = np.array([[0, 1, 2, 3], [3, 2, 1, 0]])
    aggregate(logical, None, ids, [_c([1, 3], [10, 10]), _c([0, 5], [0, 7])])
    assert logical.tolist() == [[1, 2, 0, 5], [7, 0, 0, 10]]


def test_window_epoch_commit_and_decay():
    agg = EplbAggregator(num_layers=1, ep_size=2, slots_per_rank=2, num_logical=4)
    ids = np.array([[0, 1, 2, 3]])
    assert agg.empty
    d = agg.decode([_c([5, 8]), _c([2, 9])])
    assert agg.add(d, ids, epoch=0).tolist() == [[5, 3, 2, 7]]
    assert agg.sample_count == 1 and not agg.empty
    agg.decay()
    assert agg.physical.tolist() == [[[2, 1], [1, 3]]]          # int64(x * 0.5)
    assert agg.logical.tolist() == [[2, 1, 1, 3]]
    assert agg.sample_count == 1                                # decay keeps the count
    assert agg.commit() == 1
    assert agg.empty and not agg.physical.any() and not agg.logical.any()
    assert agg.add(d, ids, epoch=0) is None                # stale: dropped
    assert agg.empty and agg.dropped_stale == 1
    assert agg.add(d, ids, epoch=1) is not None


@pytest.mark.parametrize("counters, msg", [
    ([_c([1, 2])], "from 1 ranks"),
    ([_c([1, 2]), _c([1, 2, 3])], "rank 1: counters of shape (1, 3)"),
    ([_c([1, 2]), np.array([1, 2])], "rank 1"),
    ([_c([3, 2]), _c([1, 2])], "prefix sum decreases"),
])
def test_bad_counters_are_rejected(counters, msg):
    with pytest.raises(CounterShapeError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        decode_counters(counters, num_layers=1, slots_per_rank=2, ep_size=2)


def test_vectorised_scatter_matches_loop():
    rng = np.random.default_rng(0)
    layers, d, s, e = 5, 4, 3, 8
    deltas = rng.integers(0, 100, size=(layers, d, s))
    placement = np.stack([rng.permutation(np.r_[np.arange(e), rng.integers(0, e, d * s - e)])
                          for _ in range(layers)])
    want = np.zeros((layers, e), dtype=np.int64)
    for lay in range(layers):
        for k in range(d * s):
            want[lay, placement[lay, k]] += deltas[lay].ravel()[k]
    assert (logical_loads(deltas, placement, e) == want).all()
