"""EPLB weight moves between EP ranks: the P2P planner and the batched transfer.

Planner (:func:`plan_p2p`): every rank computes the same plan from the old (active) and new
global slot tables of one layer, ``[D*S]`` int64 rank-major, with no collective. Each new slot is

- *unchanged*: it already holds its new expert;
- a *same-rank copy*: the new expert is resident in another slot of the same rank;
- a *cross-rank transfer*: it is received from a current holder of the expert on another rank.

NOTE: send/recv pairs match across ranks only because every rank plans from identical tables
and walks them in the same deterministic order. Nothing here may depend on rank-local state.

Unlike xLLM (which always sources from the first holder), the sender of each cross-rank
transfer is the holder rank with the fewest sends assigned so far (ties: lowest rank), so a
hot replicated expert is fanned out by all its holders.

Batched transfer (:class:`BatchedTransfer`): one list of point-to-point messages per layer,
split into chunks of at most ``chunk_bytes``, posted in waves of at most ``max_inflight_bytes``
(sends + receives) on the dedicated EPLB process group. Messages follow one global order
(rank pairs ``(lo, hi)`` ascending; per pair the lo->hi transfers first), so for every pair the
lower rank posts its sends before its receives and the higher rank its receives first, and
every rank's waves are prefixes of that order: the earliest unfinished message always has both
ends posted, so waves cannot deadlock.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist


class P2PPlanError(ValueError):
    """The new placement cannot be reached from the old one (same outcome on every rank)."""


@dataclass(frozen=True, order=True)
class Transfer:
    """One cross-rank slot move: ``dst_rank``'s slot ``dst_slot`` <- ``src_rank``'s ``src_slot``.
    ``order`` is its position in the global message order (identical on every rank)."""

    order: int
    src_rank: int
    src_slot: int
    dst_rank: int
    dst_slot: int


@dataclass
class P2PPlan:
    """The plan of one layer as seen by rank ``rank`` (slots are local indices in [0, S))."""

    rank: int
    slots_per_rank: int
    new_local: np.ndarray                       # int64 [S], this rank's new slot table
    changed: np.ndarray                         # int64 [n] local slots whose expert changes
    local_sources: np.ndarray                   # int64 [S] first active local slot holding the
    #                                             new expert, -1 if it must come over P2P
    recv: list[Transfer] = field(default_factory=list)   # this rank is dst, in global order
    send: list[Transfer] = field(default_factory=list)   # this rank is src, in global order
    unchanged: int = 0                          # global counts over all ranks
    same_rank: int = 0
    cross_rank: int = 0

    @property
    def empty(self) -> bool:
        """No slot of any rank changes."""
        return self.same_rank == 0 and self.cross_rank == 0


def _check_tables(old: np.ndarray, new: np.ndarray, rank: int, S: int) -> tuple[np.ndarray, np.ndarray]:
    o = np.asarray(old, dtype=np.int64).reshape(-1)
    n = np.asarray(new, dtype=np.int64).reshape(-1)
    if S <= 0:
        raise P2PPlanError(f"slots_per_rank={S} must be > 0")
    if o.shape != n.shape:
        raise P2PPlanError(f"old table has {o.size} slots, new table {n.size}: sizes differ")
    if o.size == 0 or o.size % S:
        raise P2PPlanError(f"table of {o.size} slots is not a multiple of slots_per_rank={S}")
    if not 0 <= rank < o.size // S:
        raise P2PPlanError(f"rank={rank} outside [0, {o.size // S})")
    return o.reshape(-1, S), n.reshape(-1, S)


def plan_p2p(old: np.ndarray, new: np.ndarray, rank: int, slots_per_rank: int) -> P2PPlan:
    """Plan the move ``old`` -> ``new`` (global tables, int64 [D*S]) for ``rank``.

    Raises :class:`P2PPlanError` when a new slot needs an expert no rank holds in ``old``;
    every rank raises the same error for the same tables.
    """
    o, n = _check_tables(old, new, rank, slots_per_rank)
    D, S = o.shape
    # holders[e] = [(rank, first slot of e on that rank)] in rank order
    holders: dict[int, list[tuple[int, int]]] = {}
    for r in range(D):
        seen: set[int] = set()
        for s, e in enumerate(o[r].tolist()):
            if e not in seen:
                seen.add(e)
                holders.setdefault(e, []).append((r, s))
    sends_per_rank = [0] * D
    unchanged = same = 0
    moves: list[tuple[int, int, int, int]] = []     # (src_rank, src_slot, dst_rank, dst_slot)
    for r in range(D):
        first_local = {}
        for s, e in enumerate(o[r].tolist()):
            first_local.setdefault(e, s)
        for s, e in enumerate(n[r].tolist()):
            if o[r, s] == e:
                unchanged += 1
            elif e in first_local:
                same += 1
            elif e not in holders:
                raise P2PPlanError(f"rank {r} slot {s} needs logical expert {e}, which no rank "
                                   f"holds in the active placement")
            else:
                # NOTE: deterministic spreading: fewest sends so far, then lowest rank.
                src_r, src_s = min(holders[e], key=lambda h: (sends_per_rank[h[0]], h[0]))
                sends_per_rank[src_r] += 1
                moves.append((src_r, src_s, r, s))
    moves.sort(key=_order_key)
    transfers = [Transfer(i, *m) for i, m in enumerate(moves)]
    old_local = o[rank].tolist()
    new_local = n[rank].copy()
    first_local = {}
    for s, e in enumerate(old_local):
        first_local.setdefault(e, s)
    sources = np.array([first_local.get(e, -1) for e in new_local.tolist()], dtype=np.int64)
    return P2PPlan(
        rank=rank, slots_per_rank=S, new_local=new_local,
        changed=np.nonzero(o[rank] != n[rank])[0].astype(np.int64),
        local_sources=sources,
        recv=[t for t in transfers if t.dst_rank == rank],
        send=[t for t in transfers if t.src_rank == rank],
        unchanged=unchanged, same_rank=same, cross_rank=len(transfers))


def _order_key(m: tuple[int, int, int, int]) -> tuple[int, int, int, int, int]:
    """Global message order: pair (lo, hi), then lo->hi before hi->lo, then destination slot."""
    src_r, _, dst_r, dst_s = m
    lo, hi = min(src_r, dst_r), max(src_r, dst_r)
    return (lo, hi, 0 if src_r == lo else 1, dst_s, src_r)


# --- batched transfer -----------------------------------------------------------------------

@dataclass
class Message:
    """One point-to-point message: ``send`` this tensor to ``peer`` or ``recv`` into it.
    ``tensor`` must be contiguous; both ends list a message under the same position."""

    kind: str          # "send" | "recv"
    peer: int          # rank in the EPLB group
    tensor: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


def plan_messages(plan: P2PPlan, active: dict[str, torch.Tensor],
                  staging: dict[str, torch.Tensor], peers: list[int]) -> list[Message]:
    """This rank's messages of ``plan`` in the global order: per transfer (by ``order``),
    every tensor by sorted name; sends read ``active[name][src_slot]``, receives land in
    ``staging[name][dst_slot]`` (both ``[S, ...]``). ``peers``: EPLB rank -> global rank.

    NOTE: :class:`BatchedTransfer` waves are deadlock-free only for lists in this order.
    A rank-local order (e.g. interleaving "send left, receive right" per tensor in a ring)
    can put a send in wave k whose receive sits in the peer's wave k+1, on every rank at once:
    a cycle (seen in practice with 4 MiB chunks and 16 MiB waves).
    """
    names = sorted(active)
    ops = sorted([(t.order, "recv", t) for t in plan.recv] +
                 [(t.order, "send", t) for t in plan.send], key=lambda x: x[0])
    out = []
    for _, kind, t in ops:
        for name in names:
            if kind == "recv":
                out.append(Message("recv", peers[t.src_rank], staging[name][t.dst_slot]))
            else:
                out.append(Message("send", peers[t.dst_rank], active[name][t.src_slot]))
    return out


def wire_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` as it travels: 1-byte floats (fp8) as their uint8 bytes, so no transport ever sees
    a float8 dtype (gloo collectives refuse it; send/recv of the bytes is exact)."""
    if t.is_floating_point() and t.element_size() == 1:
        return t.view(torch.uint8)
    return t


