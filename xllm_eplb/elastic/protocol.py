"""The membership conversation of elastic EP, in one place: every store key, the membership
generation, the grow's vote and its decision, the one store wait loop and the one answer loop.
The engine (``elastic/recovery.py``), the workers (``worker/membership.py``) and the launcher
(``elastic/supervisor.py``) all speak it through the functions below; nobody else names a key.

``pg_generation`` (the *membership generation*): the number of the process-group world the
workers are in, 1 at start, one more per re-formation (a death's respawn or shrink, a rejoin's
grow). It is one atomic counter in the run's store (``PG_GENERATION_KEY``), drawn only through
:func:`next_pg_generation`: the launcher draws it when it sees a death (the replacement joins
that generation), the engine when it grows. Not to be confused with EPLB's placement epoch
(``placement_epoch``; docs/architecture.md, "Elastic glossary").

The keys (the store is the launcher's TCPStore, ``ipc/store.py``), who writes -> who reads:

* ``pg_generation`` (a counter): launcher and engine draw (:func:`next_pg_generation`);
* ``placement/gen<g>`` [L, D*S], ``members/gen<g>`` (workers in compact rank order): the
  engine (:func:`publish`) -> a replacement, every member (its rank, its re-shard);
* ``attached/gen<g>/ep<w>``: a replacement (:func:`announce_attached`) -> the engine
  (:func:`await_attached`), then the regroup step;
* ``join/ep<w>/pid<p>`` (g): the engine (:func:`send_go`) -> the joiner (:func:`wait_go`);
  ``joined/ep<w>/pid<p>``: the joiner (:func:`announce_joined`) -> the engine
  (:func:`await_joined`);
* ``switch/gen<g>/arrived`` (a counter): every member of a grow (:func:`vote`);
  ``switch/gen<g>/decision``: the last arrival ``go`` or the engine ``abort``
  (:func:`decide`, first wins) -> every member, the engine (:func:`abort`).

A rank's process groups of generation ``g`` rendezvous under ``PrefixStore("gen<g>/")``
(``worker/membership.py``).
"""

from __future__ import annotations

import enum
import os
import time
from datetime import timedelta

import numpy as np

from xllm_eplb.errors import WorkerFault
from xllm_eplb.ipc.errors import IpcError, RingTimeoutError

#: the store key of the membership-generation counter
PG_GENERATION_KEY = "pg_generation"
#: how long a failed step (or the stop it causes) waits for the launcher's death notice, s: a
#: survivor's failed collective or a closed ring is only the consequence of the death; on a
#: loaded machine the notice can lag the consequence by over a second
NOTICE_WAIT = 3.0
#: the engine waits for a rank's output in slices this long (seconds) between checks
WAIT_SLICE = 0.25
#: a survivor's answer to the void step is awaited at least this long (seconds): on a loaded
#: machine failing a collective and writing ``peer_lost`` can take longer than a short
#: ``--elastic_silence_seconds``; a survivor that stays silent is a second death (clean stop)
FENCE_MIN_S = 10.0
#: the engine's idle slice with elastic EP (s), so a death while no request runs is detected
#: (and recovered) within ~0.1 s instead of up to the 0.5 s slice without it (issue #23:
#: detection p99 <= 0.5 s)
ELASTIC_IDLE_WAIT = 0.05
#: a serving rank's answer to a grow the engine abandoned (the vote said ``abort``): it is still
#: in its generation, groups intact (``ForwardOutput.error``, with ``peer_lost``)
ABANDONED = "switch abandoned"
#: the vote's two decisions
GO, ABORT = "go", "abort"
#: :func:`await_answer`'s ``on_silence`` answer: stop waiting for this rank (its death is known)
SKIP = object()


class Mode(enum.StrEnum):
    """How the launcher replaces a dead worker (``WorkerDied.mode``; ``""``: not replaced)."""

    REJOIN = "rejoin"      # left out now (shrink), a replacement loads and joins later (grow)
    RESPAWN = "respawn"    # started again in place, same rank; the service waits for it
    SHRINK = "shrink"      # left out; the survivors re-form at compact ranks
    STOP = "stop"          # not replaced: the run stops (a shrink across nodes)


def next_pg_generation(store) -> int:
    """The next membership generation (atomic in the store: launchers and engine share it);
    the store's host draws generation 1 at start."""
    return int(store.add(PG_GENERATION_KEY, 1))


