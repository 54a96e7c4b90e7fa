"""Output files a command writes (a plan, a report, a plot): written whole or not at all."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable


def write_atomic(path: str | Path, data: str | bytes | Callable[[str], None],
                 suffix: str = "") -> None:
    """Write ``path`` through a temp file in its folder and a rename, so a failure never leaves
    a partial file. ``data``: text, bytes, or a function that writes the temp file's path (a
    figure's ``savefig``; ``suffix`` then gives the temp file the format's extension). The file
    gets the mode of an ordinary one (0666 less the umask), not mkstemp's 0600."""
    p = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=suffix,
                               dir=p.parent if str(p.parent) else ".")
    try:
        if callable(data):
            os.close(fd)
            data(tmp)
        else:
            with os.fdopen(fd, "wb" if isinstance(data, bytes) else "w") as f:
                f.write(data)
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)
        os.replace(tmp, p)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
