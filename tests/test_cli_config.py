"""``xllm-eplb config show|validate|docs`` and the click decorators (real click, real processes)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from xllm_eplb.cli import config_command, handle_user_errors
from xllm_eplb.commands.config import DOCS_PATH, render_docs
from xllm_eplb.config import FIELDS
from xllm_eplb.errors import InputFileError

REPO = Path(__file__).resolve().parents[1]
PY = "/work/main/.venv/bin/python"


def run(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    exe = PY if Path(PY).exists() else sys.executable
    return subprocess.run([exe, "-m", "xllm_eplb", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=60)


# --- acceptance (subprocess) --------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.timeout(60)
def test_show_acceptance():
    r = run("config", "show", "--config", "configs/eplb.yaml", "--eplb_policy_kind=GREEDY",
            "--noenable_eplb")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "eplb_policy_kind=greedy (cli)" in lines
    assert "enable_eplb=false (cli)" in lines
    assert "ep_size=16 (file)" in lines and "enable_fused_mc2=1 (file)" in lines
    assert "seed=0 (default)" in lines
    assert len(lines) == len(FIELDS)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_validate_acceptance():
    r = run("config", "validate", "--config", "configs/eplb.yaml",
            "--eplb_min_peak_load_improvement=1.5")
    assert r.returncode == 2
    assert r.stderr.strip() == "error: --eplb_min_peak_load_improvement=1.5: must be in [0, 1]"
    assert "Traceback" not in r.stderr
    ok = run("config", "validate", "--config", "configs/eplb.yaml")
    assert ok.returncode == 0 and "configuration is valid" in ok.stdout


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_yaml_error_is_one_line_and_debug_adds_traceback(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("ep_size: 16\nmodel:\n  num_layers: [4\n")
    r = run("config", "validate", "--config", str(bad))
    assert r.returncode == 2
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: config file {bad}:")
    assert "YAML syntax error" in err[0]
    d = run("config", "validate", "--config", str(bad), "--v=debug")
    assert d.returncode == 2 and "Traceback" in d.stderr
    assert d.stderr.strip().splitlines()[-1] == err[0]


def test_committed_docs_match_generator():
    assert DOCS_PATH == REPO / "docs" / "configuration.md"
    assert DOCS_PATH.read_text(encoding="utf-8") == render_docs(), \
        "docs/configuration.md is stale: run `make docs`"


def test_docs_cover_every_flag_and_precedence():
    text = render_docs()
    for name in FIELDS:
        assert f"`--{name}`" in text
    assert "defaults < config file < flagfile < command line" in text
    assert "xLLM itself lets its JSON config file win" in text
    assert "| `--eplb_min_peak_load_improvement` | float | `0.05` | in [0, 1] |" in text


# --- in-process click ---------------------------------------------------------------------------

def test_config_commands_in_process(tmp_path):
    runner = CliRunner()
    from xllm_eplb.cli import cli
    r = runner.invoke(cli, ["config", "show", "--ep-size", "4", "--num_experts=8"])
    assert r.exit_code == 0 and "ep_size=4 (cli)" in r.output
    r = runner.invoke(cli, ["config", "show"])  # show does not need ep_size
    assert r.exit_code == 0 and "ep_size=none (default)" in r.output
    r = runner.invoke(cli, ["config", "validate"])
    assert r.exit_code == 2 and "--ep_size is required" in r.output
    r = runner.invoke(cli, ["config", "validate", "--ep_sizee=4"])
    assert r.exit_code == 2 and "did you mean --ep_size?" in r.output
    out = tmp_path / "c.md"
    r = runner.invoke(cli, ["config", "docs", "--output", str(out)])
    assert r.exit_code == 0 and out.read_text() == render_docs()
    r = runner.invoke(cli, ["config", "docs"])          # no --output: stdout, nothing written
    assert r.exit_code == 0 and r.output == render_docs()


@config_command("simlike", require_ep_size=False, pass_sources=True)
@click.option("--trace", required=True)
@click.option("--steps", type=int, default=10)
def simlike(trace, steps, cfg, sources):
    """A command with its own options plus every config flag."""
    if trace == "bad":
        raise InputFileError("trace bad: not found")
    click.echo(f"trace={trace} steps={steps} ep={cfg.eplb.ep_size} "
               f"interval={cfg.eplb.eplb_update_interval:g} src={sources['ep_size']}")


@click.command("planlike")
@click.argument("path")
@handle_user_errors
def planlike(path):
    raise InputFileError(f"load file {path}: not found")


def test_config_command_mixes_own_options_and_config_flags():
    runner = CliRunner()
    r = runner.invoke(simlike, ["--trace", "t.npz", "--ep-size", "16", "--steps", "5",
                                "--eplb_update_interval=5", "--enable_eplb"])
    assert r.exit_code == 0, r.output
    assert r.output.strip() == "trace=t.npz steps=5 ep=16 interval=5 src=cli"
    r = runner.invoke(simlike, ["--trace", "t.npz", "--eplb_update_intervall=5"])
    assert r.exit_code == 2 and "did you mean --eplb_update_interval" in r.output
    r = runner.invoke(simlike, ["--trace", "bad"])
    assert r.exit_code == 2 and r.output.strip() == "error: trace bad: not found"
    r = runner.invoke(simlike, ["--help"])
    assert r.exit_code == 0 and "--trace" in r.output and "configuration flag" in r.output


def test_handle_user_errors():
    r = CliRunner().invoke(planlike, ["x.json"])
    assert r.exit_code == 2 and r.output.strip() == "error: load file x.json: not found"


def test_shared_data_fixture(shared_data):
    import json

    files = sorted(shared_data.glob("*.json"))
    data = json.loads(files[0].read_text())
    rows = data["logical_count"]
    assert len(rows) == 61 and len(rows[0]) == 256 and not any(rows[0])
