"""Elastic EP supervision (``--elastic_ep``, #23): the launcher hosts the run's TCPStore (not
worker 0: any worker may die) and decides, on a worker's death, how it is replaced (up to
``--elastic_max_restarts``; the mode travels in the engine's notice):

    rejoin   (``--elastic_restart``, ``--elastic_rejoin``, and the N-1 survivors can hold every
             expert) the survivors shrink at once (``engine/shrink.py``); a replacement worker
             starts in the background, loads its model and signals ``join_ready``; the engine
             grows back at a step boundary (``engine/rejoin.py``). One not ready within
             ``--elastic_join_timeout_seconds`` is SIGKILLed and dropped: N-1 ranks keep
             serving
    respawn  (``--elastic_rejoin=false``, or the rule fails for N-1; only at full size) the
             worker is respawned in place; the service waits for it
    shrink   (``--elastic_restart=false``, or the restarts used up) it is left out

A serving rank's death while joiners load drops them (SIGKILL) and is handled as above; in
rejoin mode each dropped joiner is started again once reaped (``EPLB elastic rejoin restart``,
a restart apiece while restarts remain), so the run grows back to N one joiner at a time. A
joiner that dies by itself (loading, or after ``join_ready`` but before its switch) is started
again too. A joiner dropped for ``--elastic_join_timeout_seconds`` is not: N-1 keep serving, no
rank changes generation. A death during a switch is told as above; the engine abandons the
switch and recovers (``engine/rejoin.py``).
The launcher also SIGKILLs a worker the engine found silent (``--elastic_silence_seconds``): a
hang becomes a death. Generations are numbered by one counter in the store (``generation``),
shared by the launcher's deaths and the engine's grows.

:class:`ElasticSupervision` is mixed into :class:`~xllm_eplb.launcher.launcher.Launcher`; it
uses the launcher's ``cfg``, ``procs``, ``events``, ``errors``, ``stop_signal``, ``store``,
``generation``, ``restarts``, ``joining``, ``dropped``, ``rejoin_after``, ``death_message``
and ``_spawn``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time

from xllm_eplb.eplb.shrink_plan import ShrinkError, check_rule
from xllm_eplb.ipc.store import host_store
from xllm_eplb.launcher.exits import describe_exit
from xllm_eplb.obs.logs import event
from xllm_eplb.worker.worker import worker_main

log = logging.getLogger(__name__)

#: the store key of the generation counter (``store.add`` returns the next generation)
GENERATION_KEY = "generation"


class ElasticSupervision:
    """The launcher's ``--elastic_ep`` part: store hosting, replacement, joiners, fencing."""

    def _host_store(self) -> None:
        """Host the run's TCPStore (``--master_addr:--master_port``) in the launcher."""
        rt = self.cfg.runtime
        self.store = host_store(rt.master_addr, rt.master_port,
                                rt.elastic_join_timeout_seconds)
        self.store.add(GENERATION_KEY, 1)          # generation 1: the start

    def _next_generation(self) -> int:
        return int(self.store.add(GENERATION_KEY, 1))

    def _engine_gone(self) -> bool:
        return self.procs["engine"].exitcode is not None

    def _serving(self) -> int:
        """EP ranks serving now (joiners not counted)."""
        return sum(1 for w in self.procs if w.startswith("ep") and w not in self.joining
                   and w not in self.dropped)

    def _rule_holds(self, size: int) -> bool:
        try:
            check_rule(size, self.cfg.slots_per_rank, self.cfg.model.num_experts)
        except ShrinkError:
            return False
        return True

    def _replace(self, who: str) -> bool:
        """``--elastic_ep``: replace dead worker ``who`` (see the module docstring). Tells the
        engine ``("died", who, message, generation, seen_at, mode)``; False when this death
        stops the run (elasticity off, the engine, a stop)."""
        rt = self.cfg.runtime
        if (not rt.elastic_ep or not who.startswith("ep") or self.stop_signal
                or self._engine_gone()):
            return False
        p = self.procs[who]
        p.join(2.0)
        if who in self.joining or who in self.dropped:
            return self._joiner_gone(who)
        # NOTE: exit 0 is the engine's shutdown message reaching the worker: a stop, no death
        if p.exitcode in (None, 0):
            return False
        size = self._serving()
        respawn = rt.elastic_restart and self.restarts < rt.elastic_max_restarts
        rejoin = respawn and rt.elastic_rejoin and self._rule_holds(size)
        # NOTE: a respawn in place takes the worker's own rank in a full world: a shrunk one
        # (a joiner dropped earlier) shrinks again, or stops cleanly naming the rule
        respawn = respawn and (rejoin or size == self.cfg.eplb.ep_size)
        self.restarts += respawn
        # the joiners loading are dropped; in rejoin mode (the survivors still hold every
        # expert) each is started again once reaped, a restart apiece while restarts remain
        self._drop_joiners(f"serving worker {who} died", restart=rejoin)
        self.generation = self._next_generation()
        msg = self.death_message(who)
        seen = time.time()
        mode = "rejoin" if rejoin else ("respawn" if respawn else "shrink")
        log.warning(event("EPLB elastic detect", proc=who, pid=p.pid,
                          cause=describe_exit(p.exitcode), generation=self.generation,
                          mode=mode, restart=self.restarts, message=msg))
        self.events.notify("engine", ("died", who, msg, self.generation, seen, mode))
        self.errors.pop(who, None)
        if mode == "respawn":
            self._spawn(who, worker_main, self.cfg, int(who[2:]), self.events, os.getpid(),
                        self.generation)
            return True
        self._retire(who)                       # the survivors go on without it
        if mode == "rejoin":     # the replacement loads in the background, then joins
            self._spawn(who, worker_main, self.cfg, int(who[2:]), self.events, os.getpid(), 0,
                        join=True)
            self.joining[who] = {"t0": time.monotonic(), "wall": time.time(), "ready": False}
            log.warning(event("EPLB elastic rejoin start", proc=who,
                              pid=self.procs[who].pid, ep_size=f"{size - 1}->{size}",
                              timeout_s=rt.elastic_join_timeout_seconds))
        return True

    def _retire(self, who: str) -> None:
        """Forget exited worker ``who``: its ``Process`` is closed, which frees its sentinel fd
        (a kept one leaked an fd per kill: a 10-minute chaos soak grew 186 -> 202)."""
        p = self.procs.pop(who)
        with contextlib.suppress(ValueError):       # not reaped yet: the finalizer frees it
            p.close()

    def _joiner_gone(self, who: str) -> bool:
        """A joiner exited: dropped (reaped here; one dropped for a serving rank's death in
        rejoin mode starts again: :meth:`_restart_dropped`), or it died (another joiner
        starts, restarts permitting; the engine keeps waiting for ``join_ready``; one that died
        after ``join_ready`` is dropped by the engine first, and if the engine was switching
        to it, the switch is abandoned). Without restarts left the engine is told
        ``join_dropped``: N-1 ranks keep serving. The serving ranks are not touched."""
        info = self.joining.pop(who, None)
        msg = "" if who in self.dropped else self.death_message(who, during="its rejoin")
        self._retire(who)
        if who in self.dropped:
            self.dropped.discard(who)
            why = self.rejoin_after.pop(who, None)
            if why is not None:
                self._restart_dropped(who, why)
            return True
        rt = self.cfg.runtime
        if (info is not None and rt.elastic_restart
                and self.restarts < rt.elastic_max_restarts):
            if info["ready"]:    # the engine has its join_ready: it drops it, keeps waiting
                self.events.notify("engine", ("join_dropped", who, msg, True))
            self.restarts += 1
            self._start_joiner(who)
            log.warning(event("EPLB elastic rejoin restart", proc=who, why=msg,
                              pid=self.procs[who].pid, restart=self.restarts))
            return True
        self.events.notify("engine", ("join_dropped", who, msg))
        log.warning(event("EPLB elastic rejoin dropped", proc=who, why=msg,
                          serving=self._serving()))
        return True

    def _start_joiner(self, who: str) -> None:
        self._spawn(who, worker_main, self.cfg, int(who[2:]), self.events, os.getpid(), 0,
                    join=True)
        self.joining[who] = {"t0": time.monotonic(), "wall": time.time(), "ready": False}

    def _restart_dropped(self, who: str, why: str) -> None:
        """Start a new joiner for ``who``, reaped after :meth:`_drop_joiners` dropped it for a
        serving rank's death (its restart was counted then; the engine kept it joining). The
        serving ranks still hold every expert (the death was handled in rejoin mode), so
        growing back is allowed; a run that is stopping starts nothing."""
        if self.stop_signal or self._engine_gone():
            return
        if not self._rule_holds(self._serving() + 1):      # the engine's shrink stops the run
            self.events.notify("engine", ("join_dropped", who, why))
            return
        self._start_joiner(who)
        log.warning(event("EPLB elastic rejoin restart", proc=who,
                          why=f"dropped: {why}", pid=self.procs[who].pid,
                          restart=self.restarts, serving=self._serving()))

    def _drop_joiners(self, why: str, restart: bool = False) -> None:
        """SIGKILL every joiner (a serving rank died); the engine is told. ``restart``: each
        is started again once reaped, while restarts remain (counted here), and the engine
        keeps waiting for it (``("join_dropped", who, why, True)``)."""
        rt = self.cfg.runtime
        for who in list(self.joining):
            info = self.joining.pop(who)
            self.dropped.add(who)
            again = restart and self.restarts < rt.elastic_max_restarts
            if again:
                self.restarts += 1
                self.rejoin_after[who] = why
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.procs[who].pid, signal.SIGKILL)
            self.events.notify("engine", ("join_dropped", who, why, again))
            log.warning(event("EPLB elastic rejoin dropped", proc=who, why=why,
                              after_s=round(time.monotonic() - info["t0"], 3),
                              serving=self._serving() - 1,      # the dead one not yet retired
                              restart="yes" if again else "no"))

    def _check_joiners(self) -> None:
        """A joiner not ready within ``--elastic_join_timeout_seconds`` is dropped."""
        limit = self.cfg.runtime.elastic_join_timeout_seconds
        late = [w for w, i in self.joining.items()
                if not i["ready"] and time.monotonic() - i["t0"] > limit]
        for who in late:
            info = self.joining.pop(who)
            self.dropped.add(who)
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.procs[who].pid, signal.SIGKILL)
            self.events.notify("engine", ("join_dropped", who, "timeout"))
            log.warning(event("EPLB elastic rejoin dropped", proc=who,
                              why=f"not ready within --elastic_join_timeout_seconds={limit:g}",
                              after_s=round(time.monotonic() - info["t0"], 3),
                              serving=self._serving(), generation="unchanged"))

    def _elastic_event(self, who: str, stage: str, detail: str) -> None:
        """A replacement attached its rings (-> the engine may send the regroup); a joiner is
        loaded (``join_ready``: the engine grows at its next step boundary) or joined; or the
        engine asks for a silent worker to be SIGKILLed (a hang becomes a death)."""
        if stage == "attached":
            self.events.notify("engine", ("attached", who, int(detail or 0)))
        elif stage == "join_ready" and who in self.joining:
            info = self.joining[who]
            ready_at, pid = detail.split(",")
            if int(pid) != self.procs[who].pid:   # a dropped predecessor's late event
                return
            info["ready"] = True
            self.events.notify("engine", ("join_ready", who, info["wall"], float(ready_at),
                                          int(pid)))
        elif stage == "joined":
            self.joining.pop(who, None)
        elif who == "engine" and detail in self.procs and detail.startswith("ep"):
            p = self.procs[detail]
            log.warning(event("EPLB elastic fence silent worker", proc=detail, pid=p.pid,
                              signal="SIGKILL"))
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)
