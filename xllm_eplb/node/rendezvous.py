"""Start-up rendezvous of a multi-node run through torch.distributed's TCPStore (c10d).

Node 0's launcher hosts the store at ``--master_addr:--master_port``; every other node's
launcher connects as a client. Keys (all small JSON strings)::

    run            node 0: {"run_id", "dist_port"}: the base run id (shm names are
                   ``<run_id>-n<node>``) and the port of the workers' torch.distributed world
    join/<n>       node n: its fingerprint (the fields that must agree) + host and pid
    verdict/<n>    node 0: "ok" or the refusal (one line naming the field)
    go             node 0: every node joined; start
    fail/<n>       node n: why it stopped the run (read by the others for their error line)

NOTE: every node must pass the same config; :func:`fingerprint` lists what is compared. The
store lives in node 0's launcher: when that process dies, the others lose it (their bridges
then report the lost link).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import time
from datetime import timedelta

import torch.distributed as dist

from xllm_eplb.config import Config, format_value
from xllm_eplb.ipc.store import host_store
from xllm_eplb.obs.logs import event
from xllm_eplb.preflight import StartupError

log = logging.getLogger(__name__)

#: fields every node must share (name, section)
FINGERPRINT = (("ep_size", "eplb"), ("nnodes", "runtime"), ("model", "model"),
               ("redundant_experts_num", "eplb"), ("num_experts", "model"),
               ("num_layers", "model"), ("hidden_size", "model"), ("dtype", "model"),
               ("seed", "model"), ("device", "runtime"), ("backend", "runtime"),
               ("enable_eplb", "eplb"), ("expert_parallel_degree", "eplb"))
#: seconds between node 0's "waiting for nodes" lines
SHOW_EVERY = 2.0


def fingerprint(cfg: Config) -> dict:
    """``{flag: value}`` of the fields every node must agree on (``--model``: the folder's
    resolved path, so one checkpoint under two spellings still agrees)."""
    out = {}
    for name, sec in FINGERPRINT:
        v = getattr(getattr(cfg, sec), name)
        if name == "model" and v:
            v = os.path.realpath(v)
        out[name] = v
    return out


def mismatch(mine: dict, theirs: dict, node: int) -> str | None:
    """The first fingerprint field that differs, as one refusal line, or None."""
    for name, _ in FINGERPRINT:
        if mine.get(name) != theirs.get(name):
            return (f"node {node} refused at rendezvous: --{name}={format_value(theirs.get(name))}"
                    f" there, --{name}={format_value(mine.get(name))} on node 0 (every node "
                    f"must run with the same config)")
    return None


def _where(cfg: Config) -> str:
    return f"{cfg.runtime.master_addr}:{cfg.runtime.master_port}"


def open_store(cfg: Config, *, master: bool):
    """Node 0: the store server (StartupError when the port is taken); others: a client that
    retries until ``--rendezvous_timeout_seconds``."""
    rt = cfg.runtime
    timeout = timedelta(seconds=rt.rendezvous_timeout_seconds)
    try:
        if master:                # listening on --master_addr only (ipc/store.py)
            return host_store(rt.master_addr, rt.master_port, timeout.total_seconds())
        return dist.TCPStore(rt.master_addr, rt.master_port, None, master, timeout=timeout,
                             wait_for_workers=False)
    except Exception as e:  # noqa: BLE001 - c10d raises RuntimeError/DistStoreError
        if master:
            raise StartupError(f"--master_port={rt.master_port}: node 0 cannot host the "
                               f"rendezvous at {_where(cfg)} ({_short(e)})") from None
        raise StartupError(f"rendezvous: no node 0 at {_where(cfg)} within "
                           f"--rendezvous_timeout_seconds={rt.rendezvous_timeout_seconds:g} "
                           f"({_short(e)})") from None


def _short(e: BaseException) -> str:
    return str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__


def host_run(store, cfg: Config, run_id: str, dist_port: int, stop=lambda: False) -> None:
    """Node 0: publish the run facts, then admit nodes 1..N-1 (refusing mismatched ones),
    showing which are still missing; StartupError past the timeout. ``stop()`` true: abort."""
    rt = cfg.runtime
    store.set("run", json.dumps({"run_id": run_id, "dist_port": dist_port}))
    mine = fingerprint(cfg)
    waiting = set(range(1, rt.nnodes))
    t0 = last = time.monotonic()
    while waiting:
        for n in sorted(waiting):
            if store.check([f"join/{n}"]):
                waiting.discard(n) if _admit(store, n, mine) else None
        now = time.monotonic()
        if not waiting:
            break
        if stop():
            raise KeyboardInterrupt
        if now - t0 > rt.rendezvous_timeout_seconds:
            raise StartupError(f"rendezvous: node {_names(waiting)} did not join {_where(cfg)} "
                               f"within --rendezvous_timeout_seconds="
                               f"{rt.rendezvous_timeout_seconds:g}")
        if now - last >= SHOW_EVERY or last == t0:
            last = now
            print(f"xllm-eplb start waiting for node {_names(waiting)} at {_where(cfg)} "
                  f"t={now - t0:.1f}s", file=sys.stderr, flush=True)
        time.sleep(0.1)
    store.set("go", "1")
    log.info(event("rendezvous done", nodes=rt.nnodes, seconds=round(time.monotonic() - t0, 2)))


def _names(nodes) -> str:
    return ",".join(map(str, sorted(nodes)))


def _admit(store, n: int, mine: dict) -> bool:
    """Compare node ``n``'s fingerprint; refuse (and forget its join) on a mismatch."""
    theirs = json.loads(store.get(f"join/{n}"))
    why = mismatch(mine, theirs["fingerprint"], n)
    store.set(f"verdict/{n}", why or "ok")
    if why is None:
        log.info(event("rendezvous node joined", node=n, host=theirs.get("host"),
                       pid=theirs.get("pid")))
        return True
    print(f"warning: {why}; still waiting for a node {n} with the same config",
          file=sys.stderr, flush=True)
    log.warning(event("rendezvous node refused", node=n, reason=why))
    store.delete_key(f"join/{n}")
    return False


