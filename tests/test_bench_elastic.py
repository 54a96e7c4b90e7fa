"""The harness's reading of why a server stopped (``testing/serving.last_error``, what
``scripts/bench_elastic.py`` reports): the launcher prints its
``error:`` line a few seconds after the client sees the port close, so the bench waits for the
launcher to exit before it reads the console (a real child process stands in for it; the
script itself runs by hand, docs/benchmarks.md)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from xllm_eplb.testing.serving import last_error

#: a real child process stands in for the launcher (a process: slow, as the README says)
pytestmark = pytest.mark.slow

LATE = ("import time, sys; time.sleep(1.0); "
        "print('error: rank 3 (pid 1) died during serving: exit code 1', file=sys.stderr); "
        "sys.exit(1)")


def _server(tmp_path: Path, code: str) -> SimpleNamespace:
    out = tmp_path / "server.out"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=out.open("w"),
                            stderr=subprocess.STDOUT)
    return SimpleNamespace(proc=proc, out=out, err=None)


@pytest.mark.timeout(30)
def test_the_error_line_printed_after_the_port_closed_is_read(tmp_path):
    s = _server(tmp_path, LATE)
    assert last_error(s, wait_s=0.0) == "(no error line)"     # read at once: too early
    assert last_error(s) == ("error: rank 3 (pid 1) died during serving: exit code 1")
    assert s.proc.returncode == 1


@pytest.mark.timeout(30)
def test_a_server_still_running_is_read_after_the_wait(tmp_path):
    s = _server(tmp_path, "import time; time.sleep(20)")
    t0 = time.monotonic()
    try:
        assert last_error(s, wait_s=0.5) == "(no error line)"
        assert 0.5 <= time.monotonic() - t0 < 5
    finally:
        s.proc.kill()
        s.proc.wait()
