"""``xllm-eplb serve --nnodes N --node-rank I --master-addr A --master-port P``: one node.

Order on every node: resolve the checkpoint's fields, run the node's pre-start checks, join the
rendezvous (node 0 hosts it and publishes the run id and the workers' torch.distributed port),
then start the node's children (:class:`~xllm_eplb.node.launcher.NodeLauncher`). Node 0 prints
the usual ready line once the engine has warmed up every rank on every node; node n prints
``xllm-eplb node <n> ready ranks=a-b``. Logs go to ``<log_dir>/node<n>/``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
from pathlib import Path

from xllm_eplb.config import Config, node_ranks
from xllm_eplb.ipc.shm import resolve_run_id, validate_run_id
from xllm_eplb.launcher import free_port, launcher_process, run_launcher, sweep_dead_at_start
from xllm_eplb.node.launcher import NodeLauncher, node_run_id
from xllm_eplb.node.rendezvous import host_run, join_run, open_store, report_failure
from xllm_eplb.obs.logs import event
from xllm_eplb.obs.progress import Progress, ready_line
from xllm_eplb.preflight import StartupError, check_log_dir, check_serve
from xllm_eplb.worker.comm import preflight

log = logging.getLogger(__name__)


def resolve_topology(cfg: Config) -> Config:
    """``eplb_num_nodes`` left at 1 becomes ``nnodes`` (``node_aware`` sees the real nodes);
    ``log_dir`` becomes ``<log_dir>/node<n>`` (per-node log files, also on one machine; each run
    in its own ``<time>/`` folder there, ``node<n>/latest`` the newest)."""
    rt = cfg.runtime
    e = cfg.eplb
    if e.eplb_num_nodes == 1:
        e = dataclasses.replace(e, eplb_num_nodes=rt.nnodes)
    s = dataclasses.replace(cfg.serve, log_dir=str(Path(cfg.serve.log_dir) / f"node{rt.node_rank}"))
    return dataclasses.replace(cfg, eplb=e, serve=s)


def _node_cfg(cfg: Config, run_id: str, dist_port: int) -> Config:
    rid = validate_run_id(node_run_id(run_id, cfg.runtime.node_rank))
    return dataclasses.replace(cfg, runtime=dataclasses.replace(
        cfg.runtime, run_id=rid, master_port=dist_port))


def _checks(cfg: Config) -> Config:
    """Every pre-start check of this node (node 0: with the HTTP port)."""
    if cfg.runtime.node_rank == 0:
        return dataclasses.replace(cfg, serve=dataclasses.replace(cfg.serve,
                                                                  port=check_serve(cfg)))
    preflight(cfg)
    check_log_dir(cfg.serve.log_dir)
    return cfg


def _rendezvous(cfg: Config, store) -> tuple[Config, str]:
    """(this node's config, node 0's shm run id); node 0 publishes, the others adopt."""
    if cfg.runtime.node_rank == 0:
        run_id = resolve_run_id(cfg.runtime.run_id, cfg.serve.port)
        # --elastic_ep: the workers' groups rendezvous on this store (elastic/protocol.py)
        dist_port = cfg.runtime.master_port if cfg.runtime.elastic_ep else free_port()
        validate_run_id(node_run_id(run_id, cfg.runtime.nnodes - 1))
        host_run(store, cfg, run_id, dist_port)
    else:
        facts = join_run(store, cfg)
        run_id, dist_port = facts["run_id"], facts["dist_port"]
    return _node_cfg(cfg, run_id, dist_port), node_run_id(run_id, 0)


def serve_nodes(cfg: Config, digest: str = "") -> int:
    """Run this node until a signal, node 0's stop or a failure; returns the exit code."""
    # NOTE: imported here: the checkpoint resolver pulls in torch/safetensors
    from xllm_eplb.model.default_checkpoint import with_default_checkpoint
    from xllm_eplb.model.resolve import resolve_config

    cfg = _checks(resolve_topology(resolve_config(cfg)))
    node = cfg.runtime.node_rank
    cfg = launcher_process(cfg, f"xllm-eplb:launcher-node{node}")   # node<n>/<time>/
    store_port = cfg.runtime.master_port
    store = open_store(cfg, master=node == 0)
    cfg, origin = _rendezvous(cfg, store)   # compares the flags as given, not local paths
    # no --model: every node generates the same default checkpoint (content-addressed) itself
    cfg = resolve_config(with_default_checkpoint(cfg))
    log.info(event("launcher config", node=node, nnodes=cfg.runtime.nnodes,
                   run_id=cfg.runtime.run_id, dist_port=cfg.runtime.master_port,
                   ranks=f"{node_ranks(cfg).start}-{node_ranks(cfg).stop - 1}")
             + (" " + digest if digest else ""))
    sweep_dead_at_start()
    return _run(cfg, store, origin, store_port)


def _run(cfg: Config, store, origin: str, store_port: int) -> int:
    node = cfg.runtime.node_rank
    progress = Progress(len(node_ranks(cfg)), sys.stderr.isatty())
    launcher = NodeLauncher(cfg, store, origin, store_port, progress=progress)

    def start() -> None:
        try:
            launcher.start()
        except StartupError as e:
            # NOTE: the other nodes only see a lost link: tell them the cause
            why = str(e) if str(e).startswith(f"node {node}: ") else f"node {node}: {e}"
            report_failure(store, node, json.dumps({"message": why, "primary": True}))
            raise

    def ready() -> str:
        r = node_ranks(cfg)
        return (ready_line(cfg) + f" nnodes={cfg.runtime.nnodes}" if node == 0 else
                f"xllm-eplb node {node} ready ranks={r.start}-{r.stop - 1}")

    return run_launcher(launcher, progress, ready, start)
