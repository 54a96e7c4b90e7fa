"""Elastic EP across nodes (``--elastic_ep`` with ``--nnodes`` > 1, issue #23 item 9): a worker
on any node that dies is respawned in place by its own node's launcher (``--elastic_rejoin=false``,
``--elastic_restart=true``: the rank set never changes, so no re-plan crosses nodes).

What differs from one node:

* **the store**: node 0's rendezvous TCPStore (``--master_addr:--master_port``, hosted by node
  0's launcher) is also the elastic store: the workers' generations (``gen<g>/``), the
  placement, the members and the ``pg_generation`` counter (``elastic/protocol.py``) live there, so
  every node's launcher numbers generations from one counter;
* **the engine's notices**: node n's launcher has no engine; what it would tell the engine
  (``WorkerDied(..., mode="respawn")``; typed records, ``elastic/notices.py``; the
  replacement's ``attached`` key it sets in the store itself, ``elastic/protocol.py``) is queued in that store as ``notice/<n>/<i>`` (JSON of ``to_dict``)
  (:class:`NoticeSender`) and node 0's launcher forwards each, in order, to its engine
  (:class:`NoticeForwarder`, polled every ``NOTICE_POLL_SECONDS``);
* **the relay** (``node/bridge.py``) answers a step with an empty frame for a rank whose ring
  producer died (``PeerDeadError``), so the survivors' ``peer_lost`` outputs still reach the
  engine, which then fences and re-forms as on one node;
* **a hang**: node 0's hub reads the remote ranks' input frames at once, so the engine never
  sees them unread; node n's relay checks its own ranks instead (:func:`silent_ranks`) past
  ``--elastic_silence_seconds`` and its launcher SIGKILLs them: a hang becomes a death.

Losing a whole node (its launcher) still stops every node cleanly (the bridges' lost link).
"""

from __future__ import annotations

import contextlib
import json

from xllm_eplb.elastic.notices import notice_from_dict, notice_to_dict
from xllm_eplb.engine.health import reader_behind, reader_pid, stopped
from xllm_eplb.launcher.events import EventHub

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


def silent_ranks(ring, ranks: list[int]) -> list[int]:
    """The node's ranks (global ids; reader ``i`` of the node's input ring is ``ranks[i]``)
    that have not read the newest frame, else those whose process is stopped (SIGSTOP)."""
    with contextlib.suppress(Exception):
        behind = [r for i, r in enumerate(ranks) if reader_behind(ring, i)]
        return behind or [r for i, r in enumerate(ranks) if stopped(reader_pid(ring, i))]
    return []
