"""`xllm-eplb plan` through a real subprocess: outputs, --previous, report/plot, bad inputs."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from xllm_eplb.eplb.placement import validate_phy2log

REPO = Path(__file__).resolve().parents[1]
PY = str(REPO / ".venv" / "bin" / "python") if (REPO / ".venv").is_dir() else sys.executable
DATA = REPO.parent / "shared" / "data" / "sglang_ep_statistics"


def run(*args, cwd):
    return subprocess.run([PY, "-m", "xllm_eplb", "plan", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=120,
                          preexec_fn=lambda: os.umask(0o022))


def loads_file(tmp_path, layers=3, experts=16, dense=1, name="loads.json"):
    rng = np.random.default_rng(0)
    rows = [[0] * experts] * dense + (rng.zipf(1.5, (layers, experts)) * 10).tolist()
    p = tmp_path / name
    p.write_text(json.dumps({"logical_count": rows}))
    return p


@pytest.mark.slow
def test_plan_with_previous_report_and_plot(tmp_path):
    lf = loads_file(tmp_path)
    out, rep, png = tmp_path / "p.json", tmp_path / "r.md", tmp_path / "p.png"
    r = run("--load", lf, "--ep-size", 4, "--redundant-experts-num", 1, "--policy", "Balanced",
            "--output", out, "--report", rep, "--plot", png, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "skipped 1 leading all-zero (dense) layers" in r.stdout
    res = json.loads(out.read_text())
    assert res["policy"] == "balanced" and res["ep_size"] == 4 and res["slots_per_rank"] == 5
    assert res["num_logical_experts"] == 16 and res["moe_layers"] == [0, 3]
    assert res["policy_seconds"] >= 0 and "moved_slots" not in res
    for row in res["phy2log"]:
        validate_phy2log(np.array(row), 16, 4)
    text = rep.read_text()
    assert "balancedness" in text and "peak/ideal" in text and text.count("\n| ") >= 4
    assert png.stat().st_size > 1000
    # ordinary file modes (regression: mkstemp left every output 0600); the child's umask 022
    for f in (out, rep, png):
        assert f.stat().st_mode & 0o777 == 0o644, (f, oct(f.stat().st_mode))
    out2 = tmp_path / "p2.json"
    r = run("--load", lf, "--ep-size", 4, "--policy", "incremental", "--previous", out,
            "--moe-layers", "1:3", "--output", out2, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    res2 = json.loads(out2.read_text())
    assert res2["moe_layers"] == [1, 3] and len(res2["phy2log"]) == 2
    assert res2["moved_slots"] >= res2["weight_copies"] >= 0


def bad_previous(tmp_path):
    p = tmp_path / "prev.json"
    p.write_text(json.dumps({"ep_size": 4, "phy2log": [[0] * 20] * 3}))
    return p


@pytest.mark.parametrize("case,msg", [
    ("ragged", "different expert counts"),
    ("negative", "must be >= 0"),
    ("nan", "must be finite"),
    ("indivisible", "not divisible by --ep-size=3"),
    ("too_many_replicas", "exceed the 16 experts"),
    ("prev_shape", "previous phy2log has shape"),
    ("prev_invariant", "has no replica"),
])
@pytest.mark.slow
def test_bad_inputs_exit_2_without_output(tmp_path, case, msg):
    lf = loads_file(tmp_path)
    args = ["--ep-size", 4]
    if case == "ragged":
        lf.write_text(json.dumps([[1, 2, 3, 4], [1, 2]]))
    elif case == "negative":
        lf.write_text(json.dumps([[1, -2, 3, 4]]))
    elif case == "nan":
        lf = tmp_path / "nan.npy"
        np.save(lf, np.array([[1.0, np.nan, 2.0, 3.0]]))
    elif case == "indivisible":
        args = ["--ep-size", 3]
    elif case == "too_many_replicas":
        args += ["--redundant-experts-num", 20]
    elif case == "prev_shape":
        p = tmp_path / "prev.json"
        p.write_text(json.dumps([[0, 1, 2]]))
        args += ["--previous", p]
    elif case == "prev_invariant":
        args += ["--previous", bad_previous(tmp_path)]
    out = tmp_path / "out.json"
    r = run("--load", lf, *args, "--output", out, cwd=tmp_path)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.startswith("error: ") and msg in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.json")]


@pytest.mark.skipif(not (DATA / "decode_in1000out1000.json").is_file(),
                    reason="real load data absent")
@pytest.mark.slow
def test_plan_on_real_dump(tmp_path):
    out = tmp_path / "p.json"
    r = run("--load", DATA / "decode_in1000out1000.json", "--ep-size", 32,
            "--redundant-experts-num", 1, "--policy", "greedy", "--output", out, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "skipped 3 leading all-zero (dense) layers" in r.stdout
    res = json.loads(out.read_text())
    assert len(res["phy2log"]) == 58 and len(res["phy2log"][0]) == 32 * 9


@pytest.mark.parametrize("extra,msg", [
    (["--report", "nodir/r.md"], "--report=nodir/r.md: folder nodir does not exist"),
    (["--plot", "p.xyz"], "unsupported image format"),
    (["--plot", "."], "is a directory"),
    (["--policy", "incremental", "--budget-slots", "-1"], "--budget-slots=-1: must be >= 0"),
])
def test_unwritable_outputs_fail_before_any_file(tmp_path, monkeypatch, extra, msg):
    """Regression: a bad --report/--plot path used to raise a traceback after the placement
    JSON was already written."""
    from click.testing import CliRunner

    from xllm_eplb.commands.plan import plan

    lf = loads_file(tmp_path)
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(plan, ["--load", str(lf), "--ep-size", "4", "-o", "out.json", *extra])
    assert r.exit_code == 2, r.output
    assert msg in r.output and "Traceback" not in r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loads.json"]


def test_a_bad_option_value_is_one_error_line_and_the_default_policy_is_incremental(tmp_path):
    # issue 35: click's multi-line "Usage: ... Error: ..." block; plan defaulted to balanced
    from click.testing import CliRunner

    from xllm_eplb.cli import cli

    lf = loads_file(tmp_path)
    r = CliRunner().invoke(cli, ["plan", "--load", str(lf), "--ep-size", "4", "-o",
                                 str(tmp_path / "o.json"), "--format", "foo"])
    assert r.exit_code == 2 and r.output.count("\n") == 1, r.output
    assert r.output.startswith("error: Invalid value for '--format': 'foo' is not one of")
    assert r.output.rstrip().endswith("plan --help')")
    r = CliRunner().invoke(cli, ["plan", "--load", str(lf), "--ep-size", "4", "-o",
                                 str(tmp_path / "o.json")])
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "o.json").read_text())["policy"] == "incremental"
