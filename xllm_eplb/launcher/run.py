"""The ``serve`` entry of a single-node run and the parts every node's entry shares: resolve the
runtime (ports, run id), make this process the launcher (log folder, title), sweep dead runs,
then start, supervise, stop and clean up (:func:`run_launcher`)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import signal
import socket
import sys

from xllm_eplb.config import Config, ranks_per_node
from xllm_eplb.ipc.objects import sweep_dead_runs
from xllm_eplb.ipc.shm import resolve_run_id
from xllm_eplb.launcher.launcher import Launcher
from xllm_eplb.obs.logs import event, run_log_dir, setup_logging
from xllm_eplb.obs.progress import Progress, ready_line
from xllm_eplb.preflight import StartupError, check_port, check_serve
from xllm_eplb.worker import affinity

log = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]



def resolve_runtime(cfg: Config, port: int | None = None) -> Config:
    """Fill what the run decides at start: HTTP port (for 0), rendezvous port, run id."""
    if port is None:
        port = check_port(cfg.serve.host, cfg.serve.port)
    mport = cfg.runtime.master_port or free_port()
    rt = dataclasses.replace(cfg.runtime, master_port=mport,
                             run_id=resolve_run_id(cfg.runtime.run_id, port))
    return dataclasses.replace(cfg, runtime=rt, serve=dataclasses.replace(cfg.serve, port=port))


def _killed(killed: list[str], code: int, cfg: Config, at: str = "") -> int:
    """A stop that had to SIGKILL a child is a failure (exit 1) naming it (``at``: when, the
    same stamp as the launcher log's ``launcher killed`` line)."""
    if not killed:
        return code
    names = ", ".join(f"rank {w[2:]}" if w.startswith("ep") else w for w in killed)
    print(f"error: {names} did not stop within --shutdown_timeout_seconds="
          f"{cfg.serve.shutdown_timeout_seconds:g} and was killed (SIGKILL)"
          + (f" at {at}" if at else ""), file=sys.stderr, flush=True)
    return code or 1


def launcher_process(cfg: Config, title: str, tag: str = "") -> Config:
    """This process as a launcher: the run's own log folder ``<--log_dir>/<time>[-<tag>]/``
    (``<--log_dir>/latest`` points at it; every process of the run logs there: the returned
    config carries it), its log file there (StartupError naming the flag when it cannot be
    written) and its process title."""
    try:
        run_dir = run_log_dir(cfg.serve.log_dir, tag)
        setup_logging("launcher", cfg.serve.v, str(run_dir / "launcher.log"))
    except OSError as e:
        raise StartupError(f"--log_dir={cfg.serve.log_dir}: cannot create or write the log "
                           f"folder ({e})") from None
    with contextlib.suppress(Exception):
        import setproctitle

        setproctitle.setproctitle(title)
    return dataclasses.replace(cfg, serve=dataclasses.replace(cfg.serve, log_dir=str(run_dir)))


def serve(cfg: Config, digest: str = "") -> int:
    """Run until a signal or a failure; returns the process exit code."""
    # NOTE: imported here, not at the top: the checkpoint resolver pulls in torch/safetensors
    from xllm_eplb.model.default_checkpoint import with_default_checkpoint
    from xllm_eplb.model.resolve import resolve_config

    cfg = resolve_config(cfg)  # --model: the checkpoint's architecture fields, before any use
    port = check_serve(cfg)    # every check before anything starts (no --model: the sizes)
    # no --model: generate the default checkpoint once, here, before anything is spawned
    cfg = resolve_runtime(resolve_config(with_default_checkpoint(cfg)), port)
    cfg = launcher_process(cfg, "xllm-eplb:launcher", tag=cfg.runtime.run_id)
    # the digest's values, less those this line already gives (resolved)
    rest = " ".join(kv for kv in digest.split() if kv.split("=", 1)[0] not in
                    ("run_id", "port", "master_port"))
    log.info(event("launcher config", run_id=cfg.runtime.run_id, port=cfg.serve.port,
                   master_port=cfg.runtime.master_port) + (" " + rest if rest else ""))
    sweep_dead_at_start()
    progress = Progress(cfg.eplb.ep_size, sys.stderr.isatty())
    return run_launcher(Launcher(cfg, progress=progress), progress, lambda: ready_line(cfg))


def console_notes(cfg: Config, plan: affinity.AffinityPlan) -> list[str]:
    """Lines printed under the ready line that say why a user's request may be slow: the
    synthetic workload sharing the engine, or more processes than cores."""
    out = []
    s = cfg.serve
    engine = cfg.runtime.node_rank == 0             # node n runs workers only
    if s.workload != "none" and engine:
        out.append(f"note: the built-in {s.workload} workload is on ({s.workload_rate:g} req/s "
                   f"of demo traffic share the engine with your requests; --workload=none "
                   f"turns it off)")
    if cfg.eplb.enable_eplb and engine:
        out.append(eplb_note(cfg))
    workers, cores = ranks_per_node(cfg), len(affinity.available_cpus())
    if not plan.pinned and workers + engine > cores:
        who = f"{workers} workers" + (" + the engine" if engine else "")
        out.append(f"note: {who} share {cores} cores: every step "
                   f"waits for all of them, so a token takes several times longer than on a "
                   f"machine with a core per worker (--ep-size {cores} or more cores "
                   f"make requests faster)")
    return out


def eplb_note(cfg: Config) -> str:
    """When EPLB acts (the line under the ready line): the first round after
    ``--eplb_first_round_samples`` samples of traffic, the later ones every
    ``--eplb_update_interval`` seconds."""
    e = cfg.eplb
    first = (f"after {e.eplb_first_round_samples} load samples (engine steps) of your traffic "
             f"(--eplb_first_round_samples)" if e.eplb_first_round_samples
             else f"{e.eplb_update_interval:g} s after the first load sample")
    return (f"note: EPLB ({e.eplb_policy_kind}) runs its first round {first}, then every "
            f"{e.eplb_update_interval:g} s (--eplb_update_interval); /eplb/status next_round "
            f"says when")


def sweep_dead_at_start() -> None:
    """Remove the shm objects of dead runs on this machine (a node whose processes were all
    SIGKILLed), with one line saying so; live runs are never touched (``ipc/objects.py``)."""
    removed = sweep_dead_runs()
    if removed:
        log.info(event("shm swept dead runs", runs=",".join(sorted(removed)),
                       objects=sum(removed.values())))


def run_launcher(launcher: Launcher, progress: Progress, ready, start=None) -> int:
    """Start ``launcher`` (``start()``, default ``launcher.start``), print ``ready()``,
    supervise until a signal or a failure, stop and clean up: the exit code (single node and
    every node of a multi-node run)."""
    launcher.install_signals()
    cfg, code = launcher.cfg, 1
    try:
        try:
            (start or launcher.start)()
        finally:
            progress.close()
        print(ready(), flush=True)
        for line in console_notes(cfg, launcher.affinity):
            print(line, flush=True)
        code = launcher.supervise()
        killed = launcher.stop(graceful=(code == 0))
        code = _killed(killed, code, cfg, launcher.killed_at)
    except KeyboardInterrupt:
        # a stop requested during start-up (the launcher's handler) exits 0 like one while
        # serving; a KeyboardInterrupt of its own (no handler yet) exits 130
        code = 0 if launcher.stop_signal else 130
        progress.stopping(launcher.stop_signal or signal.SIGINT, launcher.procs)
        killed = launcher.stop_startup()
        code = _killed(killed, code, cfg, launcher.killed_at)
    except BaseException:
        launcher.stop(graceful=False)
        raise
    finally:
        launcher.cleanup()
    return code

