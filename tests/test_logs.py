"""One-line ``key=value`` log events and the per-process logging set-up (xllm_eplb/obs/logs.py)."""

from __future__ import annotations

import io
import logging
import os
import re
import shlex

import pytest

from xllm_eplb.obs.logs import event, kv, run_log_dir, setup_logging

LINE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3} (DEBUG|INFO|WARNING|ERROR) (\S+) (.*)$")


@pytest.fixture
def restore_root_logging():
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    yield
    for h in list(root.handlers):
        root.removeHandler(h)
        h.close()
    for h in saved[0]:
        root.addHandler(h)
    root.setLevel(saved[1])


def test_event_formats_spec_prefix_and_fields():
    assert event("EPLB rebalance", policy="balanced", layers_updated="3/58") == \
        "EPLB rebalance policy=balanced layers_updated=3/58"
    assert event("EPLB heartbeat") == "EPLB heartbeat"
    assert kv is event


def test_event_values_are_machine_splittable():
    line = event("update_expert_weight", layer=3, t=0.0123456789, ok=True, none=None,
                 note="two words", empty="", quote='a"b=c', nl="x\ny")
    assert "\n" not in line
    assert line.startswith("update_expert_weight layer=3 t=0.0123457 ok=true none=None ")
    fields = dict(tok.split("=", 1) for tok in shlex.split(line)[1:])
    assert fields["note"] == "two words" and fields["empty"] == ""
    assert fields["quote"] == 'a"b=c' and fields["layer"] == "3"


def test_setup_logging_line_format_and_level(restore_root_logging):
    buf = io.StringIO()
    setup_logging("engine", "info", stream=buf)
    log = logging.getLogger("xllm_eplb.test")
    log.debug("hidden")
    log.info(event("EPLB manager start", policy="balanced", moe_layers=3))
    log.warning("careful")
    lines = buf.getvalue().splitlines()
    assert len(lines) == 2
    m = LINE.match(lines[0])
    assert m and m.group(1) == "INFO" and m.group(2) == "engine"
    assert m.group(3) == "EPLB manager start policy=balanced moe_layers=3"
    assert LINE.match(lines[1]).group(1) == "WARNING"


def test_setup_logging_debug_file_and_replace(tmp_path, restore_root_logging):
    first = io.StringIO()
    setup_logging("ep0", "debug", stream=first)
    logging.getLogger("a").debug("one")
    second = io.StringIO()
    path = tmp_path / "sub" / "ep3.log"
    setup_logging("ep3", "debug", log_file=str(path), stream=second)  # replaces handlers
    logging.getLogger("a").debug("two")
    try:
        raise ValueError("boom")
    except ValueError:
        logging.getLogger("a").exception("failed")
    for h in logging.getLogger().handlers:
        h.flush()
    assert "one" in first.getvalue() and "two" not in first.getvalue()
    text = path.read_text()
    assert text == second.getvalue()
    assert LINE.match(text.splitlines()[0]).group(2) == "ep3"
    assert "Traceback" in text and "ValueError: boom" in text


def test_setup_logging_no_stream_and_unknown_level(tmp_path, restore_root_logging):
    path = tmp_path / "x.log"
    setup_logging("launcher", "loud", log_file=str(path), stream=None)
    root = logging.getLogger()
    assert root.level == logging.INFO and len(root.handlers) == 1
    logging.getLogger("b").info("only in file")
    root.handlers[0].flush()
    assert "launcher only in file" in path.read_text()


def test_each_run_logs_into_its_own_folder_and_latest_follows(tmp_path):
    """#27: an EP4 run after an EP16 run no longer sits beside the EP16 run's rank4..15.log."""
    root = tmp_path / "logs"
    a = run_log_dir(root, "p8000", now=1_764_650_000.0)
    (a / "rank15.log").write_text("old run\n")
    b = run_log_dir(root, "p8000", now=1_764_650_000.0)          # same second, same run id
    c = run_log_dir(root, "p8000", now=1_764_650_060.0)
    assert len({a, b, c}) == 3 and b.name == a.name + "-1"
    assert re.fullmatch(r"\d{8}-\d{6}-p8000", a.name) and not (c / "rank15.log").exists()
    latest = root / "latest"
    assert latest.is_symlink() and os.readlink(latest) == c.name      # relative: root can move
    assert latest.resolve() == c.resolve()
    assert sorted(p.name for p in root.iterdir()) == sorted([a.name, b.name, c.name, "latest"])


def test_a_latest_folder_made_by_hand_is_left_alone(tmp_path):
    (tmp_path / "latest").mkdir()
    run = run_log_dir(tmp_path)
    assert (tmp_path / "latest").is_dir() and not (tmp_path / "latest").is_symlink()
    assert run.is_dir() and re.fullmatch(r"\d{8}-\d{6}", run.name)
