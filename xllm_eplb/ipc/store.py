"""The store of an elastic run (``--elastic_ep``, issue #23): a torch.distributed TCPStore
hosted by the launcher at ``--master_addr:--master_port`` (so no worker's death takes it with
it), one client per process: the transport only. What is said through it (every key, the
vote) is ``elastic/protocol.py``'s.

NOTE: torch is imported inside the functions: the engine process loads it only here.
"""

from __future__ import annotations

import socket
from datetime import timedelta


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
