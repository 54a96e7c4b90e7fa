"""The step loop's membership port: what ``Engine.run`` asks at its named points.

``--elastic_ep`` injects the recovery state machine (``elastic/recovery.EngineRecovery``);
without it the loop holds :class:`NoMembership`, so the loop has no ``is None`` branch. The
points, in loop order:

- ``idle_wait``: seconds the idle loop blocks on the request queue per slice (``IDLE_WAIT``,
  or ``elastic/protocol.ELASTIC_IDLE_WAIT`` with elastic EP);
- ``when_idle()``: no step runs (a join may switch, a death notice meets an empty step);
  ``idle_cpu(seconds)``: that idle pass's thread CPU (elasticity's steady-state cost);
- ``at_boundary()``: between two steps, nothing in flight (a ready joiner joins);
- ``quiet()``: may the next step be planned while this one runs (``--async_scheduling``)?
  False while a membership change waits for a boundary;
- ``between_slices(step, silent_for, unread)``: while the engine waits for outputs;
- ``recover(fault, got)``: a step failed; returns after recovering (the step is void) or raises;
- ``health()`` / ``status()``: ``/health``'s fence and ``/eplb/status`` ``membership``.
"""

from __future__ import annotations

from typing import Protocol

#: the idle loop's slice without elastic EP (s): it only ticks the manager's timeouts
IDLE_WAIT = 0.5

__all__ = ["IDLE_WAIT", "MembershipPort", "NoMembership"]


class MembershipPort(Protocol):
    """What ``Engine``'s loop asks of its membership object (the module docstring); offered
    by :class:`NoMembership` and ``elastic/recovery.EngineRecovery`` (tests/test_elastic_ports.py)."""

    idle_wait: float

    def when_idle(self) -> None: ...

    def idle_cpu(self, seconds: float) -> None: ...

    def at_boundary(self) -> None: ...

    def quiet(self) -> bool: ...

    def between_slices(self, step: int, silent_for: float, unread) -> None: ...

    def recover(self, fault: Exception, got: dict) -> None: ...

    def health(self) -> dict | None: ...

    def status(self) -> dict: ...


class NoMembership:
    """``--elastic_ep=false``: every point does nothing; a failed step stops the run."""

    idle_wait = IDLE_WAIT

    def when_idle(self) -> None:
        pass

    def idle_cpu(self, seconds: float) -> None:
        pass

    def at_boundary(self) -> None:
        pass

    def quiet(self) -> bool:
        return True

    def between_slices(self, step: int, silent_for: float, unread) -> None:
        pass

    def recover(self, fault: Exception, got: dict) -> None:
        raise fault

    def health(self) -> dict | None:
        return None

    def status(self) -> dict:
        return {"elastic": False}
