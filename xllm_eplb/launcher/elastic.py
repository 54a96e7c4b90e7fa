"""Elastic EP supervision (``--elastic_ep``, #23): the launcher hosts the run's TCPStore (not
worker 0: any worker may die), replaces a dead worker in place for the next generation (up to
``--elastic_max_restarts``) or, with ``--elastic_restart=false`` or the restarts used up, leaves
it out (the survivors shrink to N-1 ranks: ``engine/shrink.py``), tells the engine, and SIGKILLs a worker the engine found silent
(``--elastic_silence_seconds``): a hang becomes a death.

:class:`ElasticSupervision` is mixed into :class:`~xllm_eplb.launcher.launcher.Launcher`; it
uses the launcher's ``cfg``, ``procs``, ``events``, ``errors``, ``stop_signal``, ``store``,
``generation``, ``restarts``, ``retired``, ``death_message`` and ``_spawn``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time

from xllm_eplb.ipc.store import host_store
from xllm_eplb.launcher.exits import describe_exit
from xllm_eplb.obs.logs import event
from xllm_eplb.worker.worker import worker_main

log = logging.getLogger(__name__)


class ElasticSupervision:
    """The launcher's ``--elastic_ep`` part: store hosting, in-place replacement, fencing."""

    def _host_store(self) -> None:
        """Host the run's TCPStore (``--master_addr:--master_port``) in the launcher."""
        rt = self.cfg.runtime
        self.store = host_store(rt.master_addr, rt.master_port,
                                rt.elastic_join_timeout_seconds)

    def _replace(self, who: str) -> bool:
        """``--elastic_ep``: respawn dead worker ``who`` in place for the next generation, or
        (``--elastic_restart=false``, or the restarts used up) leave it out: the survivors
        shrink. Tells the engine ``("died", who, message, generation, seen_at, mode)``; False
        when this death stops the run (elasticity off, the engine, a stop)."""
        rt = self.cfg.runtime
        if (not rt.elastic_ep or not who.startswith("ep") or self.stop_signal
                or self.procs["engine"].exitcode is not None):
            return False
        p = self.procs[who]
        p.join(2.0)
        # NOTE: exit 0 is the engine's shutdown message reaching the worker: a stop, no death
        if p.exitcode in (None, 0):
            return False
        respawn = rt.elastic_restart and self.restarts < rt.elastic_max_restarts
        self.restarts += respawn
        self.generation += 1
        msg = self.death_message(who)
        seen = time.time()
        mode = "respawn" if respawn else "shrink"
        log.warning(event("EPLB elastic detect", proc=who, pid=p.pid,
                          cause=describe_exit(p.exitcode), generation=self.generation,
                          mode=mode, restart=self.restarts, message=msg))
        self.events.notify("engine", ("died", who, msg, self.generation, seen, mode))
        self.errors.pop(who, None)
        if respawn:
            self._spawn(who, worker_main, self.cfg, int(who[2:]), self.events, os.getpid(),
                        self.generation)
        else:         # the survivors go on without it (the engine stops if they cannot)
            self.retired[who] = self.procs.pop(who)
        return True

    def _elastic_event(self, who: str, stage: str, detail: str) -> None:
        """A replacement attached its rings (-> the engine may send the regroup), or the
        engine asks for a silent worker to be SIGKILLed (a hang becomes a death)."""
        if stage == "attached":
            self.events.notify("engine", ("attached", who, int(detail or 0)))
        elif who == "engine" and detail in self.procs and detail.startswith("ep"):
            p = self.procs[detail]
            log.warning(event("EPLB elastic fence silent worker", proc=detail, pid=p.pid,
                              signal="SIGKILL"))
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)
