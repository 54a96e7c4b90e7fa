"""Start-up display of ``xllm-eplb serve``: progress on stderr -- a ``rich`` bar per stage on a
TTY, else one plain line per stage reached by every rank (``xllm-eplb start stage=model
ranks=16/16 t=3.2s``) and per engine stage (``xllm-eplb start engine=warmup t=2.0s``) -- then the
one ready line on stdout (:func:`ready_line`).

The launcher feeds :class:`Progress` the ``(who, stage)`` events its children send
(``child.send_event``).
"""

from __future__ import annotations

import sys
import time

from xllm_eplb.config import Config, resolve_backend

#: stages every worker reports, in order (``who`` = ``ep<r>``)
WORKER_STAGES = ("spawned", "dist_init", "model", "ready")
#: stages the engine reports, in order (``who`` = ``engine``)
ENGINE_STAGES = ("spawned", "http_bound", "rings", "warmup", "ready")


class Progress:
    """Start-up progress: a ``rich`` bar per stage on a TTY, else one plain line per stage
    reached by every rank (``xllm-eplb start stage=model ranks=16/16 t=3.2s``)."""

    def __init__(self, ep_size: int, tty: bool):
        self.ep_size, self.t0 = ep_size, time.monotonic()
        self.counts: dict[str, int] = {s: 0 for s in WORKER_STAGES}
        self._rich = None
        if tty:
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as RichProgress

            self._rich = RichProgress(TextColumn("{task.description:<18}"), BarColumn(),
                                      MofNCompleteColumn(), TimeElapsedColumn(),
                                      transient=True)
            self._tasks = {s: self._rich.add_task(f"ranks {s}", total=ep_size)
                           for s in WORKER_STAGES}
            self._tasks["engine"] = self._rich.add_task("engine", total=len(ENGINE_STAGES))
            self._rich.start()

    def update(self, who: str, stage: str) -> None:
        if who == "engine":
            self._engine(stage)
        elif stage in self.counts:
            self.counts[stage] += 1
            if self._rich is not None:
                self._rich.update(self._tasks[stage], completed=self.counts[stage])
            elif self.counts[stage] == self.ep_size:
                self._line(f"stage={stage} ranks={self.ep_size}/{self.ep_size}")

    def _engine(self, stage: str) -> None:
        if stage not in ENGINE_STAGES:
            return
        if self._rich is not None:
            self._rich.update(self._tasks["engine"], completed=ENGINE_STAGES.index(stage) + 1)
        else:
            self._line(f"engine={stage}")

    def _line(self, text: str) -> None:
        print(f"xllm-eplb start {text} t={time.monotonic() - self.t0:.1f}s", file=sys.stderr,
              flush=True)

    def close(self) -> None:
        if self._rich is not None:
            self._rich.stop()
            self._rich = None


def ready_line(cfg: Config) -> str:
    """The one fixed line users and tools wait for (``--backend`` auto resolved by device)."""
    host = "127.0.0.1" if cfg.serve.host in ("0.0.0.0", "") else cfg.serve.host
    return (f"xllm-eplb ready ep_size={cfg.eplb.ep_size} "
            f"backend={resolve_backend(cfg.runtime.device, cfg.runtime.backend)} "
            f"url=http://{host}:{cfg.serve.port}")
