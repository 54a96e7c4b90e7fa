"""`xllm-eplb simulate` end to end (click runner, real manager + real policies) and replay
invariants."""

import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from xllm_eplb.cli import cli
from xllm_eplb.config import EplbConfig
from xllm_eplb.sim.generators import generate
from xllm_eplb.sim.replay import ReplayOptions, replay, summarize
from xllm_eplb.sim.trace import Trace

DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "sglang_ep_statistics"
ZIPF = "zipf:layers=4,experts=16,steps=300,tokens=256,skew=1.2,shift_every=150,seed=2"


@pytest.fixture(autouse=True)
def _restore_logging():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for h in list(root.handlers):
        if h not in handlers:
            root.removeHandler(h)
            h.close()
    for h in handlers:
        if h not in root.handlers:
            root.addHandler(h)
    root.setLevel(level)


def run(*args):
    return CliRunner().invoke(cli, ["simulate", *args], catch_exceptions=False)


def test_simulate_generate_writes_summary_and_plots(tmp_path):
    out = tmp_path / "out"
    r = run("--generate", ZIPF, "--ep-size", "4", "--redundant-experts-num", "1",
            "--policy", "balanced", "--eplb_update_interval=1", "--out", str(out),
            "--save-trace", str(tmp_path / "t.npz"))
    assert r.exit_code == 0, r.output
    s = json.loads((out / "summary.json").read_text())
    for key in ("balancedness_static", "balancedness_eplb", "slots_moved", "weight_copies",
                "rounds", "layers_committed", "timeouts"):
        assert key in s
    assert len(s["steps"]) == 300 and s["rounds"] >= 2 and s["timeouts"] == 0
    assert s["balancedness_eplb"] > s["balancedness_static"] + 0.2
    assert sum(x["layers_activated"] for x in s["steps"]) == s["layers_committed"]
    assert sum(x["slots_moved"] for x in s["steps"]) == s["slots_moved"]
    for png in ("balancedness.png", "load_heatmap.png", "rank_load.png"):
        assert (out / png).stat().st_size > 1000
    # ordinary file modes, as any file this process creates (mkstemp alone would leave 0600)
    mask = os.umask(0)
    os.umask(mask)
    for f in [*out.iterdir(), tmp_path / "t.npz"]:
        assert f.stat().st_mode & 0o777 == 0o666 & ~mask, (f, oct(f.stat().st_mode))
    log = (out / "simulate.log").read_text()
    assert "EPLB manager start" in log and "EPLB rebalance" in log
    assert "static=" in r.output and "slots_moved=" in r.output and "rounds=" in r.output
    # the saved trace replays to the same result (deterministic end to end)
    r2 = run("--trace", str(tmp_path / "t.npz"), "--ep-size", "4", "--redundant-experts-num",
             "1", "--policy", "balanced", "--eplb_update_interval=1", "--no-plots",
             "--out", str(tmp_path / "again"))
    assert r2.exit_code == 0, r2.output
    s2 = json.loads((tmp_path / "again" / "summary.json").read_text())
    assert s2["balancedness_eplb"] == s["balancedness_eplb"]
    assert s2["slots_moved"] == s["slots_moved"]


def test_simulate_config_file_and_flags(tmp_path):
    cfgf = tmp_path / "c.yaml"
    cfgf.write_text("eplb:\n  ep_size: 4\n  eplb_update_interval: 2\n  eplb_policy_kind: greedy\n")
    r = run("--generate", ZIPF, "--config", str(cfgf), "--steps", "120", "--no-plots",
            "--out", str(tmp_path / "o"))
    assert r.exit_code == 0, r.output
    s = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert s["policy"] == "greedy" and s["eplb_update_interval"] == 2.0
    assert len(s["steps"]) == 120


def _bad_trace(tmp_path, loads):
    p = tmp_path / f"bad{len(list(tmp_path.iterdir()))}.npz"
    np.savez(p, loads=loads)
    return str(p)


