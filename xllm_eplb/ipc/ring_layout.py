"""Byte layout of a broadcast ring (:mod:`xllm_eplb.ipc.broadcast`) inside its segment.

Payload layout (little endian, inside the segment payload)::

    [0, 64)          ring header: b"RNG1", ring version u32, slots u32, frame_bytes u32,
                     num_readers u32, flags u32 (1 = checksums on), write_seq u64,
                     producer pid u64, producer start time u64
    [64, 64+32*N)    per reader: read_seq u64, pid u64, start u64, pad u64
    frames_off ...   ``slots`` frames of ``frame_bytes``: 32-byte frame header
                     (b"FRM1", body_len u32, seq u64, body checksum u32, checksum kind u32,
                     crc32 of the previous 24 header bytes u32, pad) + msgpack body.
                     The header is always checked; the body checksum only on rings created
                     with ``checksum=True`` (kind 1 = crc32 below 16 KiB, 2 = u64 word sum,
                     :mod:`xllm_eplb.ipc.checksum`; 0 = none). Without it a corrupted body is
                     still rejected when it stops being a valid message of this run/schema.
"""

from __future__ import annotations

import struct
import zlib

from xllm_eplb.errors import LayoutError
from xllm_eplb.ipc.checksum import algo_for, checksum
from xllm_eplb.ipc.shm import HEADER_SIZE

RING_MAGIC = b"RNG1"
RING_VERSION = 1
FRAME_MAGIC = b"FRM1"
RHDR = struct.Struct("<4sIIIIIQQQ")    # 48 bytes, padded to 64
READER = struct.Struct("<QQQQ")        # 32 bytes per reader
FHDR = struct.Struct("<4sIQII")        # 24 bytes, then their crc32 (u32), padded to 32
HCRC = 24
FHDR_CRC = struct.Struct("<24sI")      # packed header bytes + their crc32
FHDR_FULL = struct.Struct("<4sIQIII")  # header fields + crc32 (28 bytes)
CRC_RESIDUE = 0x2144DF1C               # zlib.crc32(data + crc32(data) as u32 LE), any data
RING_HEADER = 64
FRAME_HEADER = 32
U64 = struct.Struct("<Q")
WSEQ = 24                              # offsets inside the ring header
WSEQ_ABS = HEADER_SIZE + WSEQ          # ... and inside the mapping
FLAG_CHECKSUM = 1                      # ring header flags: frames carry a body checksum
PROD = 32


def _align64(n: int) -> int:
    return (n + 63) // 64 * 64


def ring_payload_size(num_readers: int, slots: int, frame_bytes: int) -> int:
    """Segment payload bytes for a ring of these dimensions."""
    return frames_off(num_readers) + slots * frame_bytes


def frames_off(num_readers: int) -> int:
    return _align64(RING_HEADER + READER.size * num_readers)


def sem_names(name: str, num_readers: int) -> list[str]:
    """Semaphore names of ring ``name``: ``[d0, s0, d1, s1, ...]``."""
    return [f"{name}_{k}{i}" for i in range(num_readers) for k in ("d", "s")]


def check_ring_header(seg, num_readers, slots, frame_bytes) -> tuple[int, int, int, int]:
    """(slots, frame_bytes, num_readers, flags) from the ring header of ``seg``; dimensions given
    (not None) must match. Raises :class:`LayoutError` naming the ring, never modifies it."""
    if seg.payload_size < RING_HEADER:
        raise LayoutError(f"ring {seg.name}: payload {seg.payload_size} < ring header")
    magic, ver, s, fb, n, flags, _, _, _ = RHDR.unpack(seg.read(0, RHDR.size))
    problems = []
    if magic != RING_MAGIC or ver != RING_VERSION:
        problems.append(f"ring magic/version {magic!r}/{ver} != {RING_MAGIC!r}/{RING_VERSION}")
    for what, want, got in (("num_readers", num_readers, n), ("slots", slots, s),
                            ("frame_bytes", frame_bytes, fb)):
        if want is not None and want != got:
            problems.append(f"{what} {got} != expected {want}")
    if not problems and ring_payload_size(n, s, fb) != seg.payload_size:
        problems.append(f"payload {seg.payload_size} != size implied by header")
    if problems:
        raise LayoutError(f"ring {seg.name}: {'; '.join(problems)}. Stop old xllm-eplb "
                          "processes, check the shm_* settings match, run `xllm-eplb shm clean`")
    return s, fb, n, flags



def parse_frame(mm, off: int, seq: int, cap: int, verify: bool) -> bytes | str:
    """The body of the frame at byte ``off`` of ``mm`` expected to carry sequence ``seq``
    (at most ``cap`` bytes; ``verify``: check its checksum), or why it is rejected (a str)."""
    raw = mm[off:off + HCRC + 4]
    # crc32 over (24 header bytes + their little-endian crc32) is a fixed residue
    if zlib.crc32(raw) != CRC_RESIDUE:
        return "frame header crc mismatch"
    magic, n, fseq, csum, algo, _ = FHDR_FULL.unpack(raw)
    if magic != FRAME_MAGIC:
        return f"frame magic {magic!r} != {FRAME_MAGIC!r}"
    if fseq != seq:
        return f"frame seq {fseq} != expected {seq}"
    if n > cap:
        return f"frame length {n} > capacity {cap}"
    body = mm[off + FRAME_HEADER:off + FRAME_HEADER + n]
    if verify:
        if algo != algo_for(n):
            return f"checksum kind {algo} != {algo_for(n)} for {n} bytes"
        if checksum(body, algo) != csum:
            return f"checksum mismatch on {n} bytes (kind {algo})"
    return body