# --- the keys ------------------------------------------------------------------------------
def placement_key(pg_generation: int) -> str:
    return f"placement/gen{pg_generation}"


def members_key(pg_generation: int) -> str:
    return f"members/gen{pg_generation}"


def attached_key(pg_generation: int, worker: int) -> str:
    return f"attached/gen{pg_generation}/ep{worker}"


def join_key(worker: int, pid: int) -> str:
    return f"join/ep{worker}/pid{pid}"


def joined_key(worker: int, pid: int) -> str:
    return f"joined/ep{worker}/pid{pid}"


def arrived_key(pg_generation: int) -> str:
    return f"switch/gen{pg_generation}/arrived"


def decision_key(pg_generation: int) -> str:
    return f"switch/gen{pg_generation}/decision"


# --- members and placement of a generation -------------------------------------------------
def put_placement(store, pg_generation: int, table: np.ndarray) -> None:
    """Store the deployed placement ``table`` [L, D*S] int64 for ``pg_generation``."""
    t = np.ascontiguousarray(table, dtype=np.int64)
    store.set(placement_key(pg_generation), f"{t.shape[0]},{t.shape[1]};".encode() + t.tobytes())


def get_placement(store, pg_generation: int) -> np.ndarray:
    """The placement [L, D*S] of ``pg_generation`` (waits until the engine has set it)."""
    raw = bytes(store.get(placement_key(pg_generation)))
    head, body = raw.split(b";", 1)
    shape = tuple(int(x) for x in head.decode().split(","))
    return np.frombuffer(body, dtype=np.int64).reshape(shape).copy()


def put_members(store, pg_generation: int, workers: list[int]) -> None:
    """The workers of ``pg_generation`` in compact rank order (worker ``workers[r]`` is EP rank
    ``r``): an elastic shrink drops the dead one, the survivors take compact ranks."""
    store.set(members_key(pg_generation), ",".join(map(str, workers)).encode())


def get_members(store, pg_generation: int) -> list[int]:
    """The workers of ``pg_generation`` (waits until the engine has set them)."""
    return [int(x) for x in bytes(store.get(members_key(pg_generation))).decode().split(",")]


def publish(store, pg_generation: int, workers: list[int], placement) -> None:
    """The engine's half of every re-formation: members (compact rank order) and placement
    ``[L, D*S]`` of ``pg_generation``, before its regroup step (a replacement or joiner builds
    its shard from them)."""
    put_placement(store, pg_generation, placement)
    put_members(store, pg_generation, workers)


