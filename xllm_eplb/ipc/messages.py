"""Forward-step messages engine <-> workers and their msgpack wire schema (version 2).

Body = msgpack map ``{"v": SCHEMA_VERSION, "run": run_id, "k": "in" | "out", ...fields}``.
:func:`encode` / :func:`decode` are the only entry points; :func:`decode` raises
:class:`MessageError` (never anything else) for a body that is not msgpack, has another schema
version, another run id, an unexpected kind or malformed fields.

``ForwardInput`` (engine -> every worker, one per step)::

    step: int                      engine step counter
    batches: list[RankBatch]       one per DP rank (= worker), possibly empty
    eplb_info: EplbInfo            the step's control message
    warmup: bool                   warm-up forward (never counted, never an EPLB boundary)
    pure_decode: bool              some batch non-empty and every non-empty one pure decode
                                   (``engine.scheduler.is_pure_decode_step``, computed once)
    shutdown: bool                 last message: workers exit their loop

``ForwardOutput`` (worker -> engine, one per step and rank)::

    step, rank: int
    counters: np.ndarray [L, S] int64   per-MoE-layer prefix-sum dispatch counters
                                        (raw int64 bytes + shape on the wire)
    prepared_token, activation_token: int   (-1 = none)
    sampled: dict[int, int]             req_id -> sampled token id
    logprobs: dict[int, (float, [(int, float)])]   req_id -> (sampled token's logprob, top
                                        (id, logprob) alternatives), only for the rows that
                                        asked (``SeqRow.logprobs`` >= 0); on the wire
                                        ``[[req_id, logprob, [[id, logprob], ...]], ...]``
    timings: StepTimings                seconds (``ipc/records.py``)
    heartbeat: WorkerHeartbeat          wall-clock ``ts`` + the executor's ``ExecutorStats``
    error: str | None                   worker-side failure of this step
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgpack
import numpy as np

from xllm_eplb.eplb.info import NO_TOKEN, EplbInfo
from xllm_eplb.ipc.errors import MessageError
from xllm_eplb.ipc.records import StepTimings, WorkerHeartbeat
from xllm_eplb.model.batch import RankBatch

#: 2: ``StepTimings`` carries the step-time breakdown (``phases``, ``wait_s``, ``ring_s``)
SCHEMA_VERSION = 2
KIND_INPUT = "in"
KIND_OUTPUT = "out"


@dataclass
class ForwardInput:
    step: int
    batches: list[RankBatch] = field(default_factory=list)
    eplb_info: EplbInfo = field(default_factory=EplbInfo)
    warmup: bool = False
    pure_decode: bool = False
    shutdown: bool = False
    #: > 0 (``--elastic_ep``): leave the current process groups and join this generation
    #: (``worker/membership.py``); the step carries no rows
    regroup: int = 0

    @classmethod
    def make_shutdown(cls, step: int = -1) -> "ForwardInput":
        return cls(step=step, shutdown=True)

    def to_dict(self) -> dict:
        return {"step": int(self.step), "batches": [b.to_dict() for b in self.batches],
                "eplb": self.eplb_info.to_dict(), "warmup": bool(self.warmup),
                "pure_decode": bool(self.pure_decode), "shutdown": bool(self.shutdown),
                "regroup": int(self.regroup)}

    @classmethod
    def from_dict(cls, d: dict) -> "ForwardInput":
        return cls(step=_int(d, "step"),
                   batches=[RankBatch.from_dict(b) for b in _typed(d, "batches", list)],
                   eplb_info=EplbInfo.from_dict(_typed(d, "eplb", dict)),
                   warmup=_typed(d, "warmup", bool),
                   pure_decode=_typed(d, "pure_decode", bool),
                   shutdown=_typed(d, "shutdown", bool), regroup=_int(d, "regroup"))


@dataclass
class ForwardOutput:
    step: int
    rank: int
    counters: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), dtype=np.int64))
    prepared_token: int = NO_TOKEN
    activation_token: int = NO_TOKEN
    sampled: dict[int, int] = field(default_factory=dict)
    logprobs: dict[int, tuple[float, list[tuple[int, float]]]] = field(default_factory=dict)
    timings: StepTimings = field(default_factory=StepTimings)
    heartbeat: WorkerHeartbeat = field(default_factory=WorkerHeartbeat)
    error: str | None = None
    #: (``--elastic_ep``) the step's collective failed because a peer is gone: ``error`` says
    #: how; the worker stays up and waits for a regroup (``ForwardInput.regroup``)
    peer_lost: bool = False

    def to_dict(self) -> dict:
        c = np.ascontiguousarray(self.counters, dtype=np.int64)
        if c.ndim != 2:
            raise ValueError(f"ForwardOutput.counters: shape {c.shape} must be [layers, slots]")
        return {"step": int(self.step), "rank": int(self.rank),
                "counters": c.tobytes(), "cshape": [int(c.shape[0]), int(c.shape[1])],
                "prepared": int(self.prepared_token), "activation": int(self.activation_token),
                "sampled": [[int(k), int(v)] for k, v in self.sampled.items()],
                "logprobs": [[int(k), float(lp), [[int(i), float(x)] for i, x in top]]
                             for k, (lp, top) in self.logprobs.items()],
                "timings": self.timings.to_dict(), "heartbeat": self.heartbeat.to_dict(),
                "error": self.error, "peer_lost": bool(self.peer_lost)}

    @classmethod
    def from_dict(cls, d: dict) -> "ForwardOutput":
        raw = _typed(d, "counters", bytes)
        shape = _typed(d, "cshape", list)
        if len(shape) != 2 or not all(isinstance(x, int) and x >= 0 for x in shape):
            raise MessageError(f"field cshape={shape!r}: must be [layers, slots] >= 0")
        if len(raw) != shape[0] * shape[1] * 8:
            raise MessageError(f"field counters: {len(raw)} bytes != {shape[0]}*{shape[1]}*8")
        err = d.get("error")
        if err is not None and not isinstance(err, str):
            raise MessageError(f"field error={err!r}: must be a string or nil")
        return cls(step=_int(d, "step"), rank=_int(d, "rank"),
                   counters=np.frombuffer(raw, dtype=np.int64).reshape(shape).copy(),
                   prepared_token=_int(d, "prepared"), activation_token=_int(d, "activation"),
                   sampled={int(k): int(v) for k, v in _typed(d, "sampled", list)},
                   logprobs=_logprobs(_typed(d, "logprobs", list)),
                   timings=StepTimings.from_dict(_typed(d, "timings", dict)),
                   heartbeat=WorkerHeartbeat.from_dict(_typed(d, "heartbeat", dict)), error=err,
                   peer_lost=_typed(d, "peer_lost", bool))


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_lp(x) -> bool:
    """A log-probability: a float <= 0 (-inf allowed, NaN not)."""
    return isinstance(x, float) and x <= 0.0


def _logprobs(items: list) -> dict[int, tuple[float, list[tuple[int, float]]]]:
    """Wire ``[[req_id, logprob, [[id, logprob], ...]], ...]`` -> ``ForwardOutput.logprobs``."""
    out = {}
    for it in items:
        ok = (isinstance(it, list) and len(it) == 3 and _is_int(it[0]) and _is_lp(it[1])
              and isinstance(it[2], list)
              and all(isinstance(p, list) and len(p) == 2 and _is_int(p[0]) and _is_lp(p[1])
                      for p in it[2]))
        if not ok:
            raise MessageError(f"field logprobs: entry {it!r:.60} must be "
                               f"[req_id, logprob <= 0, [[id, logprob <= 0], ...]]")
        out[it[0]] = (it[1], [(p[0], p[1]) for p in it[2]])
    return out


def _typed(d: dict, key: str, typ: type):
    if key not in d:
        raise MessageError(f"field {key!r} missing")
    v = d[key]
    if not isinstance(v, typ):
        raise MessageError(f"field {key}={v!r:.60}: must be {typ.__name__}")
    return v


def _int(d: dict, key: str) -> int:
    v = _typed(d, key, int)
    if isinstance(v, bool):
        raise MessageError(f"field {key}={v!r}: must be int")
    return v


def encode(msg: ForwardInput | ForwardOutput, run_id: str) -> bytes:
    """msgpack body of ``msg`` tagged with the schema version and ``run_id``."""
    if isinstance(msg, ForwardInput):
        kind = KIND_INPUT
    elif isinstance(msg, ForwardOutput):
        kind = KIND_OUTPUT
    else:
        raise TypeError(f"cannot encode {type(msg).__name__}: expected ForwardInput/Output")
    body = msg.to_dict()
    body.update({"v": SCHEMA_VERSION, "run": run_id, "k": kind})
    try:
        return msgpack.packb(body, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise TypeError(f"{type(msg).__name__} step={msg.step}: a field is not msgpack-safe "
                        f"(plain int/float/str/bytes/list/dict only, e.g. in a record): {e}"
                        ) from None


def decode(body: bytes, run_id: str, kind: str | None = None) -> ForwardInput | ForwardOutput:
    """Parse a body; ``kind`` (``"in"``/``"out"``) restricts the accepted message type.

    Raises :class:`MessageError` naming the problem for any bad body.
    """
    try:
        d = msgpack.unpackb(body, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise MessageError(f"body of {len(body)} bytes is not msgpack: {e!r:.80}") from None
    if not isinstance(d, dict):
        raise MessageError(f"body is a {type(d).__name__}, expected a map")
    v = d.get("v")
    if v != SCHEMA_VERSION:
        raise MessageError(f"schema version {v!r:.20} != {SCHEMA_VERSION} (mixed builds?)")
    if d.get("run") != run_id:
        raise MessageError(f"message of run {d.get('run')!r:.50} != this run {run_id!r}")
    k = d.get("k")
    if k not in (KIND_INPUT, KIND_OUTPUT) or (kind is not None and k != kind):
        raise MessageError(f"message kind {k!r:.20} unexpected (want {kind or 'in/out'})")
    try:
        return ForwardInput.from_dict(d) if k == KIND_INPUT else ForwardOutput.from_dict(d)
    except MessageError:
        raise
    except Exception as e:  # malformed nested fields (RankBatch, EplbInfo, ...)
        raise MessageError(f"malformed {k} message: {e!r:.120}") from None
