"""The typed ports of elastic EP: what the engine's recovery needs from the engine
(:class:`EnginePort`, offered by ``engine/engine.py``'s ``Engine``) and what the launcher's
supervisor needs from the launcher (:class:`LauncherPort`, offered by
``launcher/launcher.py``'s ``Launcher``). tests/test_elastic_ports.py checks that the real
classes and the tests' fakes have every member with these signatures.

The worker's side is ``worker/membership.py``'s ``WorkerHost`` (kept there: the ``worker``
layer is above this one).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np


class EnginePort(Protocol):
    """What ``elastic/recovery.py``'s ``EngineRecovery`` reads and calls on the engine; it
    writes no engine attribute. Ranks are compact EP ranks ``0..ep_size-1``."""

    step_no: int
    """The number of the last step sent (a regroup step counts)."""
    stopping: bool
    """A stop was requested: a failed step is not recovered."""

    @property
    def ep_size(self) -> int:
        """EP ranks in the current membership."""

    @property
    def active_placement(self) -> np.ndarray:
        """The placement [L, D*S] int64 the ranks serve now."""

    def resize(self, workers: list[int], placement) -> None:
        """The one membership operation: rank ``r`` is worker ``workers[r]`` with
        ``placement`` [L, D*S] deployed."""

    def send_regroup(self, pg_generation: int, timeout: float) -> int:
        """One empty step that re-forms the members as ``pg_generation``; its number."""

    def read_output(self, rank: int, timeout: float):
        """Rank ``rank``'s next ``ForwardOutput`` (ring errors propagate)."""

    def void_step(self, rank: int) -> tuple[int, int]:
        """The step in flight died with ``rank``: (requests re-prefilled, requests kept)."""

    def abort_eplb_round(self, switched: bool | None) -> bool:
        """Drop an EPLB round in flight; False: only some ranks switched (the run stops)."""

    def awaited_token(self) -> int:
        """The activation token the EPLB round in flight waits for."""

    def expert_load(self) -> np.ndarray | None:
        """Per-expert token totals [L, E] so far, None before any."""

    def idle_step(self) -> None:
        """An empty step (a death while idle meets the dead rank now)."""


class LauncherPort(Protocol):
    """What ``elastic/supervisor.py``'s ``ElasticSupervisor`` asks of the launcher: the
    launcher owns the process table (``procs``) and the children's errors; the supervisor
    reads a worker's process and asks for every change. Workers are named ``ep<w>``."""

    def worker_proc(self, who: str):
        """The ``multiprocessing.Process`` of ``who`` (``pid``, ``exitcode``, ``join``), or None."""

    def worker_names(self) -> list[str]:
        """The ``ep<w>`` children the launcher holds now (serving and joiners)."""

    def spawn_worker(self, who: str, pg_generation: int = 0, join: bool = False) -> None:
        """Start worker ``who``: a replacement joining ``pg_generation``, or a joiner."""

    def retire(self, who: str) -> None:
        """Forget exited worker ``who``: its process leaves the table and is closed."""

    def clear_error(self, who: str) -> None:
        """Forget the error ``who`` reported (its death is handled)."""

    def replaced_message(self, who: str, during: str = "serving") -> str:
        """The line a replaced worker's death is told with."""

    def stop_requested(self) -> bool:
        """A stop signal arrived."""

    def engine_gone(self) -> bool:
        """The engine (node n: its bridge) exited."""

    def notify_engine(self, notice) -> bool:
        """Send the engine a notice (``elastic/notices.py``); False when it cannot be sent."""
