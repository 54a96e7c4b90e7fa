"""Replica routing in offline replay (sim/routing.py, simulate --eplb_replica_routing,
--tokens-per-rank, summary step_peak_over_ideal)."""

import json

import numpy as np
import pytest
from click.testing import CliRunner

from xllm_eplb.cli import cli
from xllm_eplb.config import EplbConfig
from xllm_eplb.eplb import replica_routing as rr
from xllm_eplb.sim.generators import generate
from xllm_eplb.sim.replay import ReplayOptions, replay, summarize
from xllm_eplb.sim.routing import split_sources
from xllm_eplb.sim.trace import Trace, load_trace, save_trace

ZIPF = "zipf:layers=3,experts=16,steps=120,tokens=64,skew=1.2,seed=3"


def test_split_sources_sums_to_the_load_and_is_seeded():
    load = np.random.default_rng(0).integers(0, 50, (3, 16))
    a = split_sources(load, 4, np.random.default_rng(7))
    b = split_sources(load, 4, np.random.default_rng(7))
    assert a.shape == (3, 4, 16) and a.dtype == np.int64
    assert (a.sum(axis=1) == load).all() and (a >= 0).all()
    assert (a == b).all()
    assert not (a == split_sources(load, 4, np.random.default_rng(8))).all()


def _replay(tr, mode, **kw):
    cfg = EplbConfig(ep_size=4, redundant_experts_num=1, eplb_update_interval=0.5,
                     eplb_policy_kind="incremental")
    return replay(tr, cfg, ReplayOptions(routing=mode, **kw))


def test_modes_conserve_tokens_and_balanced_is_lowest_on_the_same_placement():
    tr = generate(ZIPF)
    res = {m: _replay(tr, m) for m in rr.MODES}
    for m, r in res.items():
        assert (r.rank_eplb.sum(axis=2) == tr.loads.sum(axis=2)).all(), m
        assert (r.rank_static.sum(axis=2) == tr.loads.sum(axis=2)).all(), m
    # the EPLB-off placement is the same for every mode and the source split is seeded, so the
    # step's peak under balanced is at most static's and spread's at every step and layer
    pk = {m: r.rank_static.max(axis=2) for m, r in res.items()}
    assert (pk["balanced"] <= pk["static"]).all() and (pk["balanced"] <= pk["spread"]).all()
    # (xLLM's initial layout keeps an expert's replicas on one rank: routing cannot matter there)
    s = summarize(res["balanced"])
    assert s["replica_routing"] == "balanced"
    assert s["step_peak_over_ideal"] >= 1.0 and s["layers_committed"] >= 1
    first = s["first_activation_step"]
    per_step = [x["peak_over_ideal"] for x in s["steps"]][first:]
    assert s["step_peak_over_ideal"] == pytest.approx(np.mean(per_step), rel=1e-5)


def test_trace_sources_are_used_and_checked(tmp_path):
    tr = generate(ZIPF)
    src = np.zeros((*tr.loads.shape[:2], 4, tr.experts), dtype=np.int64)
    src[:, :, 2] = tr.loads                         # every token comes from rank 2
    traced = Trace(tr.loads, tr.meta, src)
    path = save_trace(traced, tmp_path / "t.npz")
    back = load_trace(path)
    assert (back.sources == src).all()
    r = _replay(back, "static")
    plan = rr.prepare(r.placement_static[0], tr.experts, 4)
    want = rr.rank_loads(rr.slot_loads(src[5, 0], plan, "static"), 4)
    assert (r.rank_static[5, 0] == want).all()
    bad = src.copy()
    bad[0, 0, 0, 0] += 1
    np.savez(tmp_path / "bad.npz", loads=tr.loads, sources=bad)
    out = CliRunner().invoke(cli, ["simulate", "--trace", str(tmp_path / "bad.npz"),
                                   "--ep-size", "4", "--out", str(tmp_path / "o")])
    assert out.exit_code == 2 and "sources[0, 0, :, 0] sum to" in out.output
    with pytest.raises(Exception, match="source ranks but ep_size=8"):
        replay(back, EplbConfig(ep_size=8, redundant_experts_num=0), ReplayOptions(
            routing="spread"))


def test_cli_tokens_per_rank_and_routing_flag(tmp_path):
    spec = "zipf:layers=2,experts=16,steps=80,skew=1.2,seed=1"
    r = CliRunner().invoke(cli, ["simulate", "--generate", spec, "--tokens-per-rank", "8",
                                 "--ep-size", "4", "--eplb_replica_routing=balanced",
                                 "--eplb_update_interval=0.5", "--no-plots",
                                 "--save-trace", str(tmp_path / "t.npz"),
                                 "--out", str(tmp_path / "o")], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    s = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert s["replica_routing"] == "balanced" and s["tokens_per_rank"] == 8
    tr = load_trace(tmp_path / "t.npz")
    assert (tr.loads.sum(axis=2) == 8 * 4 * 8).all()          # tokens x top-k per step
    assert "step peak/ideal" in r.output
    plain = CliRunner().invoke(cli, ["simulate", "--generate", spec, "--ep-size", "4",
                                     "--no-plots", "--out", str(tmp_path / "p")])
    assert plain.exit_code == 0, plain.output
    s2 = json.loads((tmp_path / "p" / "summary.json").read_text())
    assert s2["replica_routing"] == "even split (aggregate)" and "step_peak_over_ideal" in s2


@pytest.mark.parametrize("args,msg", [
    (["--trace", "T", "--tokens-per-rank", "4"], "needs --generate"),
    (["--generate", "zipf:layers=2,experts=16,steps=5,tokens=9", "--tokens-per-rank", "4"],
     "both set the per-step sample size"),
    (["--generate", "zipf:layers=2,experts=16,steps=5", "--tokens-per-rank", "0"],
     "--tokens-per-rank=0: must be >= 1"),
    (["--generate", "zipf:layers=2,experts=16,steps=5", "--eplb_replica_routing=lp"],
     "eplb_replica_routing"),
])
def test_bad_routing_input_exits_2(tmp_path, args, msg):
    np.savez(tmp_path / "t.npz", loads=np.ones((5, 2, 16), dtype=np.int64))
    args = [str(tmp_path / "t.npz") if a == "T" else a for a in args]
    r = CliRunner().invoke(cli, ["simulate", *args, "--ep-size", "4",
                                 "--out", str(tmp_path / "o")])
    assert r.exit_code == 2, r.output
    assert msg in r.output and "error:" in r.output
