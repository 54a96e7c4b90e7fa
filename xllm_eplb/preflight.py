"""Every check ``xllm-eplb serve`` runs before it starts anything, also run by
``xllm-eplb config validate``: device, backend and model (the sizes of the generated default
checkpoint, routing trace), the initial placement file (``--eplb_init_placement``), the HTTP
host (resolvable, an address of this machine) and port (free), and the log folder (writable).
Each failure is one :class:`StartupError` naming the flag that is wrong.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import tempfile
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
    """``log_dir`` is a writable folder, or can be created; StartupError naming ``--log_dir``.
    Tried for real (permission bits say nothing for root, nor for /proc or a read-only mount):
    the missing folders and a probe file are created, then removed again."""
    p = Path(log_dir).absolute()
    probe = p
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    why = f"{probe} is not a folder" if not probe.is_dir() else _try_write(p, probe)
    if why:
        raise StartupError(f"--log_dir={log_dir}: cannot create or write the log folder "
                           f"({why})")


def check_init_placement(cfg: Config) -> None:
    """``--eplb_init_placement``: the file fits the model (its checkpoint's sizes with
    ``--model``), ``ep_size`` and the slot layout (``eplb/placement_file.py``); InputFileError
    naming the file, the field and the rule. Creates nothing."""
    if not cfg.eplb.eplb_init_placement:
        return
    from xllm_eplb.eplb.placement_file import initial_placement
    from xllm_eplb.model.resolve import resolve_config

    initial_placement(resolve_config(cfg))


def check_tokenizer(cfg: Config) -> None:
    """``--tokenizer`` / ``--chat-template``: the files load and the template compiles
    (TokenizerError naming the file or flag). The model's own tokenizer is checked by the
    engine as before."""
    if not (cfg.serve.tokenizer or cfg.serve.chat_template):
        return
    from xllm_eplb.engine.tokenizer import check_chat_template, served_tokenizer

    s = cfg.serve
    if cfg.model.model or s.tokenizer:
        served_tokenizer(cfg.model.model or None, s.tokenizer, s.chat_template)
    else:       # the generated default checkpoint (written later) has a text tokenizer
        check_chat_template(s.chat_template)


def _try_write(folder: Path, existing: Path) -> str:
    """Create ``folder`` (below its ``existing`` ancestor) and a file in it, then remove what
    was created; returns why that failed, or ''."""
    made = [d for d in [folder, *folder.parents] if d != existing and existing in d.parents]
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=folder, prefix=".xllm-eplb-probe-")
        os.close(fd)
        os.unlink(name)
    except OSError as e:
        return f"{e.filename or folder}: {e.strerror or e}"
    finally:
        for d in made:                  # innermost first
            with contextlib.suppress(OSError):
                d.rmdir()
    return ""


def check_checkpoint(cfg: Config) -> None:
    """``--model``: every safetensors header, and for an FP8 checkpoint every scale (paired,
    its grid's shape, finite and > 0); InputFileError naming the file, the tensor and the rule,
    before any worker starts (so nothing starts half-loaded)."""
    if not cfg.model.model:
        return
    from xllm_eplb.model.loader import CheckpointReader, check_experts, experts_fp8
    from xllm_eplb.model.spec import parse_spec

    spec = parse_spec(cfg.model.model)
    reader = CheckpointReader(cfg.model.model, spec.quant)
    check_experts(spec, reader)
    experts_fp8(spec, reader)
    reader.check_scales()


def check_affinity(cfg: Config):
    """``--worker_cpu_affinity`` against this machine's cores: the launcher's
    :class:`~xllm_eplb.worker.affinity.AffinityPlan` (ConfigError naming the flag if not)."""
    from xllm_eplb.config import ranks_per_node
    from xllm_eplb.worker import affinity
    from xllm_eplb.worker.transport import uses_shm

    return affinity.plan(cfg.runtime.worker_cpu_affinity, ranks_per_node(cfg),
                         shm=uses_shm(cfg, cfg.eplb.ep_size))


def check_serve(cfg: Config) -> int:
    """Run every pre-start check of ``serve``; returns the HTTP port (resolved for 0)."""
    from xllm_eplb.worker.comm import preflight

    preflight(cfg)        # device / backend / model (sizes, trace) checks
    check_checkpoint(cfg)
    check_init_placement(cfg)
    check_tokenizer(cfg)
    check_affinity(cfg)
    port = check_port(cfg.serve.host, cfg.serve.port)
    check_log_dir(cfg.serve.log_dir)
    return port

