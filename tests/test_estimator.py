"""LoadEstimator: window, decay, trend extrapolation, hot/cold classification."""

import numpy as np
import pytest

from xllm_eplb.eplb.estimator import LoadEstimator


def test_empty_estimate_is_zero():
    est = LoadEstimator(2, 3)
    assert est.estimate().shape == (2, 3) and not est.estimate().any()


def test_decayed_mean_weights_recent_batches_more():
    est = LoadEstimator(1, 2, window=4, decay=0.5)
    est.observe(np.array([[0, 8]]))
    est.observe(np.array([[8, 0]]))
    # weights oldest..newest = 0.5, 1 -> (0*0.5 + 8) / 1.5 and (8*0.5 + 0) / 1.5
    np.testing.assert_allclose(est.estimate(), [[8 / 1.5, 4 / 1.5]])


def test_window_forgets_old_batches():
    est = LoadEstimator(1, 2, window=2, decay=1.0)
    for row in ([100, 0], [0, 4], [0, 6]):
        est.observe(np.array([row]))
    np.testing.assert_allclose(est.estimate(), [[0, 5]])
    np.testing.assert_array_equal(est.as_counts(2), [[0, 10]])


def test_trend_extrapolates_linear_growth():
    est = LoadEstimator(1, 2, window=8, decay=1.0, trend=True, horizon=1)
    for t in range(8):
        est.observe(np.array([[10 + 2 * t, 50 - 5 * t]]))
    # next batch t=8: 26 and 10 (exact for a line whatever the weights)
    np.testing.assert_allclose(est.estimate(), [[26, 10]])
    est2 = LoadEstimator(1, 1, window=4, decay=0.85, trend=True, horizon=10)
    for t in range(4):
        est2.observe(np.array([[30 - 10 * t]]))
    assert est2.estimate()[0, 0] == 0.0                          # clipped at 0


def test_hot_cold_classification():
    est = LoadEstimator(1, 4)
    est.observe(np.array([[160, 100, 60, 80]]))                  # mean 100
    hot, cold = est.classify()
    assert hot.tolist() == [[True, False, False, False]]
    assert cold.tolist() == [[False, False, True, False]]


@pytest.mark.parametrize("kw", [dict(window=0), dict(decay=0.0), dict(decay=1.5)])
def test_bad_parameters(kw):
    with pytest.raises(ValueError, match="eplb_estimator"):
        LoadEstimator(1, 1, **kw)
