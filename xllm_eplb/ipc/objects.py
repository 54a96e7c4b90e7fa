"""Find and remove this project's OS objects (``xllm-eplb shm ls`` / ``shm clean``).

Only names starting with ``xllm_eplb_`` are considered: segments ``/dev/shm/xllm_eplb_<run>_*``
and named semaphores ``/dev/shm/sem.xllm_eplb_<run>_*``. The generation lock object
``/dev/shm/xllm_eplb_generation_lock`` is not listed: it exists only while a process holds or
waits for it, and its holder unlinks it on release.

Rules for ``clean`` (all under the generation lock):

* a segment is removed when no process holds it (``flock(LOCK_EX|LOCK_NB)`` succeeds);
* a semaphore is removed when no segment of its run is held (semaphores are used only
  together with their ring's segment, whose users all hold it).

``sweep_dead_runs`` (``serve`` runs it at start, issue #23 item 11) is stricter, because other
runs share the machine (another server, a test that reclaims a stale segment on purpose): it
removes a run's objects only when *every* object of the run is unheld, mapped by no process
(``/proc/<pid>/maps``) and older than a grace period, so a run being created, torn down or
tested right now is never touched.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
from dataclasses import dataclass, field

import posix_ipc

from xllm_eplb.ipc.shm import (
    HEADER_SIZE,
    LOCK_NAME,
    MAGIC,
    PROJECT_PREFIX,
    SHM_DIR,
    generation_lock,
    holder_pids,
    run_prefix,
    unpack_header,
)
from xllm_eplb.obs.logs import event

log = logging.getLogger(__name__)
SEM_PREFIX = "sem."


@dataclass
class ShmObject:
    """One project object as seen in /dev/shm."""

    name: str                 # POSIX name with leading slash
    kind: str                 # "segment" | "semaphore"
    run_id: str
    size: int
    generation: int | None = None   # segments with a valid header
    holders: list[int] = field(default_factory=list)   # pids holding an flock
    held: bool = False


def _run_of(bare: str) -> str:
    """``xllm_eplb_<run>_<what>`` -> ``<run>``."""
    return bare[len(PROJECT_PREFIX):].split("_", 1)[0]


def _probe_segment(path: str) -> tuple[int | None, bool]:
    """(generation or None, held?) of a segment file without changing it."""
    fd = os.open(path, os.O_RDONLY)
    try:
        raw = os.pread(fd, HEADER_SIZE, 0)
        gen = None
        if len(raw) == HEADER_SIZE and raw[:8] == MAGIC:
            gen = unpack_header(raw)[4]
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            held = False
        except BlockingIOError:
            held = True
        return gen, held
    finally:
        os.close(fd)   # drops the probe lock


def list_objects(run_id: str | None = None) -> list[ShmObject]:
    """Every project object (optionally of one run), sorted by run and name.

    Probing a segment takes ``flock(LOCK_EX|LOCK_NB)`` for an instant, so it is done under the
    generation lock (an opener or closer must never see the probe as a live holder).
    """
    with generation_lock():
        return _list_locked(run_id)


def _list_locked(run_id: str | None) -> list[ShmObject]:
    want = run_prefix(run_id) if run_id else PROJECT_PREFIX
    lock_bare = LOCK_NAME.lstrip("/")
    out = []
    try:
        entries = sorted(os.listdir(SHM_DIR))
    except FileNotFoundError:
        return []
    for entry in entries:
        path = os.path.join(SHM_DIR, entry)
        try:
            if entry == lock_bare:
                continue   # exists only while held (or after a holder was killed): self-cleaning
            if entry.startswith(want):
                gen, held = _probe_segment(path)
                out.append(ShmObject("/" + entry, "segment", _run_of(entry),
                                     os.stat(path).st_size, gen, holder_pids("/" + entry), held))
            elif entry.startswith(SEM_PREFIX + want):
                bare = entry[len(SEM_PREFIX):]
                out.append(ShmObject("/" + bare, "semaphore", _run_of(bare),
                                     os.stat(path).st_size))
        except FileNotFoundError:
            continue   # removed while listing
    return sorted(out, key=lambda o: (o.run_id, o.name))


def clean(run_id: str | None = None, *, force: bool = False) -> list[ShmObject]:
    """Remove unheld project objects (of one run when given); returns what was removed.

    ``force=True`` (tests, a launcher after killing its whole run) removes held ones too.
    The generation lock object needs no cleaning: its holder unlinks it on release.
    """
    removed = []
    with generation_lock():
        objs = _list_locked(run_id)
        live_runs = set() if force else {o.run_id for o in objs
                                         if o.kind == "segment" and o.held}
        for o in objs:
            if o.kind == "segment" and (force or not o.held):
                if _unlink(posix_ipc.unlink_shared_memory, o.name):
                    removed.append(o)
            elif o.kind == "semaphore" and o.run_id not in live_runs:
                if _unlink(posix_ipc.unlink_semaphore, o.name):
                    removed.append(o)
    for o in removed:       # one line per object in the debug log; one summary otherwise
        log.debug("shm clean removed name=%s kind=%s run=%s", o.name, o.kind, o.run_id)
    if removed:
        log.info(event("shm clean removed", objects=len(removed),
                       runs=",".join(sorted({o.run_id for o in removed}))))
    return removed


def _unlink(fn, name: str) -> bool:
    with contextlib.suppress(posix_ipc.ExistentialError):
        fn(name)
        return True
    return False


def sweep_run(run_id: str) -> list[ShmObject]:
    """Teardown sweep: :func:`clean` of ``run_id``'s unheld objects (after its processes are
    gone), logged; a failure is logged and returns ``[]`` (teardown must go on)."""
    try:
        removed = clean(run_id)
    except Exception as e:  # noqa: BLE001 - teardown must go on
        log.warning(event("shm sweep failed", run_id=run_id, error=repr(e)))
        return []
    return removed      # clean() logged its one summary line


def sweep_until_clean(run_id: str, seconds: float = 10.0) -> None:
    """:func:`sweep_run` until nothing of ``run_id`` is left, for up to ``seconds``: processes
    SIGKILLed with their launcher may still map a segment for a while (longer on a loaded
    machine), and a held object is not removed."""
    deadline = time.monotonic() + seconds
    while True:
        sweep_run(run_id)
        if not list_objects(run_id) or time.monotonic() >= deadline:
            return
        time.sleep(0.2)


#: a run whose newest object is younger than this is never swept at serve start (seconds)
DEAD_RUN_GRACE_SECONDS = 30.0


def mapped_paths() -> set[str]:
    """``/dev/shm`` paths mapped by any process whose ``/proc/<pid>/maps`` this process can
    read (a mapping outlives its fd, so flock holders alone do not prove nobody maps it)."""
    out: set[str] = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    i = line.find(SHM_DIR + "/")
                    if i >= 0 and PROJECT_PREFIX in line:   # segments and sem.<name>
                        out.add(line[i:].split(" (deleted)")[0].strip())
        except OSError:
            continue
    return out


def _path(o: ShmObject) -> str:
    """``/dev/shm/<name>`` (``/dev/shm/sem.<name>`` for a semaphore)."""
    bare = o.name.lstrip("/")
    return os.path.join(SHM_DIR, (SEM_PREFIX + bare) if o.kind == "semaphore" else bare)


def _age(o: ShmObject, now: float) -> float:
    try:
        st = os.stat(_path(o))
    except FileNotFoundError:
        return float("inf")
    return now - st.st_mtime    # created or last written (os.utime can age it in tests)


def dead_runs(grace_s: float = DEAD_RUN_GRACE_SECONDS,
              run_ids: set[str] | None = None) -> dict[str, list[ShmObject]]:
    """Runs (of ``run_ids`` when given) none of whose objects is held or mapped and whose
    newest object is older than ``grace_s`` seconds: run id -> its objects. Call under
    :func:`generation_lock`."""
    runs: dict[str, list[ShmObject]] = {}
    for o in _list_locked(None):
        if run_ids is None or o.run_id in run_ids:
            runs.setdefault(o.run_id, []).append(o)
    mapped, now = mapped_paths(), time.time()

    def dead(objs: list[ShmObject]) -> bool:
        return all(not o.held and not o.holders and _age(o, now) >= grace_s
                   and _path(o) not in mapped for o in objs)

    return {r: objs for r, objs in runs.items() if dead(objs)}


def sweep_dead_runs(grace_s: float = DEAD_RUN_GRACE_SECONDS,
                    run_ids: set[str] | None = None) -> dict[str, int]:
    """Remove every object of the runs :func:`dead_runs` finds (a node whose processes were all
    SIGKILLed); returns run id -> objects removed. Never raises (start-up must go on)."""
    removed: dict[str, int] = {}
    try:
        with generation_lock():
            for run_id, objs in dead_runs(grace_s, run_ids).items():
                for o in objs:
                    fn = (posix_ipc.unlink_shared_memory if o.kind == "segment"
                          else posix_ipc.unlink_semaphore)
                    if _unlink(fn, o.name):
                        removed[run_id] = removed.get(run_id, 0) + 1
    except Exception as e:  # noqa: BLE001 - a failed sweep must not stop a start
        log.warning(event("shm sweep of dead runs failed", error=repr(e)))
    return removed
