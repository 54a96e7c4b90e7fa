"""The constants every elastic role shares, and the one owner of the membership generation.

``pg_generation`` (the *membership generation*): the number of the process-group world the
workers are in, 1 at start, one more per re-formation (a death's respawn or shrink, a rejoin's
grow). It is one atomic counter in the run's store (``PG_GENERATION_KEY``), drawn only through
:func:`next_pg_generation`: the launcher draws it when it sees a death (the replacement joins
that generation), the engine when it grows. Not to be confused with EPLB's placement
activations (``placement_activations``) or the aggregator's ``placement_generation``
(docs/architecture.md, "Elastic glossary").
"""

from __future__ import annotations

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


def next_pg_generation(store) -> int:
    """The next membership generation (atomic in the store: launchers and engine share it);
    the store's host draws generation 1 at start."""
    return int(store.add(PG_GENERATION_KEY, 1))
