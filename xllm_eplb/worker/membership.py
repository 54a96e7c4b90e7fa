"""A worker's one elastic component (``--elastic_ep``): :class:`WorkerMembership`, its half of
the membership conversation (``elastic/protocol.py``) and its process groups by *membership
generation* (``pg_generation``).

The launcher hosts the run's TCPStore at ``--master_addr:--master_port`` (``ipc/store.py``), so
no worker's death takes the store with it. Generation ``g`` of the world lives under its own
``PrefixStore("gen<g>/")``: every re-formation starts clean, whatever the broken generation
left in the store. Each process has one store client (NOTE: never share a client across
threads; a shared one stalled 2.8 s in measurements).

A survivor whose collective failed keeps its model and KV cache, leaves the broken generation
(``destroy_process_group``: ~30 ms on gloo) and joins the next one at its rank among the
generation's members when the engine says so (``ForwardInput.regroup``, :meth:`regroup`); a
replacement joins that generation at start-up and builds its shard from the placement the
engine deployed; a joiner loads first, waits for the engine's go and joins the generation it
names. Every cached group handle is replaced: the model's EP group and the EPLB executor
(rebuilt on the new EPLB group). The worker's resources stay the worker's: this component asks
it through :class:`WorkerHost` (``release_groups``, ``adopt``, ``reshard``, a joiner's
``load_alone`` and ``attach_input``). The worker asks it at two points: at start
(:meth:`WorkerMembership.start_joiner`) and when a step fails
(:meth:`WorkerMembership.step_failed`).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import time
from datetime import timedelta
from typing import Protocol

import torch.distributed as dist

from xllm_eplb.child import parent_alive, send_event
from xllm_eplb.config import Config
from xllm_eplb.elastic import protocol
from xllm_eplb.ipc import store
from xllm_eplb.ipc.messages import ForwardOutput
from xllm_eplb.ipc.records import WorkerHeartbeat
from xllm_eplb.obs.logs import FILE_ONLY, event
from xllm_eplb.worker import comm

log = logging.getLogger(__name__)

#: a grow's rendezvous (``join(..., rendezvous_s=)``) fails after this many seconds: a member
#: that died after the vote leaves the others waiting this long, not the group timeout
SWITCH_RENDEZVOUS_S = 5.0


def store_client(cfg: Config, timeout_s: float):
    """This worker's one client of the launcher's store."""
    return store.store_client(cfg.runtime.master_addr, cfg.runtime.master_port, timeout_s)


def join(cfg: Config, client, rank: int, pg_generation: int, timeout_s: float,
         world_size: int | None = None, device=None,
         rendezvous_s: float | None = None) -> comm.CommGroups:
    """Join generation ``pg_generation`` of the world (every rank, same order): default group on
    ``PrefixStore("gen<g>/", store)``, then the EPLB group. ``world_size``: the generation's
    ranks (default ``--ep_size``; fewer after an elastic shrink); ``device``: the worker's (a
    compact rank keeps its device). ``rendezvous_s`` (a grow): the rendezvous of both groups
    fails after this many seconds (a member that died after the vote: the others get out
    instead of waiting ``timeout_s``); the groups then take ``timeout_s``."""
    backend = comm.preflight(cfg)
    t0 = time.perf_counter()
    full = timedelta(seconds=timeout_s)
    first = timedelta(seconds=min(rendezvous_s, timeout_s)) if rendezvous_s else full
    dist.init_process_group(backend, store=dist.PrefixStore(f"gen{pg_generation}/", client),
                            rank=rank, world_size=world_size or cfg.eplb.ep_size,
                            timeout=first)
    groups = comm.groups_from_world(cfg, device=device, timeout=first)
    if first != full:
        for g in (groups.ep_group, groups.eplb_group):
            dist.distributed_c10d._set_pg_timeout(full, g)
    log.info(event("EPLB elastic joined", rank=rank, pg_generation=pg_generation,
                   world_size=world_size or cfg.eplb.ep_size,
                   seconds=round(time.perf_counter() - t0, 3)))
    return groups


def leave() -> float:
    """Drop the (broken) groups of this generation; returns the seconds it took."""
    t0 = time.perf_counter()
    with contextlib.suppress(Exception):
        if dist.is_initialized():
            dist.destroy_process_group()
    return time.perf_counter() - t0




class WorkerHost(Protocol):
    """What :class:`WorkerMembership` asks of its worker (``worker/worker.py`` ``Worker``): the
    worker's resources are changed by the worker's own methods only."""

    rank: int
    ep_rank: int
    ep_size: int
    device: object

    def release_groups(self) -> None:
        """Close the executor and the dispatch transport, drop the model's EP group (the
        groups are left next)."""

    def load_alone(self) -> None:
        """A joiner: its output ring and its initial shard, with no process group."""

    def attach_input(self) -> None:
        """A joiner let in: attach the input ring at its newest frame."""

    def adopt(self, groups: comm.CommGroups, pg_generation: int, ep_rank: int, ep_size: int,
              table) -> None:
        """Serve in ``pg_generation`` on ``groups``; ``table`` [L, D*S] (not None): re-shard to
        compact rank ``ep_rank`` of ``ep_size`` first."""

    def reshard(self, ep_rank: int, ep_size: int, table) -> None:
        """Re-shard the model to compact rank ``ep_rank`` of ``ep_size`` under ``table``."""

    def heartbeat(self) -> WorkerHeartbeat:
        """The heartbeat a regroup answer carries."""


class WorkerMembership:
    """One worker's elastic state and its half of the conversation: the store client, the
    membership generation it is in, whether it is a joiner. ``pg_generation`` > 1 at start: a
    replacement (joins that generation at start); ``join``: a rejoin replacement (loads first,
    joins the generation the engine names). Off (``--elastic_ep=false``): generation 0, no
    store; the worker then joins its one world through ``worker/comm.py``."""

    def __init__(self, cfg: Config, rank: int, events, parent_pid: int, pg_generation: int = 0,
                 join: bool = False):
        self.cfg, self.rank, self.events, self.parent_pid = cfg, rank, events, parent_pid
        self.enabled = cfg.runtime.elastic_ep
        #: the process-group generation (1 at start; a replacement starts at > 1; 0: off or a
        #: joiner not joined yet)
        self.pg_generation = max(1, pg_generation) if self.enabled else 0
        #: rejoin: loads first, joins the generation the engine names
        self.joining = bool(join) and self.enabled
        if self.joining:
            self.pg_generation = 0
        self.store = None

    @property
    def replacement(self) -> bool:
        """A respawned worker: it attaches to the newest input frame and joins generation g."""
        return self.pg_generation > 1

    def _alive(self) -> bool:
        return parent_alive(self.parent_pid)

    def connect(self, timeout_s: float) -> None:
        """This worker's one client of the launcher's store."""
        self.store = store_client(self.cfg, timeout_s)

    def join_world(self, timeout_s: float) -> comm.CommGroups:
        """Start-up: the launcher's store (unless connected), then this generation's groups at
        rank ``rank``."""
        if self.store is None:
            self.connect(timeout_s)
        return join(self.cfg, self.store, self.rank, self.pg_generation, timeout_s)

    def announce_attached(self) -> None:
        """A replacement's rings are attached: the engine may send the regroup step."""
        protocol.announce_attached(self.store, self.rank, self.pg_generation)

    def start_placement(self):
        """The placement [L, D*S] a replacement builds its shard from (None: the start one)."""
        return protocol.get_placement(self.store, self.pg_generation) if self.replacement \
            else None

    def wait_go(self) -> int:
        """A loaded joiner: the generation the engine lets it into (a step boundary)."""
        return protocol.wait_go(self.store, self.rank,
                                self.cfg.runtime.elastic_join_timeout_seconds, self._alive)

    def announce_joined(self) -> None:
        protocol.announce_joined(self.store, self.rank)

    def start_joiner(self, host: WorkerHost) -> None:
        """Rejoin: the store client and the model (``host.load_alone``: its initial shard,
        loaded while the others serve), ``join_ready``; then wait for the engine's go (a step
        boundary), attach the input ring at its newest frame and say so. The first message is
        the regroup: :meth:`regroup` re-shards to the planned row and joins."""
        t0 = time.perf_counter()
        self.connect(max(120.0, self.cfg.runtime.worker_timeout_seconds))
        host.load_alone()
        load_s = time.perf_counter() - t0
        log.info(event("EPLB elastic rejoin loaded", rank=self.rank, seconds=round(load_s, 3)))
        send_event(self.events, f"ep{self.rank}", "join_ready", f"{time.time()},{os.getpid()}")
        g = self.wait_go()
        host.attach_input()
        self.announce_joined()
        log.info(event("EPLB elastic rejoin go", rank=self.rank, pg_generation=g,
                       wait_s=round(time.perf_counter() - t0 - load_s, 3)))

    def step_failed(self, host: WorkerHost) -> bool:
        """A step failed on this rank; True: the worker stays up (``peer_lost``) for the
        engine's regroup (elastic EP), False: it reports the error and the run stops.

        The broken groups are dropped at once (``host.release_groups``, :func:`leave`): a
        survivor still blocked in this step's collective on *this* rank (not on the dead one)
        then fails at once instead of at the group timeout (gloo pairs: the closed sockets end
        its wait). NOTE: a group's sockets close only when nothing holds it (the model's EP
        group and the executor's EPLB group too; the regroup replaces both), then a
        young-generation gc pass for its cycles (~1 ms; a full one costs 0.1-0.4 s); measured
        (2 nodes): with ``destroy_process_group()`` alone a peer blocked 12 s, until this
        process exited."""
        if not self.enabled:
            return False
        host.release_groups()
        leave()
        gc.collect(1)
        return True

    def regroup(self, msg, host: WorkerHost) -> ForwardOutput:
        """Leave the broken generation, join ``msg.regroup`` at this worker's rank among the
        generation's members (the engine's list in the store: same ranks after a respawn,
        compact ranks after a shrink), replace every group handle (``host.adopt``). A shrink
        also re-shards the model (``Decoder.reshard``: the few orphan experts read from the
        checkpoint) and runs the transfer canary. A replacement already in that generation only
        answers. A grow (the world gets bigger: a rejoin switch) is voted first, before this
        rank leaves its groups (:meth:`_vote`): abandoned, it answers ``switch abandoned`` and
        stays in its generation; its rendezvous is bounded by ``SWITCH_RENDEZVOUS_S``. A
        failed re-form leaves a serving rank up (``peer_lost``): the engine re-forms it or
        stops the run."""
        try:
            if msg.regroup != self.pg_generation:
                out = self._reform(msg, host)
                if out is not None:
                    return out
        except Exception as e:  # noqa: BLE001 - reported; the engine recovers or stops
            # NOTE: a serving rank stays up (``peer_lost``): a member that died during a grow
            # fails the rendezvous, and the engine re-forms the survivors (``elastic/recovery.py``)
            log.exception(event("EPLB elastic re-form failed", rank=self.rank), extra=FILE_ONLY)
            return ForwardOutput(step=msg.step, rank=host.ep_rank, peer_lost=not self.joining,
                                 error=f"rank {self.rank}: re-form failed: {type(e).__name__}: {e}")
        return ForwardOutput(step=msg.step, rank=host.ep_rank, heartbeat=host.heartbeat())

    def _reform(self, msg, host: WorkerHost) -> ForwardOutput | None:
        """Join generation ``msg.regroup``; an abandoned grow's answer, else None."""
        t0, g = time.perf_counter(), msg.regroup
        members = protocol.get_members(self.store, g)
        rank, size = members.index(self.rank), len(members)
        grow = self.joining or size > host.ep_size
        if grow and not self._vote(host, rank, size, g):
            log.warning(event("EPLB elastic switch abandoned", rank=self.rank,
                              pg_generation=g, stays=self.pg_generation))
            return ForwardOutput(step=msg.step, rank=host.ep_rank, peer_lost=True,
                                 error=protocol.ABANDONED)
        host.release_groups()
        left = leave()
        groups = join(self.cfg, self.store, rank, g, self.cfg.runtime.elastic_join_timeout_seconds,
                      world_size=size, device=host.device,
                      rendezvous_s=SWITCH_RENDEZVOUS_S if grow else None)
        table = protocol.get_placement(self.store, g) if size != host.ep_size else None
        host.adopt(groups, g, rank, size, table)
        self.pg_generation = g
        if self.joining:
            self.joining = False
            send_event(self.events, f"ep{self.rank}", "joined", str(g))
        log.info(event("EPLB elastic re-formed", rank=self.rank, ep_rank=host.ep_rank,
                       ep_size=host.ep_size, pg_generation=g, leave_s=round(left, 3),
                       seconds=round(time.perf_counter() - t0, 3)))
        return None

    def _vote(self, host: WorkerHost, rank: int, size: int, pg_generation: int) -> bool:
        """A grow (a joiner, or a serving rank whose world grows): decided by
        every member before anyone leaves its groups (``protocol.vote``). The joiner re-shards
        to its planned row first (no group needed), so that a death after the decision can
        only fall in the short rendezvous. False: abandoned (a death during the switch); a
        joiner then exits (the launcher starts it again), a serving rank stays in its
        generation."""
        rt = self.cfg.runtime
        if self.joining:
            host.reshard(rank, size, protocol.get_placement(self.store, pg_generation))
        go = protocol.vote(self.store, pg_generation, size, rt.elastic_join_timeout_seconds,
                           self._alive)
        if not go and self.joining:
            raise RuntimeError(f"{protocol.ABANDONED} (pg_generation {pg_generation})")
        return go
