"""The store of an elastic run (``--elastic_ep``, issue #23): a torch.distributed TCPStore
hosted by the launcher at ``--master_addr:--master_port`` (so no worker's death takes it with
it), one client per process. Keys: each process-group generation rendezvouses under its own
``PrefixStore("gen<g>/")`` (``worker/regroup.py``); ``placement/gen<g>`` holds the placement
``[L, D*S]`` int64 the engine deployed when it asked for generation ``g``, which a
replacement worker loads its shard from.

NOTE: torch is imported inside the functions: the engine process loads it only here.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import numpy as np


def listen_socket(addr: str, port: int) -> socket.socket:
    """A listening TCP socket on ``addr:port`` only (issue 35: c10d's own store server listens
    on every interface, ``*:PORT``, whatever host it is given; anyone who reaches it could
    write the store). OSError when the address cannot be bound."""
    family, kind, proto, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(128)
    except BaseException:
        sock.close()
        raise
    return sock


def interface_of(addr: str) -> str | None:
    """The name of this machine's network interface that holds ``addr`` (``lo`` for
    127.0.0.1), None when none does (another node's address, a name that does not resolve)."""
    import psutil

    try:
        ips = {a[4][0] for a in socket.getaddrinfo(addr, None)}
    except OSError:
        return None
    return next((name for name, addrs in psutil.net_if_addrs().items()
                 if any(a.address.split("%")[0] in ips for a in addrs)), None)


def host_store(addr: str, port: int, timeout_s: float, wait_for_workers: bool = False,
               world_size: int | None = None):
    """A TCPStore server listening on ``addr:port`` only (:func:`listen_socket`; c10d takes
    over the socket): the launcher's elastic store, worker rank 0's process-group store and
    node 0's rendezvous all start here."""
    import torch.distributed as dist

    sock = listen_socket(addr, port)
    try:
        store = dist.TCPStore(addr, port, world_size, is_master=True,
                              wait_for_workers=wait_for_workers,
                              timeout=timedelta(seconds=timeout_s), master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    sock.detach()           # the store's server owns the descriptor now (it closes it)
    return store


def store_client(addr: str, port: int, timeout_s: float):
    """One client of the launcher's store (NOTE: never shared across threads)."""
    import torch.distributed as dist

    return dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=timeout_s))


def placement_key(pg_generation: int) -> str:
    return f"placement/gen{pg_generation}"


def put_placement(store, pg_generation: int, table: np.ndarray) -> None:
    """Store the deployed placement ``table`` [L, D*S] for ``pg_generation``."""
    t = np.ascontiguousarray(table, dtype=np.int64)
    store.set(placement_key(pg_generation), f"{t.shape[0]},{t.shape[1]};".encode() + t.tobytes())


def get_placement(store, pg_generation: int) -> np.ndarray:
    """The placement of ``pg_generation`` (waits until the engine has set it)."""
    raw = bytes(store.get(placement_key(pg_generation)))
    head, body = raw.split(b";", 1)
    shape = tuple(int(x) for x in head.decode().split(","))
    return np.frombuffer(body, dtype=np.int64).reshape(shape).copy()


def members_key(pg_generation: int) -> str:
    return f"members/gen{pg_generation}"


def put_members(store, pg_generation: int, workers: list[int]) -> None:
    """The workers of ``pg_generation`` in compact rank order (worker ``workers[r]`` is EP rank
    ``r``): an elastic shrink drops the dead one, the survivors take compact ranks."""
    store.set(members_key(pg_generation), ",".join(map(str, workers)).encode())


def get_members(store, pg_generation: int) -> list[int]:
    """The workers of ``pg_generation`` (waits until the engine has set them)."""
    return [int(x) for x in bytes(store.get(members_key(pg_generation))).decode().split(",")]


# --- rejoin (``elastic/recovery.py`` <-> ``worker/regroup.py``): the engine's go and the joiner's
# answer, per joiner pid
def join_key(worker: int, pid: int) -> str:
    return f"join/ep{worker}/pid{pid}"


def joined_key(worker: int, pid: int) -> str:
    return f"joined/ep{worker}/pid{pid}"


#: a serving rank's answer to a grow the engine abandoned (the vote said ``abort``): it is still
#: in its generation, groups intact (``ForwardOutput.error``, with ``peer_lost``)
ABANDONED = "switch abandoned"


# --- the vote of a grow (``worker/regroup.py`` ``vote``, ``elastic/recovery.py``): the members of
# generation g arrive (``add``); the last one sets the decision ``go``, unless the engine set
# ``abort`` first (a death during the switch): ``compare_set`` on an absent key, first wins
def arrived_key(pg_generation: int) -> str:
    return f"switch/gen{pg_generation}/arrived"


def decision_key(pg_generation: int) -> str:
    return f"switch/gen{pg_generation}/decision"


def decide(store, pg_generation: int, decision: str) -> str:
    """Set the decision of the grow to ``pg_generation`` unless one is set; returns the one that
    holds (``go`` or ``abort``)."""
    return bytes(store.compare_set(decision_key(pg_generation), "", decision)).decode()