def chunk(t: torch.Tensor, chunk_bytes: int) -> list[torch.Tensor]:
    """Views of the contiguous tensor ``t`` (flattened, :func:`wire_view`) of at most
    ``chunk_bytes`` each."""
    if not t.is_contiguous():
        raise ValueError(f"P2P tensor of shape {tuple(t.shape)} is not contiguous")
    flat = wire_view(t).view(-1)
    step = max(1, chunk_bytes // t.element_size())
    if flat.numel() <= step:
        return [flat]
    return list(flat.split(step))


def plan_waves(sizes: list[int], max_inflight_bytes: int) -> list[tuple[int, int]]:
    """Pack messages (in order) into waves ``[start, end)`` of at most ``max_inflight_bytes``
    (a single larger message gets a wave of its own)."""
    waves: list[tuple[int, int]] = []
    start, acc = 0, 0
    for i, b in enumerate(sizes):
        if i > start and acc + b > max_inflight_bytes:
            waves.append((start, i))
            start, acc = i, 0
        acc += b
    if start < len(sizes):
        waves.append((start, len(sizes)))
    return waves


class BatchedTransfer:
    """Post a rank's messages of one layer move on ``group``; :meth:`wait` finishes them.

    Counters (cumulative, for tests and metrics): ``posted_ops``, ``posted_bytes``, ``waves``,
    ``max_wave_bytes``; ``last_ops`` / ``last_bytes``: the latest move only.
    """

    def __init__(self, group, chunk_bytes: int, max_inflight_bytes: int):
        if chunk_bytes <= 0 or max_inflight_bytes < chunk_bytes:
            raise ValueError(f"P2P limits: chunk_bytes={chunk_bytes} must be > 0 and "
                             f"<= max_inflight_bytes={max_inflight_bytes}")
        self.group = group
        self.chunk_bytes = int(chunk_bytes)
        self.max_inflight_bytes = int(max_inflight_bytes)
        self.posted_ops = 0
        self.posted_bytes = 0
        self.waves = 0
        self.max_wave_bytes = 0
        self.last_ops = 0
        self.last_bytes = 0
        self._ops: list[tuple[str, int, torch.Tensor, int]] = []
        self._waves: list[tuple[int, int]] = []
        self._next_wave = 0
        self._works: list = []

    @property
    def busy(self) -> bool:
        return bool(self._works) or self._next_wave < len(self._waves)

    def start(self, messages: list[Message]) -> None:
        """Chunk ``messages`` (already in the global order), post the first wave."""
        if self.busy:
            raise RuntimeError("P2P transfer started while the previous one is unfinished")
        ops = []
        tags: dict[tuple[str, int], int] = {}
        for m in messages:
            for c in chunk(m.tensor, self.chunk_bytes):
                key = (m.kind, m.peer)
                # NOTE: the k-th message between an ordered pair carries tag k on both ends.
                tag = tags.get(key, 0)
                tags[key] = tag + 1
                ops.append((m.kind, m.peer, c, tag))
        self._ops = ops
        self._waves = plan_waves([c.numel() * c.element_size() for _, _, c, _ in ops],
                                 self.max_inflight_bytes)
        self._next_wave = 0
        self.last_ops = 0
        self.last_bytes = 0
        self._post_next()

    def _post_next(self) -> None:
        a, b = self._waves[self._next_wave] if self._next_wave < len(self._waves) else (0, 0)
        if a == b:
            self._next_wave = len(self._waves)
            return
        self._next_wave += 1
        nbytes = 0
        for kind, peer, c, tag in self._ops[a:b]:
            fn = dist.isend if kind == "send" else dist.irecv
            self._works.append(fn(c, peer, group=self.group, tag=tag))
            nbytes += c.numel() * c.element_size()
        self.posted_ops += b - a
        self.posted_bytes += nbytes
        self.last_ops += b - a
        self.last_bytes += nbytes
        self.waves += 1
        self.max_wave_bytes = max(self.max_wave_bytes, nbytes)

    def wait(self) -> float:
        """Finish every wave; returns the seconds spent waiting."""
        t0 = time.perf_counter()
        while self._works:
            for w in self._works:
                w.wait()
            self._works = []
            self._post_next()
        self._ops = []
        self._waves = []
        return time.perf_counter() - t0


def warmup_group(group, rank: int, peers: list[int], device="cpu") -> None:
    """One 1-element send/recv with every peer so the transports exist before the first move.
    ``peers``: group rank -> global rank. Pairs in the global order: the lower rank sends
    first, the higher receives first (blocking, so this is also a rendezvous of all ranks)."""
    buf_out = torch.zeros(1, device=device)
    buf_in = torch.zeros(1, device=device)
    for peer, g in enumerate(peers):
        if peer == rank:
            continue
        if rank < peer:
            dist.send(buf_out, g, group=group)
            dist.recv(buf_in, g, group=group)
        else:
            dist.recv(buf_in, g, group=group)
            dist.send(buf_out, g, group=group)
