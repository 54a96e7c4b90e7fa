"""Noise-aware placement: ``incremental`` with ``peak_z`` / ``step_tokens`` (issue 15 item 5)."""

from pathlib import Path

import numpy as np
import pytest

from xllm_eplb.config import EplbConfig
from xllm_eplb.eplb import replica_routing as rr
from xllm_eplb.eplb.loads import read_loads
from xllm_eplb.eplb.placement import initial_phy2log
from xllm_eplb.eplb.policy import make_policy, policy_from_config
from xllm_eplb.eplb.policy.noise_aware import noise_weights
from xllm_eplb.errors import ConfigError

DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "sglang_ep_statistics"


def test_noise_weights_are_mean_plus_z_sigma():
    w = noise_weights(np.array([[3.0, 1.0, 0.0]]), 400, 2.0)
    m = np.array([300.0, 100.0, 0.0])
    assert np.allclose(w[0], m + 2.0 * np.sqrt(m))
    assert np.allclose(noise_weights(np.array([3.0, 1.0]), 400, 0.0), [300.0, 100.0])


@pytest.mark.parametrize("opts,msg", [
    (dict(peak_z=1.0), "peak_z=1.0 needs step_tokens > 0"),
    (dict(peak_z=-0.5, step_tokens=10), "peak_z=-0.5: must be a finite number >= 0"),
    (dict(peak_z=float("nan"), step_tokens=10), "must be a finite number >= 0"),
    (dict(peak_z=1, step_tokens=-3), "step_tokens=-3: must be a finite number >= 0"),
    (dict(peak_z="x", step_tokens=3), "must be numbers"),
    (dict(peak_sigma=1), "unknown option 'peak_sigma'"),
])
def test_bad_options_name_the_rule(opts, msg):
    with pytest.raises(ConfigError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        make_policy("incremental", 4, 16, 1, **opts)


def test_config_reaches_the_policy_and_changes_the_plan():
    cfg = EplbConfig(ep_size=4, redundant_experts_num=1, eplb_policy_kind="incremental",
                     eplb_peak_z=2.0, eplb_step_tokens=64)
    pol = policy_from_config(cfg, 16)
    assert pol.peak_z == 2.0 and pol.step_tokens == 64.0
    load = np.array([[400, 300, 200, 100] + [10] * 12], dtype=np.int64)
    init = initial_phy2log(16, 4, 1)[None, :]
    mean = make_policy("incremental", 4, 16, 1).plan_table(load, init)[0]
    noisy = pol.plan_table(load, init)[0]
    cnt = [np.bincount(t, minlength=16) for t in (mean, noisy)]
    # planning for the per-step peak gives the cold experts more weight relative to the hot ones
    assert cnt[1][:4].sum() <= cnt[0][:4].sum()
    assert (cnt[1] >= 1).all() and noisy.size == 20


def _step_peak(table, loads, layers, tpr, steps, seed):
    """Mean over (layer, step) of the balanced-routed max/mean rank load, top-8 Gumbel sampling."""
    d, top = 32, 8
    rng = np.random.default_rng(seed)
    out = []
    for li in layers:
        plan = rr.prepare(table[li], loads.shape[1], d)
        logp = np.log(np.maximum(loads[li] / loads[li].sum(), 1e-300))
        for _ in range(steps):
            keys = logp[None, :] - np.log(-np.log(rng.random((d * tpr, logp.size))))
            pick = np.argpartition(-keys, top, axis=1)[:, :top]
            flat = np.repeat(np.arange(d), tpr * top) * logp.size + pick.ravel()
            c = np.bincount(flat, minlength=d * logp.size).reshape(d, -1)
            out.append(rr.rank_loads(rr.slot_loads(c, plan, "balanced"), d).max() / (c.sum() / d))
    return float(np.mean(out))


@pytest.mark.skipif(not (DATA / "decode_in1000out1000.json").is_file(),
                    reason="../shared/data not present")
def test_noise_aware_lowers_the_step_peak_on_real_decode_loads():
    loads = read_loads(DATA / "decode_in1000out1000.json").loads[::6]
    init = np.tile(initial_phy2log(256, 32, 1), (loads.shape[0], 1))
    base = make_policy("incremental", 32, 256, 1).plan_table(loads, init)
    noisy = make_policy("incremental", 32, 256, 1, peak_z=1.0,
                        step_tokens=32 * 16 * 8).plan_table(loads, init)
    layers = range(loads.shape[0])
    pk_base = _step_peak(base, loads, layers, 16, 4, seed=5)
    pk_noisy = _step_peak(noisy, loads, layers, 16, 4, seed=5)
    assert pk_noisy < pk_base
