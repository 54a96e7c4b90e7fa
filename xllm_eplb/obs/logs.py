"""Logging for every process: one line per event, ``key=value`` fields, a process tag.

Line format: ``2026-11-29T12:00:00.123 INFO engine EPLB rebalance policy=balanced layers_updated=3/58``.
Use :func:`event` to build the message so every line with one of the fixed prefixes
(``EPLB rebalance``, ``update_expert_weight``, ...; listed in docs/serving.md) is grep-able and
machine-splittable.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR}


def _fmt_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return f"{v:.6g}"
    s = str(v)
    if not s or any(c in s for c in ' "=\n\t'):
        return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    return s


def event(prefix: str, **fields) -> str:
    """``event("EPLB rebalance", policy="balanced", layers_updated="3/58")`` ->
    ``'EPLB rebalance policy=balanced layers_updated=3/58'``."""
    if not fields:
        return prefix
    return prefix + " " + " ".join(f"{k}={_fmt_value(v)}" for k, v in fields.items())


#: the name docs/architecture.md uses for :func:`event`
kv = event


#: ``log.error(msg, extra=FILE_ONLY)``: the record goes to the process's log file only, not to
#: the console (e.g. a surviving rank's failure after another rank crashed: the launcher prints
#: the one summary line)
FILE_ONLY = {"console": False}


class _Formatter(logging.Formatter):
    def __init__(self, tag: str, tracebacks: bool = True):
        super().__init__()
        self.tag, self.tracebacks = tag, tracebacks

    def format(self, record: logging.LogRecord) -> str:
        t = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(record.created))
        line = f"{t}.{int(record.msecs):03d} {record.levelname} {self.tag} {record.getMessage()}"
        if record.exc_info and self.tracebacks:
            line += "\n" + self.formatException(record.exc_info)
        return line


def _on_console(record: logging.LogRecord) -> bool:
    return getattr(record, "console", True)


def console_handler(tag: str, level: int = logging.NOTSET, *, tracebacks: bool = True,
                    stream=None) -> logging.Handler:
    """A stderr handler in the common format that drops :data:`FILE_ONLY` records;
    ``tracebacks=False`` prints one line per record (the file keeps the traceback)."""
    h = logging.StreamHandler(stream or sys.stderr)
    h.setLevel(level)
    h.setFormatter(_Formatter(tag, tracebacks))
    h.addFilter(_on_console)
    return h


def setup_logging(tag: str, level: str = "info", log_file: str | None = None,
                  stream=sys.stderr) -> None:
    """Configure the root logger of this process (call once per process).

    tag: ``engine``, ``launcher``, ``ep3``...; level: debug/info/warning/error (unknown ->
    info); log_file: also append to this file (its directory is created); stream: None for none.
    Replaces (and closes) any handlers installed before, so calling it again is safe.
    """
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
        h.close()
    root.setLevel(_LEVELS.get(level, logging.INFO))
    if stream is not None:
        root.addHandler(console_handler(tag, stream=stream))
    if log_file:
        Path(log_file).parent.mkdir(parents=True, exist_ok=True)
        h = logging.FileHandler(log_file)
        h.setFormatter(_Formatter(tag))
        root.addHandler(h)


#: the link in ``--log_dir`` to the newest run's folder
LATEST = "latest"


def run_log_dir(root: str | Path, tag: str = "", now: float | None = None) -> Path:
    """Create this run's own log folder ``<root>/<YYYYmmdd-HHMMSS>[-<tag>]`` (``-1``, ``-2``...
    appended when it exists) and point the symlink ``<root>/latest`` at it (relative, replaced
    atomically). Returns the folder. OSError when ``root`` cannot be written; a ``latest`` that
    is not a symlink (a folder a user made) is left alone."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    base = time.strftime("%Y%m%d-%H%M%S", time.localtime(now)) + (f"-{tag}" if tag else "")
    for n in range(1000):
        run = root / (base if n == 0 else f"{base}-{n}")
        try:
            run.mkdir()
            break
        except FileExistsError:
            continue
    else:
        raise OSError(f"{root}: no free run folder name for {base}")
    link, tmp = root / LATEST, root / f".{LATEST}.{run.name}"
    if link.is_symlink() or not link.exists():
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(run.name)
        tmp.replace(link)
    return run
