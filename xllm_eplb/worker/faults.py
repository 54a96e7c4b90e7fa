"""Worker-side fault-injection hooks (``--fault_inject``; specs in :mod:`xllm_eplb.faultspec`).

:func:`make_faults` returns :data:`NO_FAULTS` (a null object: every hook returns at once) unless
the config enables fault injection and names a fault for this rank. Hook points, per rank:

- ``prepare(layer)``: the executor's prepare thread, before the hook's prepare (``prepare_*``);
- ``before_activate(layer)``: main thread, the forward that activates ``layer``, nothing
  posted yet (``crash`` phase ``before_activate``; counts the activation round);
- ``mid_transfer(layer)``: right after its P2P is posted (``crash`` phase ``mid_transfer``);
- ``p2p_wait(layer)``: after the forward, before waiting for the P2P (``p2p_delay``,
  ``p2p_fail``);
- ``after_activate(layer)``: the layer switched, the step's output not yet written (``crash``
  phase ``after_activate``);
- ``step(step)``: before the forward of engine step ``step`` (``slow_step``);
- ``corrupt(step)``: True when the output frame of that step must carry a bad checksum;
- ``join()``: an elastic joiner, its model loaded, before it signals ``join_ready``
  (``join_delay``).

NOTE: faults are deterministic per rank; rounds are counted on each rank from the commands it
receives, which every rank receives alike.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from xllm_eplb.faultspec import Fault, parse_all
from xllm_eplb.obs.logs import event

log = logging.getLogger(__name__)


class InjectedFault(RuntimeError):
    """Raised by an injected ``prepare_fail`` / ``p2p_fail``."""


def _no_op(self, where: int) -> None:
    """A hook point (a layer or a step) with nothing to inject: returns at once."""


class NoFaults:
    """Fault injection off: every hook is a no-op (the module docstring lists them)."""

    enabled = False
    prepare = before_activate = mid_transfer = p2p_wait = after_activate = step = _no_op

    def corrupt(self, step: int) -> bool:
        return False

    def join(self) -> None:
        pass


NO_FAULTS = NoFaults()


class Faults(NoFaults):
    """The faults of one rank. ``crash(detail)``: leaves the process now (the worker sends the
    detail to the launcher first); ``sleep``: injectable for tests."""

    enabled = True

    def __init__(self, faults: list[Fault], rank: int, crash: Callable[[str], None], *,
                 sleep: Callable[[float], None] = time.sleep):
        self.faults = [f for f in faults if f.rank is None or f.rank == rank]
        self.rank, self._crash, self._sleep = rank, crash, sleep
        self._lock = threading.Lock()
        self._prepares: dict[int, int] = {}       # layer -> prepares seen (prepare thread)
        self._activations: dict[int, int] = {}    # layer -> activations seen (main thread)

    def _fire(self, kinds: tuple[str, ...], phase: str = "", **where) -> list[Fault]:
        hits = [f for f in self.faults if f.kind in kinds and f.phase == phase
                and f.selects(self.rank, **where)]
        for f in hits:
            extra = {k: v for k, v in where.items() if v is not None}
            log.warning(event("fault injected", kind=f.kind, rank=self.rank, **extra,
                              seconds=f.seconds, phase=f.phase or "-", mode=f.mode))
        return hits

    def _crash_at(self, phase: str, layer: int) -> None:
        rnd = self._activations.get(layer, 0)
        if self._fire(("crash",), phase, layer=layer, round=rnd):
            self._crash(f"injected crash at phase={phase} layer={layer} round={rnd}")

    def prepare(self, layer: int) -> None:
        with self._lock:
            rnd = self._prepares[layer] = self._prepares.get(layer, 0) + 1
        for f in self._fire(("prepare_delay", "prepare_fail"), layer=layer, round=rnd):
            if f.kind == "prepare_delay":
                self._sleep(f.seconds)
            else:
                raise InjectedFault(f"injected prepare_fail layer={layer} round={rnd}")

    def before_activate(self, layer: int) -> None:
        self._activations[layer] = self._activations.get(layer, 0) + 1
        self._crash_at("before_activate", layer)

    def mid_transfer(self, layer: int) -> None:
        self._crash_at("mid_transfer", layer)

    def p2p_wait(self, layer: int) -> None:
        rnd = self._activations.get(layer, 0)
        for f in self._fire(("p2p_delay", "p2p_fail"), layer=layer, round=rnd):
            if f.kind == "p2p_delay":
                self._sleep(f.seconds)
            elif f.mode == "hang":
                threading.Event().wait()          # never completes: the engine times out
            else:
                raise InjectedFault(f"injected p2p_fail layer={layer} round={rnd}: the P2P "
                                    f"transfer failed before activation")

    def after_activate(self, layer: int) -> None:
        self._crash_at("after_activate", layer)

    def step(self, step: int) -> None:
        for f in self._fire(("slow_step",), step=step):
            self._sleep(f.seconds)

    def corrupt(self, step: int) -> bool:
        return bool(self._fire(("corrupt_output",), step=step))

    def join(self) -> None:
        for f in self._fire(("join_delay",)):
            self._sleep(f.seconds)


def make_faults(cfg, rank: int, crash: Callable[[str], None]) -> NoFaults:
    """The hooks of ``rank``: :data:`NO_FAULTS` unless a fault is configured for it."""
    f = cfg.faults
    faults = parse_all(f.fault_inject) if f.enable_fault_injection else []
    mine = [x for x in faults if x.rank is None or x.rank == rank]
    if not mine:
        return NO_FAULTS
    log.warning(event("fault injection on", rank=rank, faults=len(mine),
                      specs=";".join(f.fault_inject)))
    return Faults(mine, rank, crash)
