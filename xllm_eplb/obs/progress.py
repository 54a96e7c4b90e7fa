"""Start-up display of ``xllm-eplb serve``: progress on stderr -- one line per stage reached by
every rank (``xllm-eplb start stage=model ranks=16/16 t=3.2s``) and per engine stage
(``xllm-eplb start engine=warmup t=2.0s``), each printed once, on a TTY too -- then the one
ready line on stdout (:func:`ready_line`).

The launcher feeds :class:`Progress` the ``(who, stage)`` events its children send
(``child.send_event``).
"""

from __future__ import annotations

import signal
import sys
import time

from xllm_eplb.config import Config, resolve_backend

#: stages every worker reports, in order (``who`` = ``ep<r>``)
WORKER_STAGES = ("spawned", "dist_init", "model", "ready")
#: stages the engine reports, in order (``who`` = ``engine``)
ENGINE_STAGES = ("spawned", "http_bound", "rings", "warmup", "ready")


class Progress:
    """Start-up progress: one line per stage reached by every rank
    (``xllm-eplb start stage=model ranks=16/16 t=3.2s``) and per engine stage.

    NOTE: the engine and the workers write their own log lines (``EPLB manager start``,
    ``engine ready``) to the same terminal, so a live display that redraws itself (``rich``)
    would overwrite them and draw its rows again after each; every row is printed once, on a
    TTY too (``tty`` is accepted for the launcher and changes nothing).
    """

    def __init__(self, ep_size: int, tty: bool):
        self.ep_size, self.t0, self.tty = ep_size, time.monotonic(), tty
        self.counts: dict[str, int] = {s: 0 for s in WORKER_STAGES}
        self.stopped = False

    def update(self, who: str, stage: str) -> None:
        if self.stopped:
            return
        if who == "engine":
            self._engine(stage)
        elif stage in self.counts:
            self.counts[stage] += 1
            if self.counts[stage] == self.ep_size:
                self._line(f"stage={stage} ranks={self.ep_size}/{self.ep_size}")

    def _engine(self, stage: str) -> None:
        if stage in ENGINE_STAGES:
            self._line(f"engine={stage}")

    def _line(self, text: str) -> None:
        print(f"xllm-eplb start {text} t={time.monotonic() - self.t0:.1f}s", file=sys.stderr,
              flush=True)

    def stopping(self, signum: int, procs) -> None:
        """The one line a stop during start-up gets, at once (``procs``: the children started
        so far, name -> process); no stage is printed after it."""
        if self.stopped:
            return
        workers = sum(1 for w in procs if w.startswith("ep"))
        parts = (["the engine"] if "engine" in procs else []) + (
            [f"{workers} of {self.ep_size} workers"] if workers else [])
        started = " and ".join(parts) or "nothing (none was started yet)"
        print(f"xllm-eplb stop requested during start-up ({signal.Signals(signum).name} at "
              f"t={time.monotonic() - self.t0:.1f}s): stopping {started}", file=sys.stderr,
              flush=True)
        self.stopped = True

    def close(self) -> None:
        """Nothing to tear down (kept for the launcher's ``finally``)."""


def ready_line(cfg: Config) -> str:
    """The one fixed line users and tools wait for (``--backend`` auto resolved by device)."""
    host = "127.0.0.1" if cfg.serve.host in ("0.0.0.0", "") else cfg.serve.host
    return (f"xllm-eplb ready ep_size={cfg.eplb.ep_size} "
            f"backend={resolve_backend(cfg.runtime.device, cfg.runtime.backend)} "
            f"url=http://{host}:{cfg.serve.port}")
