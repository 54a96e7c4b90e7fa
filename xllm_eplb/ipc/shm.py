"""Versioned POSIX shared-memory segments (layout v2, as xLLM's ``shared_memory_manager``).

Mapping: ``[64-byte header][payload]``. Header (little endian)::

    magic        8 bytes  b"XLEPSHM2"
    version      u32      2
    header_size  u32      64
    payload_size u64      bytes after the header
    generation   u64      1 at creation, +1 at every stale reclaim
    reserved     32 bytes zero

Names: ``/xllm_eplb_<run>_<what>`` (:func:`object_name`). The run id comes from ``--run_id`` or,
when empty, from the HTTP port (:func:`resolve_run_id`). ``xllm-eplb shm ls/clean`` find this
project's objects by the ``xllm_eplb_`` prefix and touch nothing else.

NOTE (cross-process rules, every process of every run obeys them):

* Every open / create / unlink of any project object happens while holding the global
  *generation lock* (:func:`generation_lock`: ``flock(LOCK_EX)`` on the shm object
  ``/xllm_eplb_generation_lock``), so two processes can never map two generations of one name.
  A killed holder releases it with its fd (a semaphore would stay taken). The holder unlinks the
  lock object on release, so nothing is left in ``/dev/shm``; acquirers re-check the inode.
* Every live mapper of a segment holds ``flock(LOCK_SH)`` on the segment's fd. Whoever can take
  ``LOCK_EX|LOCK_NB`` knows there is no live user: an opener reclaims such a segment as stale
  (generation + 1, payload zeroed), a closer unlinks it (last holder out).
* A size, magic, version or header-size mismatch raises :class:`LayoutError` at once; an object is
  never resized and never wiped because of a mismatch. The one exception is an *unheld* object
  left empty or with an all-zero header by a creator killed mid-creation: it is initialised.

Public API::

    resolve_run_id(run_id: str, port: int) -> str
    run_prefix(run_id) -> "xllm_eplb_<run>_"       object_name(run_id, what) -> "/xllm_eplb_<run>_<what>"
    with generation_lock(): ...          (not re-entrant: use Segment.open_locked inside)
    seg = Segment.open(name, payload_size, mode="open" | "create" | "attach")
    seg.read(offset, n) -> bytes   seg.write(offset, data)   seg.mm (mmap, header included)
    seg.generation, seg.created, seg.reclaimed, seg.payload_size, seg.name
    seg.close()  (or ``with Segment.open(...) as seg:``)
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import re
import struct

import posix_ipc

from xllm_eplb.errors import ConfigError, LayoutError
from xllm_eplb.ipc.errors import SegmentBusyError, SegmentMissingError

log = logging.getLogger(__name__)

PROJECT_PREFIX = "xllm_eplb_"
SHM_DIR = "/dev/shm"
LOCK_NAME = "/xllm_eplb_generation_lock"
MAGIC = b"XLEPSHM2"
LAYOUT_VERSION = 2
HEADER_SIZE = 64
_HDR = struct.Struct("<8sIIQQ32s")
assert _HDR.size == HEADER_SIZE
_GEN_OFFSET = 24  # byte offset of ``generation`` inside the header
_RUN_ID_RE = re.compile(r"^[A-Za-z0-9-]{1,40}$")
MODES = ("open", "create", "attach")


def resolve_run_id(run_id: str, port: int) -> str:
    """The run id to use: ``run_id`` when set, else ``p<port>`` (validated either way)."""
    rid = run_id or f"p{int(port)}"
    validate_run_id(rid)
    return rid


def validate_run_id(run_id: str) -> str:
    if not isinstance(run_id, str) or not _RUN_ID_RE.match(run_id):
        raise ConfigError(f"run_id={run_id!r}: must be 1-40 characters of [A-Za-z0-9-] "
                          "(no '_', it separates name parts)")
    return run_id


def run_prefix(run_id: str) -> str:
    """``xllm_eplb_<run>_``: the prefix of every object (segment, semaphore) of one run."""
    return f"{PROJECT_PREFIX}{validate_run_id(run_id)}_"


def object_name(run_id: str, what: str) -> str:
    """POSIX name (leading slash) of one object of a run, e.g. ``/xllm_eplb_p8000_in``."""
    return "/" + run_prefix(run_id) + what


def shm_path(name: str) -> str:
    """Where Linux shows the shm object ``name`` (``/dev/shm/<name without slash>``)."""
    return os.path.join(SHM_DIR, name.lstrip("/"))


def _flock_nb(fd: int, op: int) -> bool:
    try:
        fcntl.flock(fd, op | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


@contextlib.contextmanager
def generation_lock():
    """Hold the global generation lock (exclusive ``flock`` on ``/xllm_eplb_generation_lock``).

    The lock object is unlinked on release so a clean shutdown leaves nothing in ``/dev/shm``;
    an acquirer therefore checks after locking that the name still points at the inode it
    locked, and retries otherwise. A killed holder releases the lock with its fd.
    """
    while True:
        obj = posix_ipc.SharedMemory(LOCK_NAME, posix_ipc.O_CREAT, mode=0o600)
        fd = obj.fd
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            same = os.stat(shm_path(LOCK_NAME)).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        obj.close_fd()
    try:
        yield
    finally:
        # NOTE: unlink is the holder's last action, then the fd closes (lock released).
        with contextlib.suppress(posix_ipc.ExistentialError):
            posix_ipc.unlink_shared_memory(LOCK_NAME)
        obj.close_fd()


def pack_header(payload_size: int, generation: int) -> bytes:
    return _HDR.pack(MAGIC, LAYOUT_VERSION, HEADER_SIZE, payload_size, generation, b"")


def unpack_header(raw: bytes) -> tuple[bytes, int, int, int, int]:
    """``(magic, version, header_size, payload_size, generation)`` of a 64-byte header."""
    magic, ver, hsize, psize, gen, _ = _HDR.unpack(raw[:HEADER_SIZE])
    return magic, ver, hsize, psize, gen


def _layout_error(name: str, what: str) -> LayoutError:
    return LayoutError(
        f"shared memory object {name} ({shm_path(name)}): incompatible layout: {what}. "
        "Stop all old xllm-eplb processes that use this run id, then remove the object "
        "(`xllm-eplb shm clean`); it is never resized or wiped automatically")


class Segment:
    """One mapped, versioned shm object; see the module docstring for the protocol.

    Attributes: ``name``, ``payload_size`` (bytes), ``generation`` (as mapped),
    ``created`` (this open created or reclaimed it), ``reclaimed`` (it was stale), ``mm``.
    """

    def __init__(self, name: str, obj, mm: mmap.mmap, payload_size: int, generation: int,
                 created: bool, reclaimed: bool):
        self.name = name
        self._obj = obj
        self.mm = mm
        self.payload_size = payload_size
        self.generation = generation
        self.created = created
        self.reclaimed = reclaimed
        self.closed = False

    # ---------------------------------------------------------------- open
    @classmethod
    def open(cls, name: str, payload_size: int | None = None, mode: str = "open") -> "Segment":
        """Open ``name`` (``/xllm_eplb_...``) with ``payload_size`` bytes after the header.

        mode ``open``: attach, or create when absent, or reclaim when stale (xLLM semantics).
        mode ``create``: like ``open`` but raise :class:`SegmentBusyError` when live holders exist.
        mode ``attach``: raise :class:`SegmentMissingError` when absent or stale; ``payload_size``
        may be None (taken from the object, checked against its header).
        """
        if mode not in MODES:
            raise ValueError(f"mode={mode!r}: must be one of {MODES}")
        if payload_size is None and mode != "attach":
            raise ValueError(f"{name}: payload_size is required for mode={mode}")
        if payload_size is not None and payload_size < 0:
            raise ValueError(f"{name}: payload_size={payload_size} must be >= 0")
        with generation_lock():
            return cls.open_locked(name, payload_size, mode)

    @classmethod
    def open_locked(cls, name: str, payload_size: int | None = None,
                    mode: str = "open") -> "Segment":
        """:meth:`open` for a caller that already holds :func:`generation_lock`."""
        if mode not in MODES:
            raise ValueError(f"mode={mode!r}: must be one of {MODES}")
        if mode != "attach":
            try:
                obj = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600,
                                             size=HEADER_SIZE + payload_size)
            except posix_ipc.ExistentialError:
                obj = None
            if obj is not None:  # fresh: ftruncate zero-filled the payload
                fcntl.flock(obj.fd, fcntl.LOCK_EX)
                mm = mmap.mmap(obj.fd, HEADER_SIZE + payload_size)
                mm[:HEADER_SIZE] = pack_header(payload_size, 1)
                fcntl.flock(obj.fd, fcntl.LOCK_SH)
                log.debug("shm create name=%s payload=%d generation=1", name, payload_size)
                return cls(name, obj, mm, payload_size, 1, True, False)
        try:
            obj = posix_ipc.SharedMemory(name, 0)
        except posix_ipc.ExistentialError:
            raise SegmentMissingError(f"shared memory object {name} does not exist "
                                      "(its owner has not created it or has exited)") from None
        try:
            return cls._attach_existing(name, obj, payload_size, mode)
        except BaseException:
            obj.close_fd()
            raise

    @classmethod
    def _attach_existing(cls, name, obj, payload_size, mode):
        size = os.fstat(obj.fd).st_size
        if size == 0 and payload_size is not None and mode != "attach" \
                and _flock_nb(obj.fd, fcntl.LOCK_EX):
            # a creator killed between shm_open and ftruncate: an empty, unheld object
            os.ftruncate(obj.fd, HEADER_SIZE + payload_size)
            size = HEADER_SIZE + payload_size
        if size < HEADER_SIZE:
            raise _layout_error(name, f"object size {size} < header size {HEADER_SIZE}")
        if payload_size is not None and size != HEADER_SIZE + payload_size:
            raise _layout_error(name, f"object size {size} != expected "
                                      f"{HEADER_SIZE + payload_size} (header {HEADER_SIZE} + "
                                      f"payload {payload_size})")
        psize = size - HEADER_SIZE
        stale = _flock_nb(obj.fd, fcntl.LOCK_EX)
        if stale and mode == "attach":
            fcntl.flock(obj.fd, fcntl.LOCK_UN)
            raise SegmentMissingError(f"shared memory object {name} has no live holder "
                                      "(its owner exited); nothing to attach to")
        if not stale and mode == "create":
            raise SegmentBusyError(f"shared memory object {name} is in use by live processes "
                                   f"(holders: {holder_pids(name) or 'unknown'}); stop them or "
                                   "use another --run_id")
        if not stale and not _flock_nb(obj.fd, fcntl.LOCK_SH):
            raise SegmentBusyError(f"{name}: exclusively locked outside the generation lock")
        mm = mmap.mmap(obj.fd, size)
        try:
            raw = mm[:HEADER_SIZE]
            incomplete = stale and raw == bytes(HEADER_SIZE)  # creator died before the header
            gen = 0 if incomplete else cls._check_header(name, raw, psize)
            if stale:
                gen += 1
                mm[HEADER_SIZE:] = bytes(psize)
                mm[:HEADER_SIZE] = pack_header(psize, gen)
                fcntl.flock(obj.fd, fcntl.LOCK_SH)
                log.info("shm reclaim stale name=%s payload=%d generation=%d", name, psize, gen)
        except BaseException:
            mm.close()
            raise
        return cls(name, obj, mm, psize, gen, stale, stale)

    @staticmethod
    def _check_header(name: str, raw: bytes, psize: int) -> int:
        magic, ver, hsize, hpsize, gen = unpack_header(raw)
        if magic != MAGIC:
            raise _layout_error(name, f"magic {magic!r} != {MAGIC!r}")
        if ver != LAYOUT_VERSION:
            raise _layout_error(name, f"layout version {ver} != {LAYOUT_VERSION}")
        if hsize != HEADER_SIZE:
            raise _layout_error(name, f"header size {hsize} != {HEADER_SIZE}")
        if hpsize != psize:
            raise _layout_error(name, f"header payload size {hpsize} != object payload {psize}")
        return gen

    # ---------------------------------------------------------------- access
    def read(self, offset: int, n: int) -> bytes:
        """Copy ``n`` payload bytes starting at payload ``offset``."""
        self._check_range(offset, n)
        a = HEADER_SIZE + offset
        return self.mm[a:a + n]

    def write(self, offset: int, data: bytes) -> None:
        """Copy ``data`` into the payload at ``offset``."""
        self._check_range(offset, len(data))
        a = HEADER_SIZE + offset
        self.mm[a:a + len(data)] = data

    def _check_range(self, offset: int, n: int) -> None:
        if self.closed:
            raise ValueError(f"{self.name}: segment is closed")
        if offset < 0 or n < 0 or offset + n > self.payload_size:
            raise IndexError(f"{self.name}: range [{offset}, {offset + n}) outside payload "
                             f"of {self.payload_size} bytes")

    def header(self) -> tuple[bytes, int, int, int, int]:
        return unpack_header(self.mm[:HEADER_SIZE])

    # ---------------------------------------------------------------- close
    def close(self) -> None:
        """Unmap; the last live holder unlinks the object (under the generation lock)."""
        if self.closed:
            return
        with generation_lock():
            self.close_locked()

    def close_locked(self) -> None:
        """:meth:`close` for a caller that already holds :func:`generation_lock`."""
        self.closed = True
        if self.mm.closed:
            return
        self.mm.close()
        fd = self._obj.fd
        fcntl.flock(fd, fcntl.LOCK_UN)
        if _flock_nb(fd, fcntl.LOCK_EX):
            with contextlib.suppress(posix_ipc.ExistentialError):
                posix_ipc.unlink_shared_memory(self.name)
            log.debug("shm unlink name=%s generation=%d", self.name, self.generation)
        self._obj.close_fd()

    def __enter__(self) -> "Segment":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Segment({self.name!r}, payload={self.payload_size}, "
                f"generation={self.generation}, closed={self.closed})")


def holder_pids(name: str) -> list[int]:
    """Pids holding an ``flock`` on the object (from ``/proc/locks``; [] when unknown)."""
    try:
        st = os.stat(shm_path(name))
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    pids = []
    for line in lines:
        parts = line.split()
        if len(parts) < 6 or parts[1] != "FLOCK":
            continue
        # "1: FLOCK ADVISORY READ 1234 00:1a:5678 0 EOF"; waiters read "1: -> FLOCK ..."
        try:
            pid, dev_ino = int(parts[4]), parts[5]
            ino = int(dev_ino.rsplit(":", 1)[1])
        except (ValueError, IndexError):
            continue
        if ino == st.st_ino:
            pids.append(pid)
    return sorted(pids)
