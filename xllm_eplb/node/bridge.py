"""Engine <-> one remote node: the same ``ForwardInput`` / ``ForwardOutput`` messages, carried
over a two-process gloo control group (torch.distributed send/recv, no protocol of our own).

For every remote node ``n`` there is one pair of bridge processes::

    node 0: bridge<n> (hub)    reads ranks(n)' frames of node 0's input ring, sends one copy;
                               receives the node's outputs and fills node 0's out<r> rings
    node n: bridge0 (relay)    writes the frame into node n's input ring, reads the node's
                               out<r> rings, sends them back in one message

so the engine sees exactly the rings of a single-node run, and inside a node the shm rings stay
the fast path. Wire (one gloo ``send`` of an int64 header ``[kind, nbytes]``, then the body)::

    FRAME  hub -> relay  a ForwardInput body (node 0's run id)
    REPLY  relay -> hub  msgpack list of the node's ForwardOutput bodies (node 0's run id),
                         rank order; [] after the shutdown message
    PING / PONG          every ``PING_SECONDS`` of idle: a lost node is noticed within ~1 s

The control group rendezvouses on node 0's TCPStore (prefix ``ctl<n>/``). ``--elastic_ep``: a
REPLY frame is empty for a rank that died under the step (``node/launcher.py``). NOTE: a lost peer
(process gone, connection closed) makes the blocked gloo call raise; the bridge then reports
``control link lost`` and exits 1, and its launcher stops the node.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from datetime import timedelta
from pathlib import Path

import msgpack
import torch
import torch.distributed as dist

from xllm_eplb.child import child_exit, child_setup, parent_alive, send_event
from xllm_eplb.config import Config, node_ranks
from xllm_eplb.elastic.notices import SilenceFence
from xllm_eplb.engine.health import silent_ranks
from xllm_eplb.ipc.errors import PeerDeadError, RingTimeoutError
from xllm_eplb.ipc.messages import KIND_INPUT, decode, encode
from xllm_eplb.ipc.objects import sweep_until_clean
from xllm_eplb.ipc.ring import InputRing, OutputRing
from xllm_eplb.obs.logs import event, setup_logging

log = logging.getLogger(__name__)

FRAME, REPLY, PING, PONG = 1, 2, 3, 4
PING_SECONDS = 1.0
ATTACH_TIMEOUT = 60.0
#: --elastic_ep: the relay waits for an output in slices this long between silence checks
FENCE_SLICE = 0.25
#: gloo waits of the control group: the first forward waits for every shard to load
LINK_TIMEOUT = 600.0


class LinkLost(RuntimeError):
    """The peer bridge is gone (gloo send/recv failed)."""


class Link:
    """One side (0 = node 0's hub, 1 = the remote relay) of a node's gloo control pair."""

    def __init__(self, addr: str, store_port: int, node: int, side: int, timeout_s: float):
        store = dist.TCPStore(addr, store_port, None, False,
                              timeout=timedelta(seconds=timeout_s))
        dist.init_process_group("gloo", store=dist.PrefixStore(f"ctl{node}/", store),
                                rank=side, world_size=2,
                                timeout=timedelta(seconds=LINK_TIMEOUT))
        self.peer, self.node = 1 - side, node
        self.sent_bytes = self.recv_bytes = 0

    def send(self, kind: int, body: bytes = b"") -> None:
        try:
            dist.send(torch.tensor([kind, len(body)], dtype=torch.int64), self.peer)
            if body:
                dist.send(torch.frombuffer(bytearray(body), dtype=torch.uint8), self.peer)
        except Exception as e:  # noqa: BLE001 - gloo raises RuntimeError/DistError
            raise LinkLost(_first_line(e)) from None
        self.sent_bytes += len(body)

    def recv(self) -> tuple[int, bytes]:
        """``(kind, body)`` of the peer's next message."""
        try:
            hdr = torch.empty(2, dtype=torch.int64)
            dist.recv(hdr, self.peer)
            kind, n = int(hdr[0]), int(hdr[1])
            if not n:
                return kind, b""
            buf = torch.empty(n, dtype=torch.uint8)
            dist.recv(buf, self.peer)
        except Exception as e:  # noqa: BLE001
            raise LinkLost(_first_line(e)) from None
        self.recv_bytes += n
        return kind, buf.numpy().tobytes()

    def ping(self) -> float:
        """Round trip of one PING/PONG, seconds."""
        t0 = time.perf_counter()
        self.send(PING)
        self.recv()
        return time.perf_counter() - t0

    def close(self) -> None:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _first_line(e: BaseException) -> str:
    s = str(e).strip()
    return (s.splitlines()[0] if s else type(e).__name__)[:200]


# --- node 0's side --------------------------------------------------------------------------

class _End:
    """What both ends of a bridge get once their rings are attached: the link to the other
    node and the launcher's event channel (``connect``)."""

    link: Link | None = None
    events = None

    def connect(self, link: Link, events) -> None:
        self.link, self.events = link, events


class Hub(_End):
    """Node 0's end for remote node ``node``: its ranks' reader slots of the input ring and the
    producer ends of their output rings."""

    def __init__(self, cfg: Config, node: int):
        self.cfg, self.node = cfg, node
        rid = cfg.runtime.run_id
        self.ranks = list(node_ranks(cfg, node))
        self.inps = [InputRing.attach(rid, reader_index=r, timeout=ATTACH_TIMEOUT)
                     for r in self.ranks]
        self.outs = [OutputRing.attach(rid, r, timeout=ATTACH_TIMEOUT) for r in self.ranks]

    def serve(self, parent_pid: int) -> int:
        """Forward until the shutdown message (0) or the launcher is gone (1)."""
        timeout = self.cfg.runtime.worker_timeout_seconds
        while True:
            try:
                body = self.inps[0].ring.get_bytes(PING_SECONDS)
            except RingTimeoutError:
                if not parent_alive(parent_pid):
                    return 1
                self.link.ping()
                continue
            for other in self.inps[1:]:     # the same frame, once per rank of that node
                other.ring.get_bytes(timeout)
            self.link.send(FRAME, body)
            _, reply = self.link.recv()
            frames = msgpack.unpackb(reply)
            if not frames:
                log.info(event("bridge shutdown forwarded", node=self.node))
                return 0
            for out, frame in zip(self.outs, frames, strict=True):
                if frame:       # --elastic_ep: none from a rank that died (its notice comes)
                    out.ring.put_bytes(frame, timeout)

    def close(self) -> None:
        for ring in self.inps + self.outs:
            with contextlib.suppress(Exception):
                ring.close()


# --- the remote node's side -----------------------------------------------------------------

class Relay(_End):
    """Remote node's end: producer of the node's input ring, reader of its output rings."""

    def __init__(self, cfg: Config, origin_run_id: str):
        self.cfg, self.origin = cfg, origin_run_id
        rid = cfg.runtime.run_id
        self.ranks = list(node_ranks(cfg))
        self.inp = InputRing.attach(rid, producer=True, timeout=ATTACH_TIMEOUT)
        self.outs = [OutputRing.attach(rid, r, reader=True, timeout=ATTACH_TIMEOUT)
                     for r in self.ranks]
        self.node = cfg.runtime.node_rank
        #: --elastic_ep: this node's ranks silent past --elastic_silence_seconds are SIGKILLed
        #: by its launcher (node 0's engine cannot see their reads); the engine's one rule
        self.fence = SilenceFence(cfg.runtime.elastic_silence_seconds, self._kill)

    def serve(self, parent_pid: int) -> int:
        """Answer node 0's frames until the shutdown message (0)."""
        rt = self.cfg.runtime
        while True:
            kind, body = self.link.recv()
            if kind == PING:
                self.link.send(PONG)
                continue
            msg = decode(body, self.origin, KIND_INPUT)
            self.inp.put(msg, timeout=rt.worker_timeout_seconds)
            if msg.shutdown:
                self.link.send(REPLY, msgpack.packb([]))
                log.info(event("bridge shutdown received", node=rt.node_rank, step=msg.step))
                return 0
            # NOTE: the first forwards wait for every shard to load (engine: STARTUP_TIMEOUT);
            # an elastic regroup waits for a replacement that loads its shard
            wait = LINK_TIMEOUT if msg.warmup else rt.worker_timeout_seconds
            if msg.regroup:
                wait = max(wait, rt.elastic_join_timeout_seconds)
            fence = rt.elastic_ep and not (msg.warmup or msg.regroup)
            t0 = time.monotonic()
            frames = [self._output(r, out, (t0, t0 + wait), msg.step, parent_pid, fence)
                      for r, out in zip(self.ranks, self.outs, strict=True)]
            self.link.send(REPLY, msgpack.packb(frames))

    def _output(self, rank: int, out: OutputRing, span: tuple[float, float], step: int,
                parent_pid: int, fence: bool) -> bytes:
        """Rank ``rank``'s output of the step; ``--elastic_ep``: ``b""`` when the rank died
        (its ring producer is gone) while this node's launcher lives to respawn it: the
        survivors' ``peer_lost`` outputs still go back, the engine learns the death from the
        launcher's notice and fences the step. A node whose launcher is gone is lost: raise
        (the link then drops and every node stops)."""
        try:
            return encode(self._wait(out, span, step, fence), self.origin)
        except PeerDeadError as e:
            # NOTE: a killed launcher's workers die with it (deathsig): without this check the
            # relay would answer for a dead node and block in the next gloo recv, where its
            # own SIGTERM cannot interrupt it
            if not self.cfg.runtime.elastic_ep or not parent_alive(parent_pid):
                raise
            log.warning(event("bridge rank lost", rank=rank, step=step, error=str(e)[:200]))
            return b""

    def _kill(self, rank: int) -> None:
        send_event(self.events, "bridge0", "kill", f"ep{rank}")

    def _wait(self, out: OutputRing, span: tuple[float, float], step: int, fence: bool):
        """One output before ``span[1]`` (the frame was put at ``span[0]``); ``fence``
        (``--elastic_ep``): past ``--elastic_silence_seconds`` this node's ranks that have not
        read the step's input (or are stopped) are SIGKILLed by this node's launcher, once per
        step (``notices.SilenceFence``): a hang becomes a death."""
        while True:
            left = span[1] - time.monotonic()
            if not fence or left <= 0:
                return out.get(timeout=max(0.0, left))
            try:
                return out.get(timeout=min(FENCE_SLICE, left))
            except RingTimeoutError:
                self.fence.check(step, time.monotonic() - span[0],
                                 lambda: silent_ranks(self.inp.ring, self.ranks))

    def close(self) -> None:
        for ring in [self.inp] + self.outs:
            try:
                ring.close()
            except Exception as e:  # noqa: BLE001 - teardown goes on; logged
                log.warning(event("bridge ring close failed", ring=ring.ring.name, error=repr(e)))


# --- process entry --------------------------------------------------------------------------

def bridge_main(cfg: Config, peer: int, origin_run_id: str, store_port: int, events,
                parent_pid: int) -> None:
    """Spawn target: node 0 runs one per remote node (``peer`` = that node), every remote node
    runs one (``peer`` = 0). Exit 0 after the shutdown message, 1 on a lost link."""
    node = cfg.runtime.node_rank
    who = f"bridge{peer}"
    # NOTE: the relay must sweep its node's shm when its launcher is killed (no one else is
    # left there); node 0's hubs die with the launcher (the engine sweeps node 0).
    child_setup(f"xllm-eplb:{who}", parent_pid, on_death=_exit_on_term if node else None)
    setup_logging(who, cfg.serve.v, str(Path(cfg.serve.log_dir) / f"{who}.log"))
    signal.signal(signal.SIGTERM, _exit_on_term)
    send_event(events, who, "spawned")
    end = None
    code = 1
    try:
        end = Hub(cfg, peer) if node == 0 else Relay(cfg, origin_run_id)
        remote = peer if node == 0 else node
        end.connect(Link(cfg.runtime.master_addr, store_port, remote, 0 if node == 0 else 1,
                         cfg.runtime.rendezvous_timeout_seconds), events)
        send_event(events, who, "linked")
        log.info(event("bridge linked", node=node, peer=peer, rtt_ms=round(
            end.link.ping() * 1e3, 3) if node == 0 else None))
        code = end.serve(parent_pid)
    except LinkLost as e:
        log.error(event("bridge link lost", node=node, peer=peer, error=str(e)))
        send_event(events, who, "error", f"node {peer}: control link lost ({e})")
    except SystemExit:
        log.info(event("bridge stop", node=node, peer=peer))
    except Exception as e:  # noqa: BLE001 - logged, reported, exit non-zero
        log.exception(event("bridge failed", node=node, peer=peer))
        send_event(events, who, "error", f"{who} on node {node}: {type(e).__name__}: {e}")
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if end is not None:
            end.close()                             # its rings: unmapped, so sweepable
        # NOTE: sweep before the link's teardown (destroy_process_group), which can be slow
        if node and not parent_alive(parent_pid):
            sweep_until_clean(cfg.runtime.run_id)   # the node's workers die with the launcher
        if end is not None and end.link is not None:
            end.link.close()
        logging.shutdown()
    child_exit(code, events)


def _exit_on_term(*_args) -> None:
    raise SystemExit(1)
