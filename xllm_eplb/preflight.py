"""Every check ``xllm-eplb serve`` runs before it starts anything, also run by
``xllm-eplb config validate``: device, backend and model (the sizes of the generated default
checkpoint, routing trace), the HTTP host (resolvable, an address of this machine) and port
(free), and the log folder (writable).
Each failure is one :class:`StartupError` naming the flag that is wrong.
"""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path

from xllm_eplb.config import Config
from xllm_eplb.errors import UserError


class StartupError(UserError):
    """Serving could not start (port taken, child failed during start-up)."""


def check_host(host: str) -> socket.AddressFamily:
    """The address family of ``host``; StartupError naming ``--host`` if it does not resolve."""
    try:
        info = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise StartupError(f"--host={host}: cannot resolve this name ({e}); use an address of "
                           f"this machine, e.g. 127.0.0.1 or 0.0.0.0") from None
    return info[0][0]


def check_port(host: str, port: int) -> int:
    """Bind-test ``host:port`` before anything starts; returns the port (a free one for 0).
    A host that is not an address of this machine blames ``--host``, anything else ``--port``."""
    fam = check_host(host)
    with socket.socket(fam, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRNOTAVAIL:
                raise StartupError(f"--host={host}: not an address of this machine "
                                   f"({e.strerror})") from None
            raise StartupError(f"--port={port}: cannot listen on {host}:{port} ({e.strerror}); "
                               f"stop the other server or pick another --port") from None
        return s.getsockname()[1]


def check_log_dir(log_dir: str) -> None:
    """``log_dir`` is a writable folder, or can be created (its nearest existing parent is a
    writable folder); StartupError naming ``--log_dir``. Creates nothing."""
    p = Path(log_dir).absolute()
    probe = p
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    why = ""
    if not probe.is_dir():
        why = f"{probe} is not a folder"
    elif not os.access(probe, os.W_OK | os.X_OK):
        why = f"{probe} is not writable"
    if why:
        raise StartupError(f"--log_dir={log_dir}: cannot create or write the log folder "
                           f"({why})")


def check_serve(cfg: Config) -> int:
    """Run every pre-start check of ``serve``; returns the HTTP port (resolved for 0)."""
    from xllm_eplb.worker.comm import preflight

    preflight(cfg)        # device / backend / model (sizes, trace) checks
    port = check_port(cfg.serve.host, cfg.serve.port)
    check_log_dir(cfg.serve.log_dir)
    return port

