"""Elastic EP (``--elastic_ep``, issue #23): a worker's process groups by *membership
generation* (``pg_generation``, ``elastic/protocol.py``).

The launcher hosts the run's TCPStore at ``--master_addr:--master_port`` (``ipc/store.py``), so
no worker's death takes the store with it. Generation ``g`` of the world lives under its own
``PrefixStore("gen<g>/")``: every re-formation starts clean, whatever the broken generation
left in the store. Each process has one store client (NOTE: never share a client across
threads; a shared one stalled 2.8 s in measurements).

A survivor whose collective failed keeps its model and KV cache, leaves the broken generation
(``destroy_process_group``: ~30 ms on gloo) and joins the next one with the same rank when the
engine says so (``ForwardInput.regroup``); a replacement joins that generation at start-up and
builds its shard from the placement the engine deployed (``get_placement``). Every cached
group handle is replaced: the model's EP group and the EPLB executor (rebuilt on the new EPLB
group).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from datetime import timedelta

import torch.distributed as dist

from xllm_eplb.config import Config
from xllm_eplb.ipc import store
from xllm_eplb.ipc.store import arrived_key, decide, decision_key, join_key, joined_key
from xllm_eplb.obs.logs import event
from xllm_eplb.worker import comm

log = logging.getLogger(__name__)

#: a grow's rendezvous (``join(..., rendezvous_s=)``) fails after this many seconds: a member
#: that died after the vote leaves the others waiting this long, not the group timeout
SWITCH_RENDEZVOUS_S = 5.0


def store_client(cfg: Config, timeout_s: float):
    """This worker's one client of the launcher's store."""
    return store.store_client(cfg.runtime.master_addr, cfg.runtime.master_port, timeout_s)


def get_placement(client, pg_generation: int):
    """The placement ``[L, D*S]`` the engine deployed for ``pg_generation``."""
    return store.get_placement(client, pg_generation)


def get_members(client, pg_generation: int) -> list[int]:
    """The workers of ``pg_generation`` in compact rank order (an elastic shrink drops one)."""
    return store.get_members(client, pg_generation)


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


# --- rejoin (``elastic/recovery.py``): the engine's go and the joiner's answer, per joiner pid ---
def _wait_key(client, key: str, slice_s: float, timeout_s: float, alive, what: str,
              limit: str) -> bytes:
    """The value of store ``key`` once set, waited for in ``slice_s`` slices; ``alive()`` False
    (the launcher gone) or ``timeout_s`` raise, naming ``what`` and the ``limit``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            client.wait([key], timedelta(seconds=slice_s))
            return bytes(client.get(key))
        except Exception:  # noqa: BLE001 - the store's wait timeout: check, then again
            if not alive():
                raise RuntimeError(f"{what}: the launcher is gone") from None
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: {limit} within {timeout_s:g} s "
                                   "(--elastic_join_timeout_seconds)") from None


def wait_join(client, worker: int, timeout_s: float, alive) -> int:
    """A loaded joiner waits for the engine's go (the generation it joins, set at a step
    boundary); ``alive()`` False (the launcher gone) or ``timeout_s`` raise."""
    return int(_wait_key(client, join_key(worker, os.getpid()), 1.0, timeout_s, alive,
                         "rejoin", "no go from the engine").decode())


def vote(client, pg_generation: int, size: int, timeout_s: float, alive) -> bool:
    """A grow to ``pg_generation`` (``size`` members) is decided before anyone leaves its groups:
    each member arrives; the last one decides ``go``, unless the engine decided ``abort`` first
    (a death during the switch, ``elastic/recovery.py``). True: go (every member was alive at its
    arrival); False: the switch is abandoned, the serving ranks stay in their generation.
    ``alive()`` False (the launcher gone) or ``timeout_s`` raise."""
    if int(client.add(arrived_key(pg_generation), 1)) == size:
        decide(client, pg_generation, "go")
    return _wait_key(client, decision_key(pg_generation), 0.1, timeout_s, alive, "switch",
                     "no decision") == b"go"


def announce_joined(client, worker: int) -> None:
    """The joiner reads the input ring from the newest frame on: the engine may send."""
    client.set(joined_key(worker, os.getpid()), b"1")