# --- the one store wait loop ---------------------------------------------------------------
def wait_key(store, key: str, slice_s: float, timeout_s: float, on_slice, on_timeout) -> bytes:
    """The value of store ``key`` once set, waited for in ``slice_s`` slices. After each empty
    slice ``on_slice()`` may raise (a death meanwhile, the launcher gone); past ``timeout_s``
    ``on_timeout()`` returns the exception raised."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            store.wait([key], timedelta(seconds=slice_s))
            return bytes(store.get(key))
        except Exception:  # noqa: BLE001 - the store's wait timeout: check, then again
            on_slice()
            if time.monotonic() > deadline:
                raise on_timeout() from None


def _alive_check(alive, what: str):
    def check() -> None:
        if not alive():
            raise RuntimeError(f"{what}: the launcher is gone")
    return check


def _late(what: str, limit: str, timeout_s: float):
    return lambda: TimeoutError(f"{what}: {limit} within {timeout_s:g} s "
                                "(--elastic_join_timeout_seconds)")


# --- a respawn: the replacement's rings are attached --------------------------------------
def announce_attached(store, worker: int, pg_generation: int) -> None:
    """A replacement of ``worker`` attached its rings (it reads from the newest input frame
    on): the engine may send the regroup step of ``pg_generation``."""
    store.set(attached_key(pg_generation, worker), b"1")


def await_attached(store, worker: int, pg_generation: int, timeout_s: float, on_slice) -> None:
    """The engine waits for the replacement of ``worker`` in ``pg_generation``;
    ``on_slice()`` may raise (a death meanwhile), ``timeout_s`` raises :class:`WorkerFault`."""
    wait_key(store, attached_key(pg_generation, worker), WAIT_SLICE, timeout_s, on_slice,
             lambda: WorkerFault(f"EPLB elastic: the replacement of worker ep{worker} did not "
                                 f"attach within --elastic_join_timeout_seconds={timeout_s:g}"))


# --- a rejoin: the go, the joiner's answer, the vote ---------------------------------------
def send_go(store, worker: int, pid: int, pg_generation: int) -> None:
    """The engine lets joiner ``worker`` (process ``pid``) in as ``pg_generation``."""
    store.set(join_key(worker, pid), str(pg_generation).encode())


def wait_go(store, worker: int, timeout_s: float, alive) -> int:
    """A loaded joiner waits for the engine's go (the generation it joins, set at a step
    boundary); ``alive()`` False (the launcher gone) or ``timeout_s`` raise."""
    return int(wait_key(store, join_key(worker, os.getpid()), 1.0, timeout_s,
                        _alive_check(alive, "rejoin"),
                        _late("rejoin", "no go from the engine", timeout_s)).decode())


def announce_joined(store, worker: int) -> None:
    """The joiner reads the input ring from the newest frame on: the engine may send."""
    store.set(joined_key(worker, os.getpid()), b"1")


def await_joined(store, worker: int, pid: int, timeout_s: float, on_slice) -> None:
    """The engine waits for the joiner's answer to its go; ``on_slice()`` may raise (a death
    meanwhile), ``timeout_s`` raises :class:`WorkerFault`."""
    wait_key(store, joined_key(worker, pid), WAIT_SLICE, timeout_s, on_slice,
             lambda: WorkerFault(f"EPLB elastic: the joiner ep{worker} did not take its input "
                                 f"ring within --elastic_join_timeout_seconds={timeout_s:g}"))


def decide(store, pg_generation: int, decision: str) -> str:
    """Set the decision of the grow to ``pg_generation`` unless one is set; returns the one that
    holds (:data:`GO` or :data:`ABORT`): ``compare_set`` on an absent key, first wins."""
    return bytes(store.compare_set(decision_key(pg_generation), "", decision)).decode()


def vote(store, pg_generation: int, size: int, timeout_s: float, alive) -> bool:
    """A member's vote on a grow to ``pg_generation`` (``size`` members), before it leaves its
    groups: each member arrives; the last one decides ``go``, unless the engine decided
    ``abort`` first (a death during the switch, ``elastic/recovery.py``). True: go (every
    member was alive at its arrival); False: the switch is abandoned, the serving ranks stay
    in their generation. ``alive()`` False (the launcher gone) or ``timeout_s`` raise."""
    if int(store.add(arrived_key(pg_generation), 1)) == size:
        decide(store, pg_generation, GO)
    return wait_key(store, decision_key(pg_generation), 0.1, timeout_s,
                    _alive_check(alive, "switch"),
                    _late("switch", "no decision", timeout_s)) == GO.encode()


def abort(store, pg_generation: int) -> bool:
    """The engine's half of the vote (a death during the switch): True when every member had
    already voted ``go`` (*committed*: they left their groups), False when the abort holds."""
    return decide(store, pg_generation, ABORT) != ABORT


# --- the one answer loop -------------------------------------------------------------------
def await_answer(engine, rank: int, step: int, deadline: float, on_silence,
                 patient: bool = False, on_error=None):
    """Rank ``rank``'s answer to regroup step ``step`` (a dead predecessor's stale frames are
    skipped), read in ``WAIT_SLICE`` slices. After each failed slice ``on_silence(closed)``
    (``closed``: the ring's producer is gone, not just slow) may raise, or return ``SKIP``
    (None: no answer expected, the rank is dead); then the loop waits on while the deadline
    allows (a closed ring only when ``patient``). ``on_error(out)`` judges an answer carrying an
    error (default: :class:`WorkerFault`)."""
    while True:
        left = deadline - time.monotonic()
        try:
            out = engine.read_output(rank, max(0.0, min(WAIT_SLICE, left)))
        except IpcError as e:
            closed = not isinstance(e, RingTimeoutError)
            if on_silence(closed) is SKIP:
                return None
            if time.monotonic() < deadline and (patient or not closed):
                continue
            raise WorkerFault(f"EPLB elastic: rank {rank} did not re-form ({e})") from None
        if out.step != step:
            continue
        if out.error:
            if on_error is None:
                raise WorkerFault(out.error)
            return on_error(out)
        return out
