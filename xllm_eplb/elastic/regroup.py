"""The one regroup step and the one wait loop of every re-formation (respawn, shrink, rejoin).

A re-formation publishes the new membership generation's members and placement in the store
(a replacement or joiner builds its shard from them), then the engine sends one empty step
carrying ``regroup=g`` (``Engine.send_regroup``) and reads every rank's answer. How a rank's
silence is judged differs (a second death stops a respawn or shrink; it abandons a rejoin's
switch; the abandon's drain skips the dead rank): the caller passes that as ``on_silence``.
"""

from __future__ import annotations

import time

from xllm_eplb.elastic.protocol import WAIT_SLICE
from xllm_eplb.errors import WorkerFault
from xllm_eplb.ipc.errors import IpcError, RingTimeoutError
from xllm_eplb.ipc.store import put_members, put_placement

#: ``on_silence``'s answer: stop waiting for this rank (its death is known)
SKIP = object()


def publish(store, pg_generation: int, workers: list[int], placement) -> None:
    """Members (compact rank order) and placement ``[L, D*S]`` of ``pg_generation``."""
    put_placement(store, pg_generation, placement)
    put_members(store, pg_generation, workers)


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
