"""The chaos part of ``scripts/soak.py --chaos`` (issue #23): the elastic flags of the soak
server, the thread that SIGKILLs a random worker every N seconds, and the recovery times read
back from the engine log."""

from __future__ import annotations

import contextlib
import json
import random
import threading
import time
from pathlib import Path

import psutil
from elastic_measure import elastic_lines, per_kill


def elastic_flags(model: Path) -> list[str]:
    """``--elastic_ep=true`` with the least redundancy that survives one loss at EP4."""
    cfg = json.loads((model / "config.json").read_text())
    e = int(cfg.get("n_routed_experts") or cfg.get("num_experts") or cfg["num_local_experts"])
    need = max(1, -(-e // 3) - e // 4)
    return ["--elastic_ep=true", f"--redundant_experts_num={need}",
            "--elastic_max_restarts=100000", "--elastic_silence_seconds=5"]


class Chaos:
    """SIGKILL a random worker of ``server`` (its ``proc``: the serve process) every ``every``
    seconds (seeded); kill times are recorded."""

    def __init__(self, server, every: float, seed: int = 23):
        self.s, self.every, self.rng = server, every, random.Random(seed)
        self.kills: list[tuple[float, str]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(self.every):
            workers = [p for p in _children(self.s.proc.pid)
                       if "xllm-eplb:ep" in " ".join(_cmdline(p))]
            if workers:
                p = self.rng.choice(workers)
                self.kills.append((time.time(), " ".join(_cmdline(p))))
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.kill()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)


def _children(pid: int) -> list[psutil.Process]:
    """Every process under the server's (a test's or the soak's ``Server``)."""
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


def recoveries(log_dir: Path, kills: list[tuple[float, str]]) -> dict:
    """From the launcher's and the engine's logs, per kill of the chaos thread: kill -> the
    launcher saw the exit, -> the engine's ``EPLB elastic detect`` (recovery starts), ->
    ``EPLB elastic resume``; and the engine's own ``detect_s`` (launcher notice -> engine) and
    re-form seconds (``scripts/elastic_measure.py``)."""
    lines = elastic_lines(log_dir)
    rows = per_kill(lines, sorted(t for t, _ in kills))
    return {"detect_s": [float(f["detect_s"]) for _, f in lines["detect"]],
            "recovery_s": [float(f["seconds"]) for _, f in lines["resume"]],
            "reform_s": [float(f["reform_s"]) for _, f in lines["resume"]],
            "kill_to_launcher_s": [r["launcher_s"] for r in rows],
            "kill_to_detect_s": [r["detect_s"] for r in rows],
            "kill_to_resume_s": [r["resume_s"] for r in rows]}
