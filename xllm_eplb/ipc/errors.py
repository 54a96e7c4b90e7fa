"""Errors of the shared-memory transport.

``LayoutError`` (a size, magic or version mismatch) lives in :mod:`xllm_eplb.errors` because it is
a user-facing error (stop the old processes, run ``xllm-eplb shm clean``). Everything else here is
a runtime fault of the transport and names the object or ring it concerns.
"""

from __future__ import annotations

from xllm_eplb.errors import LayoutError

__all__ = [
    "LayoutError", "IpcError", "SegmentMissingError", "SegmentBusyError", "RingTimeoutError",
    "PeerDeadError", "FrameTooLargeError", "MessageError",
]


class IpcError(Exception):
    """Base class of transport faults (not layout mismatches)."""


class SegmentMissingError(IpcError, FileNotFoundError):
    """An attacher found no live object of that name (owner not started yet, or gone)."""


class SegmentBusyError(IpcError):
    """A creator found the object held by live processes (another run uses the same names)."""


class RingTimeoutError(IpcError, TimeoutError):
    """``put``/``get`` did not complete within its timeout; the message names the ring."""


class PeerDeadError(IpcError):
    """The process on the other side of a ring is gone (its registered pid no longer runs)."""


class FrameTooLargeError(IpcError, ValueError):
    """An encoded message does not fit in one ring slot."""


class MessageError(IpcError, ValueError):
    """A frame body that is not a valid message of this run and schema version."""


class BadFrameError(IpcError):
    """A strict reader (the engine's output rings) got a frame that fails its header or
    checksum check, or whose body is not a valid message: the step cannot be trusted."""
