"""What the engine's elastic recovery counts and last saw (``/eplb/status`` ``membership``):
:class:`RecoveryCounters`, written only by ``elastic/recovery.py``'s ``EngineRecovery``."""

from __future__ import annotations

from dataclasses import dataclass, field


def _aliased(record: dict) -> dict:
    """``record`` with ``generation``, the deprecated name of ``pg_generation`` (one release)."""
    out = dict(record)
    if "pg_generation" in out:
        out["generation"] = out["pg_generation"]
    return out


@dataclass
class RecoveryCounters:
    """Counters since the engine started, and the last recovery's and rejoin's records."""

    recoveries: int = 0
    """Deaths recovered (respawn, shrink or a rejoin's shrink), each a detect -> resume pass."""
    shrinks: int = 0
    """Recoveries that left the dead worker out (mode ``shrink`` or ``rejoin``)."""
    reprefilled: int = 0
    """Requests requeued for re-prefill by the void steps of those deaths (the dead rank's)."""
    kept: int = 0
    """Requests that kept their KV cache through those void steps (cut back, not requeued)."""
    joins: int = 0
    """Rejoins that switched: the world grew back by one rank."""
    joins_dropped: int = 0
    """``JoinDropped`` notices for a joiner the engine was waiting for."""
    switches_abandoned: int = 0
    """Rejoin switches abandoned for a death during them (the engine went back to N-1)."""
    last: dict = field(default_factory=dict)
    """The last recovery: rank, worker, step, ``pg_generation``, mode, ``fence_s``,
    ``reform_s``, ``seconds``, requests re-prefilled / kept (a shrink adds its plan's numbers)."""
    last_join: dict = field(default_factory=dict)
    """The last rejoin: worker, ``ep_size`` ("N-1->N"), ``pg_generation``, start-to-ready,
    ready-to-switch, pause and start-to-serving seconds, experts read, slots kept."""

    def recovered(self, record: dict, shrink: bool) -> None:
        """One death recovered: ``record`` becomes :attr:`last` (its re-prefilled and kept
        requests are counted); ``shrink``: the dead worker was left out."""
        self.recoveries += 1
        self.shrinks += shrink
        self.reprefilled += record["requests_reprefilled"]
        self.kept += record["requests_kept"]
        self.last = record

    def joined(self, record: dict) -> None:
        """One rejoin switched: ``record`` becomes :attr:`last_join`."""
        self.joins += 1
        self.last_join = record

    def join_dropped(self) -> None:
        self.joins_dropped += 1

    def switch_abandoned(self) -> None:
        self.switches_abandoned += 1

    def status(self) -> dict:
        """The counters as ``/eplb/status`` ``membership`` names them."""
        return {"recoveries": self.recoveries, "shrinks": self.shrinks,
                "requests_reprefilled": self.reprefilled, "requests_kept": self.kept,
                "last_recovery": _aliased(self.last), "joins": self.joins,
                "joins_dropped": self.joins_dropped,
                "switches_abandoned": self.switches_abandoned,
                "last_join": _aliased(self.last_join)}
