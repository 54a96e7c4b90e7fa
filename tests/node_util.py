"""Multi-node runs on one machine: N `xllm-eplb serve --nnodes N` launchers on loopback, each
its own process group with its logs; every process they started is recorded so a test can
prove none is left, and the fixture kills and sweeps everything even on failure."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil

from xllm_eplb.testing.serving import ROOT, free_port, kill_run


def shm_names() -> list[str]:
    return sorted(n for n in os.listdir("/dev/shm") if "xllm_eplb_" in n)


def mapped_shm(pid: int) -> set[str]:
    """/dev/shm project objects process ``pid`` has mapped or open (maps and fds)."""
    out = set()
    try:
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
            if "/dev/shm/" in line and "xllm_eplb_" in line:
                out.add(line.split("/dev/shm/")[1].strip())
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            target = os.readlink(fd)
            if target.startswith("/dev/shm/") and "xllm_eplb_" in target:
                out.add(target[len("/dev/shm/"):])
    except (FileNotFoundError, PermissionError, ProcessLookupError):
        pass
    return out


class Node:
    """One node's launcher (`serve --nnodes N --node-rank I`)."""

    def __init__(self, tmp: Path, node: int, nnodes: int, master_port: int, http_port: int,
                 args: list[str]):
        self.node = node
        d = tmp / f"node{node}"
        d.mkdir(parents=True, exist_ok=True)
        self.log_dir = tmp / "logs"
        self.out, self.err = d / "stdout.txt", d / "stderr.txt"
        cmd = [sys.executable, "-m", "xllm_eplb", "serve", "--ep-size", "4",
               "--config", str(ROOT / "configs" / "eplb.yaml"), "--port", str(http_port),
               "--log_dir", str(self.log_dir), "--nnodes", str(nnodes), "--node-rank",
               str(node), "--master-addr", "127.0.0.1", "--master-port", str(master_port),
               *args]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.out.open("w"),
                                     stderr=self.err.open("w"), start_new_session=True)
        # NOTE: psutil.Process objects (pid + start time): pids wrap fast on a busy machine
        self.procs: dict[int, psutil.Process] = {self.proc.pid: psutil.Process(self.proc.pid)}
        self.url = f"http://127.0.0.1:{http_port}"

    @property
    def pids(self) -> set[int]:
        return set(self.procs)

    def note_children(self) -> None:
        try:
            for c in psutil.Process(self.proc.pid).children(recursive=True):
                self.procs.setdefault(c.pid, c)
        except psutil.NoSuchProcess:
            pass

    def wait_line(self, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in self.out.read_text():
                self.note_children()
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.3)
        raise AssertionError(f"node {self.node}: no {text!r} line: rc={self.proc.poll()}\n"
                             f"{self.err.read_text()[-3000:]}")

    def alive(self) -> list[int]:
        """Recorded processes still running (the same process: pid and start time)."""
        out = []
        for pid, p in self.procs.items():
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(pid)
            except psutil.NoSuchProcess:
                pass
        return out

    def kill(self) -> None:
        self.note_children()
        kill_run(self.proc, self.alive)


class Cluster:
    """``nnodes`` launchers sharing one rendezvous port (node 0 serves HTTP)."""

    def __init__(self, tmp: Path, nnodes: int, args: list[str], per_node: dict | None = None):
        self.master_port, self.http_port = free_port(), free_port()
        self.run_id = f"p{self.http_port}"
        self.nodes = [Node(tmp, n, nnodes, self.master_port, self.http_port,
                           args + list((per_node or {}).get(n, [])))
                      for n in range(nnodes)]
        self.url = self.nodes[0].url

    def wait_ready(self, timeout: float = 240.0) -> None:
        self.nodes[0].wait_line("xllm-eplb ready", timeout)
        for n in self.nodes[1:]:
            n.wait_line(f"xllm-eplb node {n.node} ready", 30)

    def wait_exit(self, timeout: float) -> list[int | None]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(n.proc.poll() is None for n in self.nodes):
            time.sleep(0.1)
        return [n.proc.poll() for n in self.nodes]

    def leftovers(self, grace: float = 5.0) -> tuple[list[int], list[str]]:
        """(live processes of any node, /dev/shm objects of this run), after waiting up to
        ``grace`` s for them to go (a process exiting needs a moment on a loaded machine)."""
        deadline = time.monotonic() + grace
        while True:
            pids = [p for n in self.nodes for p in n.alive()]
            shm = [s for s in shm_names() if f"_{self.run_id}-n" in s]
            if (not pids and not shm) or time.monotonic() >= deadline:
                return pids, shm
            time.sleep(0.2)

    def kill(self) -> None:
        from xllm_eplb.ipc.objects import clean

        for n in self.nodes:
            n.kill()
        for i in range(len(self.nodes)):
            clean(f"{self.run_id}-n{i}")
