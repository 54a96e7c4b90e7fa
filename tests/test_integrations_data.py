"""Every adapter on the real DeepSeek loads (SGLang dumps in ../shared/data): the same quality as
`xllm-eplb plan` on the same input, and a re-plan with the deployed map moves few slots."""

import numpy as np
import pytest
import torch

from xllm_eplb.commands.plan import run_plan
from xllm_eplb.eplb.balance import rank_loads_from_phy2log
from xllm_eplb.eplb.loads import read_loads
from xllm_eplb.integrations import deepseek, sglang, vllm_ascend
from xllm_eplb.integrations.vllm import XllmEplbPolicy
from xllm_eplb.testing.peer_fixtures import slot_workload

EP, R = 32, 288                                      # EP32+32: 256 experts, 9 slots per rank


def peak_over_ideal(table, loads):
    r = rank_loads_from_phy2log(np.asarray(table), loads, EP)
    return float(r.max(axis=1).sum() / (np.asarray(loads, float).sum() / EP))


def via_deepseek(loads, dense, old):
    return deepseek.rebalance_experts(loads, R, 8, 1, EP, old_phy2log=old)[0]


def via_vllm(loads, dense, old):
    o = None if old is None else torch.from_numpy(old)
    return XllmEplbPolicy.rebalance_experts(torch.from_numpy(loads), R, 8, 1, EP, o).numpy()


def via_sglang(loads, dense, old):
    t = np.concatenate([np.zeros((dense, loads.shape[1]), np.int64), loads])[None]
    o = None if old is None else np.concatenate(
        [np.tile(np.arange(R) % loads.shape[1], (dense, 1)), old])
    p = sglang.rebalance_experts(torch.from_numpy(t), R, R // EP, 8, 1, "auto", old=o)[0]
    return p.numpy()[dense:]


def via_vllm_ascend(loads, dense, old):
    """The current table: ``old``, or SGLang's trivial map when nothing is planned yet; the
    workload per slot: the expert's load split evenly over its replicas."""
    cur = np.tile(np.arange(R) % loads.shape[1], (loads.shape[0], 1)) if old is None else old
    slot = slot_workload(cur, loads)
    _, _, new = vllm_ascend.XllmAscendPolicy(None).rebalance_experts(
        cur.reshape(-1, EP, R // EP), slot.reshape(-1, EP, R // EP))
    return np.asarray(new).reshape(loads.shape[0], R)


ADAPTERS = {"deepseek": via_deepseek, "vllm": via_vllm, "sglang": via_sglang,
            "vllm_ascend": via_vllm_ascend}


@pytest.fixture(scope="module")
def dumps():
    from pathlib import Path

    d = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "sglang_ep_statistics"
    if not (d / "decode_in500out1500.json").is_file():
        pytest.skip(f"shared load data not found at {d}")
    a, b = read_loads(d / "decode_in1000out1000.json"), read_loads(d / "decode_in500out1500.json")
    ref, _, _, _ = run_plan(str(d / "decode_in1000out1000.json"), EP, 1, "incremental", None,
                            None)
    return a, b, peak_over_ideal(ref["phy2log"], a.loads)


@pytest.mark.parametrize("name", sorted(ADAPTERS))
def test_adapter_quality_and_drift_on_real_loads(dumps, name):
    a, b, ref_peak = dumps
    fresh = ADAPTERS[name](a.loads, a.dense_skipped, None)
    assert abs(peak_over_ideal(fresh, a.loads) - ref_peak) <= 0.001
    drift = ADAPTERS[name](b.loads, b.dense_skipped, fresh)
    moved = float((drift != fresh).mean())
    assert moved <= 0.15, moved
    assert peak_over_ideal(drift, b.loads) < peak_over_ideal(fresh, b.loads)
