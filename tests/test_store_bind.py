"""``ipc/store.py`` ``host_store`` (issue 35 item 9): the TCPStore servers of a run (worker rank
0's group store, the elastic store, node 0's rendezvous) listen on the given address only,
not on every interface as c10d's own server does."""

from __future__ import annotations

import psutil

from xllm_eplb.ipc.store import host_store, interface_of, listen_socket, store_client
from xllm_eplb.testing.serving import free_port


def _listening() -> set[tuple[str, int]]:
    return {(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections("inet")
            if c.status == psutil.CONN_LISTEN}


def test_host_store_listens_on_its_address_only_and_serves_clients():
    port = free_port()
    store = host_store("127.0.0.1", port, 10)
    assert ("127.0.0.1", port) in _listening()
    assert not [a for a in _listening() if a[1] == port and a[0] != "127.0.0.1"]
    client = store_client("127.0.0.1", port, 10)
    client.set("k", "v")
    assert bytes(store.get("k")) == b"v"
    del client, store                              # the store closes its socket
    listen_socket("127.0.0.1", port).close()       # the port is free again


def test_interface_of_names_the_loopback_and_nothing_for_another_host():
    assert interface_of("127.0.0.1") == interface_of("localhost") is not None
    assert interface_of("192.0.2.1") is None      # TEST-NET-1: on no interface here
