"""One real `xllm-eplb serve` process group for the end-to-end tests: logs, every process it
started, and a fixture that kills the group and sweeps the run's /dev/shm objects even on
failure."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from xllm_eplb.testing.dist import free_port

ROOT = Path(__file__).resolve().parents[1]


def shm_objects(run_id: str) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if f"xllm_eplb_{run_id}_" in n]



def kill_run(proc, alive) -> None:
    """SIGKILL the process group of ``proc``, then every pid ``alive()`` still lists (children
    that left the group), then reap ``proc``."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for p in alive():
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(10)


class Server:
    """One `xllm-eplb serve` process group with its logs and every process it started."""

    def __init__(self, tmp: Path, args: list[str], base: list[str] | None = None, *,
                 cmd: list[str] | None = None, cwd: Path = ROOT, env: dict | None = None,
                 port: int | None = None):
        """``base``: the run's fixed flags (default: 4 ranks from the example config);
        ``cmd``: the whole command line instead of ``python -m xllm_eplb serve ... *args``
        (it must listen on ``port`` and log under ``cwd``)."""
        self.port = port or free_port()
        self.run_id = f"p{self.port}"
        self.log_root = tmp / "logs"
        #: this run's own log folder (``--log_dir``'s ``latest`` link: one run per root here)
        self.log_dir = self.log_root / "latest"
        self.out, self.err = tmp / "stdout.txt", tmp / "stderr.txt"
        if cmd is None:
            if base is None:
                base = ["--ep-size", "4", "--config", str(ROOT / "configs" / "eplb.yaml")]
            cmd = [sys.executable, "-m", "xllm_eplb", "serve", *base, "--port", str(self.port),
                   "--log_dir", str(self.log_root), *args]
        else:
            self.log_root, self.log_dir = cwd / "logs", cwd / "logs" / "latest"
        self.proc = subprocess.Popen(cmd, cwd=cwd, stdout=self.out.open("w"), env=env,
                                     stderr=self.err.open("w"), start_new_session=True)
        self.pids: set[int] = {self.proc.pid}
        self.url = f"http://127.0.0.1:{self.port}"

    def note_children(self) -> None:
        try:
            self.pids |= {c.pid for c in psutil.Process(self.proc.pid).children(recursive=True)}
        except psutil.NoSuchProcess:
            pass

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if "xllm-eplb ready" in self.out.read_text():
                self.note_children()
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.3)
        raise AssertionError(f"no ready line: rc={self.proc.poll()}\n{self.err.read_text()[-3000:]}")

    def alive(self) -> list[int]:
        out = []
        for p in self.pids:
            try:
                if psutil.Process(p).status() != psutil.STATUS_ZOMBIE:
                    out.append(p)
            except psutil.NoSuchProcess:
                pass
        return out

    def kill(self) -> None:
        self.note_children()
        kill_run(self.proc, self.alive)
        deadline = time.monotonic() + 10     # SIGKILLed children still hold the run's segments
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        from xllm_eplb.ipc.objects import clean

        # the whole run was SIGKILLed: its objects go even if a dying child still maps one
        clean(self.run_id, force=True)
