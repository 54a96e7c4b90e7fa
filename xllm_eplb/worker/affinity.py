"""Worker CPU affinity (``--worker_cpu_affinity=auto|none|LIST``): each EP rank on its own cores.

A rank that shares its cores with other ranks makes wall-clock time measure the total work, not
the slowest rank, and the EP all-to-all waits on whichever rank the scheduler parked. Pinned,
each rank runs on its own cores, so the step time is the critical path EPLB shortens.

- ``none``: no pinning (every process may run anywhere; one torch thread per rank).
- ``auto`` (default): pin when this process may use at least ``ranks`` cores: rank i gets
  ``cores // ranks`` consecutive cores; cores left over (fewer than ``ranks``) go to the engine,
  else the engine runs on the workers' cores (it works between steps, while they wait for it, so
  a core of its own would sit idle: at EP1 on 2 cores that halved the step's threads). With
  fewer cores than ranks it falls back to ``none`` with one log line (2 cores, EP4: not pinned).
  With the shared-memory all-to-all (``shm=True``) and one core per worker with none left for
  the engine, the workers are not pinned either (2 cores, EP2): a pinned rank that sleeps in a
  round shares its one core with the engine and the HTTP threads and wakes late behind them
  (docs/benchmarks.md, "The shared-memory all-to-all": EP2 1.15-1.48x unpinned).
- ``LIST``: one entry per local rank, comma-separated; an entry is a core (``3``), a range
  (``4-7``) or several joined by ``+`` (``0+2``): ``0,1`` puts rank 0 on core 0 and rank 1 on
  core 1 (the engine then runs anywhere). Every core must be one this process may use, and no
  two ranks may share one: otherwise an :class:`~xllm_eplb.errors.ConfigError` naming the flag.

Each worker's torch intra-op threads match its cores (``torch.set_num_threads``). The launcher
applies the mask to itself around each spawn (:func:`pinned`), so the child starts on its cores
before torch creates a thread; the worker re-applies it (:func:`apply`) as its first act.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

from xllm_eplb.errors import ConfigError

FLAG = "worker_cpu_affinity"


@dataclass(frozen=True)
class AffinityPlan:
    """``workers``: per local rank its cores (None: not pinned); ``engine``: the engine's cores
    or None; ``note``: one line saying what was decided (logged by the launcher)."""

    workers: tuple[tuple[int, ...] | None, ...]
    engine: tuple[int, ...] | None
    note: str

    @property
    def pinned(self) -> bool:
        return any(w is not None for w in self.workers)


def available_cpus() -> tuple[int, ...]:
    """The cores this process may run on, sorted."""
    return tuple(sorted(os.sched_getaffinity(0)))


def _bad(spec: str, rule: str) -> ConfigError:
    return ConfigError(f"--{FLAG}={spec}: {rule}")


def _entry(spec: str, text: str) -> tuple[int, ...]:
    cores: list[int] = []
    for part in text.split("+"):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise _bad(spec, f"{text!r} is not a core, a range a-b or cores joined by +")
        a, b = int(lo), int(hi) if sep else int(lo)
        if b < a:
            raise _bad(spec, f"range {part!r} is empty")
        cores += range(a, b + 1)
    return tuple(cores)


def parse_list(spec: str) -> tuple[tuple[int, ...], ...]:
    """``"0,1"`` / ``"0-3,4-7"`` / ``"0+2,1+3"`` -> per-rank core tuples (syntax only)."""
    return tuple(_entry(spec, e) for e in spec.split(","))


def check_syntax(spec: str, ranks: int) -> None:
    """The value without the machine: auto, none, or a LIST with ``ranks`` entries."""
    if spec in ("auto", "none"):
        return
    entries = parse_list(spec)
    if len(entries) != ranks:
        raise _bad(spec, f"{len(entries)} entries for {ranks} EP ranks on this node (one "
                         f"comma-separated entry per rank, or auto / none)")
    seen: dict[int, int] = {}
    for r, cores in enumerate(entries):
        for c in cores:
            if c in seen and seen[c] != r:
                raise _bad(spec, f"core {c} is given to ranks {seen[c]} and {r} (each rank "
                                 f"needs cores of its own)")
            seen[c] = r


def plan(spec: str, ranks: int, cpus: tuple[int, ...] | None = None, *,
         shm: bool = False) -> AffinityPlan:
    """The pinning of ``ranks`` local workers on ``cpus`` (default: this process's cores);
    ``shm``: they exchange rows through the shared-memory all-to-all (module docstring)."""
    cpus = available_cpus() if cpus is None else tuple(sorted(cpus))
    if spec == "none":
        return AffinityPlan((None,) * ranks, None, f"{FLAG}=none: workers not pinned")
    if spec == "auto":
        if len(cpus) < ranks:
            return AffinityPlan((None,) * ranks, None,
                                f"{FLAG}=auto: {len(cpus)} cores for {ranks} workers: not "
                                f"pinned (needs {ranks})")
        k = len(cpus) // ranks
        spare = len(cpus) - k * ranks
        if shm and ranks > 1 and k == 1 and not spare:
            return AffinityPlan((None,) * ranks, None,
                                f"{FLAG}=auto: {len(cpus)} cores for {ranks} workers and the "
                                f"engine with the shm all-to-all: not pinned (a pinned rank "
                                f"would wait behind the engine on its core)")
        engine = cpus[:spare] or None
        workers = tuple(cpus[spare + i * k: spare + (i + 1) * k] for i in range(ranks))
        where = (f"engine on core(s) {_ranges(engine)}" if engine else
                 "engine on the workers' cores (it runs while they wait for its next step)")
        return AffinityPlan(workers, engine, f"{FLAG}=auto: {k} core(s) per worker, {where}")
    check_syntax(spec, ranks)
    entries = parse_list(spec)
    missing = sorted({c for e in entries for c in e} - set(cpus))
    if missing:
        raise _bad(spec, f"core {missing[0]} is not available (this machine lets serve use "
                         f"cores {_ranges(cpus)}: {len(cpus)} for {ranks} ranks)")
    return AffinityPlan(entries, None, f"{FLAG}={spec}: one entry per worker, engine not pinned")


def _ranges(cpus: tuple[int, ...]) -> str:
    out, start = [], None
    for i, c in enumerate(cpus):
        if start is None:
            start = c
        if i + 1 == len(cpus) or cpus[i + 1] != c + 1:
            out.append(str(start) if start == c else f"{start}-{c}")
            start = None
    return ",".join(out)


@contextlib.contextmanager
def pinned(cores: tuple[int, ...] | None):
    """Run the body (a spawn) with this thread's mask set to ``cores``, then restore it: a child
    started inside inherits the mask. ``None``: no change."""
    if cores is None:
        yield
        return
    old = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, old)


def apply(cores: tuple[int, ...] | None) -> int:
    """In the worker, before its first torch op: pin this process to ``cores`` (None: leave it)
    and return the torch thread count to use (the number of cores, 1 when not pinned)."""
    if cores is None:
        return 1
    os.sched_setaffinity(0, cores)
    return len(cores)