@pytest.mark.parametrize("case, msg", [
    ("shape", "expected a non-empty [steps, layers, experts]"),
    ("nan", "counts must be finite"),
    ("negative", "counts must be >= 0"),
    ("experts", "trace has 16 experts per layer but --num_experts=32"),
    ("none", "exactly one of --trace FILE or --generate SPEC"),
    ("steps", "--steps=999: the trace has only 5 steps"),
    ("divisible", "trace has 16 experts per layer: --num_experts=16: must be divisible by "
                  "--ep_size=3"),
    ("out_dir", "cannot create the output folder"),
    ("save_trace", "--save-trace=/proc/xllm-eplb-no/t.npz: cannot write"),
])
def test_bad_input_exits_2_with_a_clear_error(tmp_path, case, msg):
    good = np.ones((5, 2, 16), dtype=np.int64)
    args = {"shape": ["--trace", _bad_trace(tmp_path, np.ones((5, 16)))],
            "nan": ["--trace", _bad_trace(tmp_path, np.full((5, 2, 16), np.nan))],
            "negative": ["--trace", _bad_trace(tmp_path, -good)],
            "experts": ["--trace", _bad_trace(tmp_path, good), "--num_experts=32"],
            "none": [],
            "steps": ["--trace", _bad_trace(tmp_path, good), "--steps", "999"],
            "divisible": ["--trace", _bad_trace(tmp_path, good), "--ep-size", "3"],
            "out_dir": ["--trace", _bad_trace(tmp_path, good)],
            "save_trace": ["--trace", _bad_trace(tmp_path, good),
                           "--save-trace", "/proc/xllm-eplb-no/t.npz"]}[case]
    if "--ep-size" not in args:
        args += ["--ep-size", "4"]
    out = "/proc/xllm-eplb-no/o" if case == "out_dir" else str(tmp_path / "o")
    r = CliRunner().invoke(cli, ["simulate", *args, "--out", out])
    assert r.exit_code == 2, r.output
    assert msg in r.output
    assert not (tmp_path / "o").exists()             # nothing written on bad input


def test_replay_keeps_manager_and_workers_in_step_and_counts_timeouts():
    tr = generate(ZIPF)
    cfg = EplbConfig(ep_size=4, redundant_experts_num=1, eplb_update_interval=0.5,
                     eplb_prepare_timeout_seconds=0.1)
    # 3 forwards per prepare at 0.05 s/step > 2 x 0.1 s without outputs? No: outputs arrive
    # every step, so the 0.1 s progress budget (2 steps) is what times out.
    res = replay(tr, cfg, ReplayOptions(transfer_steps_per_layer=4))
    s = summarize(res)
    assert s["timeouts"] >= 1 and s["layers_committed"] == 0
    assert s["balancedness_eplb"] == pytest.approx(s["balancedness_static"])
    ok = replay(tr, cfg, ReplayOptions(transfer_steps_per_layer=2))
    s2 = summarize(ok)
    assert s2["timeouts"] == 0 and s2["layers_committed"] >= 4
    assert (ok.rank_eplb.sum(axis=2) == ok.rank_static.sum(axis=2)).all()   # tokens conserved


def test_static_trace_no_skew_moves_nothing():
    loads = np.full((200, 2, 8), 50, dtype=np.int64)
    cfg = EplbConfig(ep_size=4, redundant_experts_num=0, eplb_update_interval=0.5)
    s = summarize(replay(Trace(loads), cfg))
    assert s["slots_moved"] == 0 and s["rounds"] >= 1 and s["layers_committed"] == 0
    assert s["balancedness_eplb"] == pytest.approx(1.0)


@pytest.mark.skipif(not (DATA / "decode_in1000out1000.json").is_file(),
                    reason="../shared/data not present")
def test_real_data_drift_replay(tmp_path):
    spec = (f"sglang:decode_in1000out1000->decode_in500out1500,steps=300,tokens=1024,layers=3,"
            f"dir={DATA}")
    r = run("--generate", spec, "--ep-size", "8", "--redundant-experts-num", "1",
            "--policy", "incremental", "--eplb_update_interval=2", "--no-plots",
            "--out", str(tmp_path / "o"))
    assert r.exit_code == 0, r.output
    s = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert s["balancedness_eplb"] > 0.9 > s["balancedness_static"]


def test_the_summary_says_why_no_round_ran():
    # issue 41 item 2: `simulate` without --eplb_update_interval ran 0 rounds and said nothing
    from xllm_eplb.commands.simulate import _no_round_note

    s = {"steps": [{}] * 200, "step_seconds": 0.05, "eplb_first_round_samples": 256,
         "eplb_update_interval": 1000.0, "rounds": 0, "layers_committed": 0,
         "eplb_min_peak_load_improvement": 0.05}
    assert _no_round_note(s) == (
        "note: no EPLB round ran: the first round needs --eplb_first_round_samples=256 samples "
        "or --eplb_update_interval=1000 s of simulated time (the trace is 200 steps x "
        "--step-seconds=0.05 = 10 s); lower one of them (e.g. --eplb_update_interval=5) or "
        "replay more steps")
    assert "3 rounds ran but none published" in _no_round_note({**s, "rounds": 3})
    assert _no_round_note({**s, "rounds": 3, "layers_committed": 2}) is None
