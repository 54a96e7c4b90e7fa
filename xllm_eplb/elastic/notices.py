"""How the engine learns that a worker is gone or coming: what the launcher tells it (its
notices), as typed records, the engine's one reader of them (:class:`NoticeBox`), and its own
watch for a silent worker (:class:`SilenceFence`).

Every notice travels as the record itself over the launcher's pipe (pickled) or, from a remote
node, as ``to_dict()`` JSON through node 0's store (``node/launcher.py``); ``notice_from_dict``
takes exactly the keys ``to_dict`` writes and raises ``ValueError`` naming the field otherwise.
Workers are ints (the worker id ``w`` of process ``ep<w>``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

from xllm_eplb.obs.logs import FILE_ONLY, event

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerDied:
    """Worker ``worker`` died. ``mode`` (elastic EP): how the launcher replaces it: ``respawn``
    (in place, same rank), ``shrink`` (left out), ``rejoin`` (left out now, a replacement loads
    and joins later); ``""``: not replaced, the run stops. ``pg_generation``: the membership
    generation the survivors re-form as (0 without elastic EP); ``seen_at``: wall time the
    launcher saw the exit."""

    worker: int
    message: str
    pg_generation: int = 0
    seen_at: float = 0.0
    mode: str = ""


@dataclass(frozen=True)
class JoinReady:
    """A rejoin replacement loaded its model (``started_at``/``ready_at``: wall times, ``pid``:
    the joiner's process; the go key is per pid)."""

    worker: int
    started_at: float
    ready_at: float
    pid: int


@dataclass(frozen=True)
class JoinDropped:
    """A joiner was dropped (``why``); ``restart``: the launcher starts it again, so the
    engine keeps it joining."""

    worker: int
    why: str
    restart: bool = False


@dataclass(frozen=True)
class LauncherGone:
    """Not sent by anyone: the engine's own finding that the launcher died (its pid is gone,
    ``kill -9`` of the launcher); the run stops with this message."""

    message: str


def launcher_gone(pid: int) -> LauncherGone:
    return LauncherGone(f"the launcher (pid {pid}) is gone (killed?): the run stops")


NOTICES = {c.__name__: c for c in (WorkerDied, JoinReady, JoinDropped)}


def notice_to_dict(notice) -> dict:
    return {"kind": type(notice).__name__, **dataclasses.asdict(notice)}


def notice_from_dict(d: dict):
    """The record ``notice_to_dict`` wrote; a missing, extra or mistyped field raises
    ``ValueError`` naming it."""
    kind = d.get("kind")
    if kind not in NOTICES:
        raise ValueError(f"notice kind={kind!r}: must be one of {sorted(NOTICES)}")
    cls = NOTICES[kind]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    extra = sorted(set(d) - set(fields) - {"kind"})
    missing = sorted(set(fields) - set(d))
    if extra or missing:
        raise ValueError(f"notice {kind}: fields {extra or missing} "
                         f"{'unknown' if extra else 'missing'}")
    kinds = {"int": int, "float": (int, float), "str": str, "bool": bool}
    for name, f in fields.items():
        want = kinds[f.type]
        v = d[name]
        if not isinstance(v, want) or (f.type == "int" and isinstance(v, bool)):
            raise ValueError(f"notice {kind}: field {name}={v!r} must be {f.type}")
    return cls(**{k: d[k] for k in fields})


class NoticeBox:
    """The engine's mailbox of launcher notices, the one place they are read and sorted:
    a death (:attr:`died`, kept until :meth:`clear_death`) and the rejoin
    notices. ``read(timeout) -> notice or None`` is the launcher channel (None: no launcher,
    a test engine); ``launcher_alive()`` False turns into a :class:`LauncherGone` death.

    ``watch_joiner(w)``: while the engine switches to joiner ``w``, that joiner's drop is
    recorded in :attr:`joiner_lost` (the switch is abandoned; not a death)."""

    def __init__(self, read=None, launcher_alive=None, launcher_pid: int = 0):
        self.read, self.launcher_alive, self.launcher_pid = read, launcher_alive, launcher_pid
        self.died: WorkerDied | LauncherGone | None = None
        self.joins: list[JoinReady | JoinDropped] = []
        self.switching: int | None = None
        self.joiner_lost = ""
        #: a :meth:`wait_death` ran out: the fault had no notice (the run stops on it), so the
        #: stop's own explanation does not wait again
        self.gave_up = False

    @property
    def death(self) -> str:
        """The dead child's message ("" while none)."""
        return self.died.message if self.died is not None else ""

    def poll(self, timeout: float = 0.0) -> bool:
        """Read one notice (waiting up to ``timeout`` s); True once a death is known."""
        if self.died is not None:
            return True
        if self.launcher_alive is not None and not self.launcher_alive():
            self.died = launcher_gone(self.launcher_pid)
            return True
        if self.read is None:
            if timeout:
                time.sleep(min(timeout, 0.05))
            return False
        self._sort(self.read(timeout))
        return self.died is not None

    def wait_death(self, wait: float) -> bool:
        """Poll up to ``wait`` s for a death notice (a survivor's failed collective is only the
        consequence: the launcher's notice names the dead one)."""
        if self.gave_up:          # a wait for this fault's notice already ran out
            return self.poll(min(wait, 0.1))
        deadline = time.monotonic() + wait
        while not self.poll(min(0.1, max(0.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                self.gave_up = wait > 0
                return False
        return True

    def drain(self) -> None:
        """Every notice waiting now (a death stops the reading: it is kept)."""
        while self.died is None and self.read is not None:
            n = self.read(0.0)
            if n is None:
                break
            self._sort(n)

    def take_joins(self) -> list:
        got, self.joins = self.joins, []
        return got

    def clear_death(self) -> None:
        self.died, self.gave_up = None, False

    def watch_joiner(self, worker: int | None) -> None:
        self.switching, self.joiner_lost = worker, ""

    def _sort(self, n) -> None:
        if n is None:
            return
        if isinstance(n, dict):
            n = notice_from_dict(n)
        if isinstance(n, (JoinReady, JoinDropped)):
            if isinstance(n, JoinDropped) and n.worker == self.switching:
                self.joiner_lost = (f"the joiner ep{n.worker} died during the switch "
                                    f"({n.why})")
            self.joins.append(n)
        elif isinstance(n, WorkerDied):
            self.died = n
            # NOTE: file only: the launcher's console line says it once
            log.error(event("engine notice worker died", proc=f"ep{n.worker}", message=n.message),
                      extra=FILE_ONLY)
        else:
            raise ValueError(f"unknown launcher notice {n!r}")


class SilenceFence:
    """The engine's other way to learn of a death (``--elastic_silence_seconds``): a worker that
    has not read a step's input for that long is SIGKILLed by the launcher, once per step, which
    turns a hang into a death (recovered as one, through a notice). Not a phase of the recovery
    state machine: the engine keeps serving; ``/health`` shows ``recovering`` / ``fence`` until
    the next step. ``silence_s``: the silence that fences; ``kill(worker)``: asks the launcher to
    SIGKILL (None: the fence is off, a test engine)."""

    def __init__(self, silence_s: float, kill=None):
        self.silence, self.kill = silence_s, kill
        self.step = -1          # the step whose silent ranks were SIGKILLed (-1: none)
        self.at = 0.0           # time.monotonic() of that fence

    @property
    def active(self) -> bool:
        return self.step >= 0

    def check(self, step: int, silent_for: float, unread) -> None:
        """Step ``step`` has waited ``silent_for`` seconds: past the silence, the workers that
        have not read its input (``unread()``) are SIGKILLed, once per step."""
        if self.kill is None or self.step == step or silent_for <= self.silence:
            return
        silent = unread()
        if not silent:
            return
        self.step, self.at = step, time.monotonic()
        log.warning(event("EPLB elastic silent", step=step, ranks=",".join(map(str, silent)),
                          seconds=round(silent_for, 2)))
        for w in silent:
            self.kill(w)

    def passed(self, step_no: int) -> None:
        """A step after the fenced one was sent: the fence is over."""
        if self.active and step_no > self.step:
            self.step = -1