def join_run(store, cfg: Config) -> dict:
    """Node n > 0: announce this node, wait for node 0's verdict and the start; returns the
    run facts ``{"run_id", "dist_port"}``. StartupError on refusal or past the timeout."""
    rt = cfg.runtime
    n = rt.node_rank
    store.set(f"verdict/{n}", "")  # NOTE: clear a verdict of an earlier, refused attempt
    store.set(f"join/{n}", json.dumps({"fingerprint": fingerprint(cfg),
                                       "host": socket.gethostname(), "pid": os.getpid()}))
    verdict = _wait_key(store, f"verdict/{n}", cfg)
    if verdict != "ok":
        raise StartupError(verdict)
    _wait_key(store, "go", cfg)
    return json.loads(store.get("run"))


def _wait_key(store, key: str, cfg: Config) -> str:
    """The non-empty value of ``key``; StartupError past the rendezvous timeout."""
    rt = cfg.runtime
    deadline = time.monotonic() + rt.rendezvous_timeout_seconds
    while time.monotonic() < deadline:
        try:
            if store.check([key]):
                v = store.get(key).decode()
                if v:
                    return v
        except Exception as e:  # noqa: BLE001 - the server went away
            raise StartupError(f"rendezvous: lost node 0 at {_where(cfg)} ({_short(e)})"
                               ) from None
        time.sleep(0.1)
    raise StartupError(f"rendezvous: node 0 at {_where(cfg)} did not start the run within "
                       f"--rendezvous_timeout_seconds={rt.rendezvous_timeout_seconds:g} "
                       f"(waiting for {key!r})")


def report_failure(store, node: int, message: str) -> None:
    """Record why ``node`` stops the run (first report of a node wins); never raises."""
    try:
        if not store.check([f"fail/{node}"]):
            store.set(f"fail/{node}", message)
    except Exception:  # noqa: BLE001 - the store (node 0) may be gone already
        pass


def failure_reports(store, nnodes: int, exclude: int) -> dict[int, str] | None:
    """``{node: message}`` of the failures other nodes reported; None when the store is gone
    (node 0's launcher exited: ask no more)."""
    out = {}
    for n in range(nnodes):
        if n == exclude:
            continue
        try:
            if store.check([f"fail/{n}"]):
                out[n] = store.get(f"fail/{n}").decode()
        except Exception:  # noqa: BLE001 - the store (node 0) is gone
            return None
    return out
