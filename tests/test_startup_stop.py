"""A stop requested during start-up (issue 41 item 1): people press Ctrl-C while the workers
still import torch. The run ends within seconds, says so once, prints no traceback and leaves no
process and no /dev/shm object behind; the exit code is 0 (docs/serving.md)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from xllm_eplb.testing.serving import ROOT, shm_objects

pytestmark = pytest.mark.slow

EXAMPLE = ["--config", str(ROOT / "configs" / "eplb.yaml")]


def _wait_for(s, text: str, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in s.err.read_text():
        assert s.proc.poll() is None and time.monotonic() < deadline, s.err.read_text()[-2000:]
        time.sleep(0.02)


def _stop_during_startup(s, sig: int, group: bool, after: str) -> tuple[int, float, str]:
    """Signal the run (its whole process group, as a terminal's ^C; or the launcher only, as
    ``kill``) once ``after`` is on its console: (exit code, seconds to exit, console)."""
    _wait_for(s, after)
    s.note_children()
    t0 = time.monotonic()
    if group:
        os.killpg(s.proc.pid, sig)
    else:
        s.proc.send_signal(sig)
    rc = s.proc.wait(30)
    return rc, time.monotonic() - t0, s.err.read_text()


def _assert_clean_stop(s, rc: int, took: float, err: str, name: str) -> None:
    assert rc == 0, f"rc={rc}\n{err[-3000:]}"
    assert took < 8.0, f"took {took:.1f}s\n{err[-3000:]}"
    # no child's KeyboardInterrupt, no kill, no failure: one line saying what happened
    assert err.count("Traceback") == 0 and "KeyboardInterrupt" not in err, err[-3000:]
    assert [ln for ln in err.splitlines() if ln.startswith("error:")] == [], err[-3000:]
    stops = [ln for ln in err.splitlines() if "stop requested during start-up" in ln]
    assert len(stops) == 1 and f"({name} at t=" in stops[0], err[-3000:]
    # nothing of the start-up is printed after the stop line
    assert "xllm-eplb start " not in err.split(stops[0], 1)[1], err[-3000:]
    time.sleep(0.3)
    assert s.alive() == [] and shm_objects(s.run_id) == [], (s.alive(), shm_objects(s.run_id))


@pytest.mark.timeout(120)
def test_ctrl_c_while_ep4_workers_import_is_one_line_and_exit_0(start_server):
    # the terminal's ^C reaches every process of the foreground group, the workers importing
    s = start_server("--workload=none", base=["--ep-size", "4", *EXAMPLE])
    rc, took, err = _stop_during_startup(s, signal.SIGINT, True, "engine=rings")
    _assert_clean_stop(s, rc, took, err, "SIGINT")


@pytest.mark.timeout(150)
def test_sigterm_to_the_launcher_while_ep8_workers_start_ends_every_child(start_server):
    # `kill PID` of the launcher alone: the workers get nothing from the terminal; the launcher
    # ends them (they never attached to the rings, so no shutdown message could reach them)
    s = start_server("--workload=none", base=["--ep-size", "8", *EXAMPLE])
    rc, took, err = _stop_during_startup(s, signal.SIGTERM, False, "stage=spawned")
    _assert_clean_stop(s, rc, took, err, "SIGTERM")
    assert "stopping the engine and 8 of 8 workers" in err, err[-2000:]
