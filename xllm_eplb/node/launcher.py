"""One node's launcher in a multi-node run: its shm, its children, its supervision.

Node 0::

    launcher ── engine                      HTTP API, scheduler, EPLB manager (all D ranks)
             ├─ ep<r>, r in node_ranks(0)   its workers
             └─ bridge<n>, n = 1..N-1       one hub per remote node (node/bridge.py)

Node n > 0::

    launcher ── ep<r>, r in node_ranks(n)   its workers
             └─ bridge0                     the relay that fills the node's input ring

Each node creates and sweeps only its own shm objects: run id ``<run>-n<node>`` (node 0 keeps
the D-reader input ring and every rank's output ring of a single-node run; node n has a
k-reader input ring and its k output rings). A failure is reported in the rendezvous store
(``fail/<node>``) so every node's error line names the node and rank that failed; a child of
node n that exits 0 means node 0 stopped the run (the shutdown message reached it).

``--elastic_ep`` across nodes (respawn in place only: the rank set never changes, so no re-plan
crosses nodes): each node's launcher respawns its own dead worker (its ``ElasticSupervisor``).
Node 0's rendezvous TCPStore is also the elastic store (the generations, placement, members and
the ``pg_generation`` counter of ``elastic/protocol.py``), so every node numbers generations from
one counter. Node n has no engine: what it would tell the engine (``WorkerDied``, typed,
``elastic/notices.py``) is queued in that store as ``notice/<n>/<i>`` (:class:`NoticeSender`)
and node 0's launcher forwards each, in order, to its engine (:class:`NoticeForwarder`); a
replacement sets its ``attached`` key in the store itself. The relay (``node/bridge.py``)
answers a step with an empty frame for a rank whose ring producer died, so the survivors'
``peer_lost`` outputs still reach the engine; it also SIGKILLs its node's ranks silent past
``--elastic_silence_seconds`` (``engine/health.silent_ranks``): a hang becomes a death. Losing a
whole node (its launcher) still stops every node cleanly (the bridges' lost link).
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing.connection as mpc
import os
import signal
import sys
import time

from xllm_eplb.config import Config, node_ranks
from xllm_eplb.elastic.notices import notice_from_dict, notice_to_dict
from xllm_eplb.elastic.protocol import next_pg_generation
from xllm_eplb.engine.process import engine_main
from xllm_eplb.launcher import Launcher, RunShm, describe_exit
from xllm_eplb.launcher.events import EventHub
from xllm_eplb.node.bridge import bridge_main
from xllm_eplb.node.rendezvous import failure_reports, report_failure
from xllm_eplb.obs.logs import event
from xllm_eplb.worker.worker import worker_main

log = logging.getLogger(__name__)

#: how long a node waits for the other nodes' failure reports before naming a cause
BLAME_SECONDS = 1.5


def node_run_id(run_id: str, node: int) -> str:
    """Shm run id of one node: ``<run>-n<node>`` (no node sees another node's names)."""
    return f"{run_id}-n{node}"


def primary(code: int | None) -> bool:
    """A death that is a cause, not a consequence: killed by a signal, or an exit code other
    than the generic failure 1 (a worker whose peer died fails its collective with 1)."""
    return code is not None and code not in (0, 1)


# --- --elastic_ep: node n's notices for the engine, through node 0's store -----------------------
#: node 0's launcher reads the remote nodes' notices this often while supervising (seconds)
NOTICE_POLL_SECONDS = 0.05


def notice_key(node: int, i: int) -> str:
    return f"notice/{node}/{i}"


class NoticeSender(EventHub):
    """Node n's event hub: a notice for the engine goes into the store (node 0 forwards it);
    the children's own channels are unchanged."""

    def __init__(self, ctx, store, node: int):
        super().__init__(ctx)
        self.store, self.node, self.sent = store, node, 0

    def notify(self, who: str, notice) -> bool:
        if who != "engine":
            return super().notify(who, notice)
        try:
            self.store.set(notice_key(self.node, self.sent), json.dumps(notice_to_dict(notice)))
        except Exception:  # noqa: BLE001 - node 0's store is gone: the bridges stop the node
            return False
        self.sent += 1
        return True


class NoticeForwarder:
    """Node 0's launcher: the remote nodes' notices, in order per node, to its engine."""

    def __init__(self, store, nnodes: int):
        self.store = store
        self.next = {n: 0 for n in range(1, nnodes)}

    def pump(self, events) -> int:
        """Forward every notice waiting now; returns how many."""
        done = 0
        for n, i in self.next.items():
            while True:
                key = notice_key(n, i)
                if not self.store.check([key]):
                    break
                events.notify("engine", notice_from_dict(json.loads(self.store.get(key))))
                self.store.delete_key(key)
                i += 1
                done += 1
            self.next[n] = i
        return done


class NodeLauncher(Launcher):
    """:class:`~xllm_eplb.launcher.Launcher` for one node of a multi-node run."""

    def __init__(self, cfg: Config, store, origin_run_id: str, store_port: int, *,
                 progress=None):
        super().__init__(cfg, progress=progress)
        self.store, self.origin, self.store_port = store, origin_run_id, store_port
        self.node, self.nnodes = cfg.runtime.node_rank, cfg.runtime.nnodes
        self.stopped_by_node0 = False
        #: --elastic_ep: the remote nodes' notices to the engine (node 0)
        self.forwarder = None
        if cfg.runtime.elastic_ep:
            if self.node:
                self.events = NoticeSender(self.ctx, store, self.node)
            else:
                self.forwarder = NoticeForwarder(store, self.nnodes)

    # --- start -----------------------------------------------------------------------------
    def start(self) -> None:
        cfg, me = self.cfg, os.getpid()
        if self.node == 0:
            self.shm = RunShm.create(cfg)
            if cfg.runtime.elastic_ep:        # the rendezvous store is the elastic store
                next_pg_generation(self.store)
            self._spawn("engine", engine_main, cfg, self.events, me)
            self._wait_stage("engine", "http_bound")
        else:
            self.shm = RunShm.create(cfg, node_ranks(cfg))   # its own ranks only
        if cfg.runtime.elastic_ep:
            # respawn in place only (a rank set cannot change across nodes); a death being
            # replaced is told with this node's own line (no failure report)
            self.elastic = self._supervisor(
                respawn_only=True, node=self.node,
                remote_ranks=cfg.eplb.ep_size - len(node_ranks(cfg)))
        for r in node_ranks(cfg):
            self._spawn(f"ep{r}", worker_main, cfg, r, self.events, me)
        peers = range(1, self.nnodes) if self.node == 0 else [0]
        for p in peers:
            self._spawn(f"bridge{p}", bridge_main, cfg, p, self.origin, self.store_port,
                        self.events, me)
        if self.node == 0:
            self._wait_stage("engine", "ready")
            return
        self._wait_all({(f"ep{r}", "ready") for r in node_ranks(cfg)} | {("bridge0", "linked")})

    # --- failures --------------------------------------------------------------------------
    def death_message(self, who: str, during: str = "serving") -> str:
        return self.blame(who, during)

    def _replace(self, who: str) -> bool:
        """``--elastic_ep``: the supervisor respawns a dead worker of this node in place; with
        node 0's store gone that is a stop, not a respawn."""
        if self.elastic is None:
            return False
        try:
            return self.elastic.replace(who)
        except Exception as e:  # noqa: BLE001 - node 0's store is gone
            log.warning(event("EPLB elastic respawn impossible", proc=who, node=self.node,
                              error=str(e).splitlines()[0][:200] if str(e) else type(e).__name__))
            return False

    def engine_gone(self) -> bool:
        """Node n has no engine: its bridge's exit (node 0's stop or a lost link) says it."""
        if self.node == 0:
            return super().engine_gone()
        return any(q.exitcode is not None for w, q in self.procs.items()
                   if w.startswith("bridge"))

    def replaced_message(self, who: str, during: str = "serving") -> str:
        """A death being replaced is told with this node's own line (no failure report)."""
        return f"node {self.node}: " + Launcher.death_message(self, who, during)

    def blame(self, who: str, during: str = "serving") -> str:
        """The one error line of this node: its own primary failure, else another node's
        reported one, else a lost link (naming the peer node), else the local death."""
        p = self.procs[who]
        p.join(1.0)
        mine = self.replaced_message(who, during)
        is_bridge = who.startswith("bridge")
        if not is_bridge:
            report_failure(self.store, self.node,
                           json.dumps({"message": mine, "primary": primary(p.exitcode)}))
            if primary(p.exitcode):
                return mine
        deadline = time.monotonic() + BLAME_SECONDS
        reports: dict = {}
        while True:
            got = failure_reports(self.store, self.nnodes, self.node)
            if got is None:
                break          # node 0's store is gone: nothing more to learn
            reports = {n: json.loads(m) for n, m in got.items()}
            first = next((r["message"] for n, r in sorted(reports.items()) if r["primary"]),
                         None)
            if first:
                return first
            if time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        self._drain_events()
        lost = [w for w, q in self.procs.items() if w.startswith("bridge")
                and q.exitcode is not None and q.exitcode != 0]
        if lost:
            w = lost[0]
            why = self.errors.get(w, f"bridge {describe_exit(self.procs[w].exitcode)}")
            return f"{why}; node {self.node} stops"
        if reports:
            return next(iter(r["message"] for _, r in sorted(reports.items())))
        return mine

    # --- supervise -------------------------------------------------------------------------
    def supervise(self) -> int:
        """Block until a signal (-> 0), node 0's stop reaching this node (-> 0) or a failure
        anywhere (-> 1, one line naming the node and rank)."""
        sentinels = {p.sentinel: who for who, p in self.procs.items()}
        while not self.stop_signal:
            ready = mpc.wait(list(sentinels), timeout=NOTICE_POLL_SECONDS if self.forwarder else 0.5)
            self._drain_events()
            if self.forwarder is not None:
                self.forwarder.pump(self.events)
            if ready and self._replace(sentinels[ready[0]]):
                sentinels = {p.sentinel: who for who, p in self.procs.items()}
                continue
            if ready and not self._stopping_together():
                who = self._first_failed(sentinels[ready[0]])
                p = self.procs[who]
                p.join(2.0)
                if self.node and p.exitcode == 0:
                    self.stopped_by_node0 = True
                    log.info(event("launcher stop", reason="node 0 stopped the run", proc=who))
                    return 0
                log.error(event("launcher child died", proc=who, pid=p.pid, node=self.node,
                                cause=describe_exit(p.exitcode)))
                print(f"error: {self.blame(who)}", file=sys.stderr, flush=True)
                return 1
        log.info(event("launcher stop", signal=signal.Signals(self.stop_signal).name,
                       node=self.node))
        return 0

    def stop(self, graceful: bool) -> list[str]:
        # NOTE: node n has no engine to send the shutdown message; unless node 0's shutdown
        # is already draining through it, its children are stopped with SIGTERM at once.
        if self.node:
            graceful = self.stopped_by_node0
            if not graceful:
                for p in self.procs.values():
                    if p.exitcode is None:
                        with contextlib.suppress(ProcessLookupError, TypeError):
                            p.terminate()
        return super().stop(graceful)
