"""The chaos part of ``scripts/soak.py --chaos`` (issue #23): the elastic flags of the soak
server, the thread that SIGKILLs a random worker every N seconds, and the recovery times read
back from the engine log."""

from __future__ import annotations

import contextlib
import datetime
import json
import random
import threading
import time
from pathlib import Path

import psutil


def elastic_flags(model: Path) -> list[str]:
    """``--elastic_ep=true`` with the least redundancy that survives one loss at EP4."""
    cfg = json.loads((model / "config.json").read_text())
    e = int(cfg.get("n_routed_experts") or cfg.get("num_experts") or cfg["num_local_experts"])
    need = max(1, -(-e // 3) - e // 4)
    return ["--elastic_ep=true", f"--redundant_experts_num={need}",
            "--elastic_max_restarts=100000", "--elastic_silence_seconds=5"]


class Chaos:
    """SIGKILL a random worker every ``every`` seconds (seeded); kill times are recorded."""

    def __init__(self, server, every: float, seed: int = 23):
        self.s, self.every, self.rng = server, every, random.Random(seed)
        self.kills: list[tuple[float, str]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(self.every):
            workers = [p for p in self.s.procs() if p.pid != self.s.proc.pid
                       and "xllm-eplb:ep" in " ".join(_cmdline(p))]
            if workers:
                p = self.rng.choice(workers)
                self.kills.append((time.time(), " ".join(_cmdline(p))))
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.kill()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


def recoveries(log_dir: Path, kills: list[tuple[float, str]]) -> dict:
    """From the engine log: per recovery, the engine's detect latency (launcher saw the exit
    -> engine detects, ``detect_s``), detect -> re-formed (``seconds``) and kill -> resumed
    (the kill times of the chaos thread against the ``EPLB elastic resume`` stamps)."""
    path = log_dir / "latest" / "engine.log"      # the run's own folder (--log_dir/latest)
    path = path if path.exists() else log_dir / "engine.log"
    lines = path.read_text().splitlines() if path.exists() else []

    def field(ln: str, key: str) -> float:
        return float(ln.split(f" {key}=")[1].split()[0])

    def stamp(ln: str) -> float:
        return datetime.datetime.fromisoformat(ln.split()[0]).timestamp()

    detect = [field(ln, "detect_s") for ln in lines if "EPLB elastic detect " in ln]
    resume = [ln for ln in lines if "EPLB elastic resume " in ln]
    kill_to_resume = []
    for t_kill, _ in kills:
        after = [stamp(ln) - t_kill for ln in resume if stamp(ln) > t_kill]
        if after:
            kill_to_resume.append(round(min(after), 3))
    return {"detect_s": detect, "reform_s": [field(ln, "seconds") for ln in resume],
            "kill_to_resume_s": kill_to_resume}
