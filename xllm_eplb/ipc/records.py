"""Typed records a worker reports in every ``ForwardOutput``: step timings and its heartbeat.

Each record is a dataclass of plain fields (int, float, str, list[float], dict[str, float] or
another record).
``to_dict()`` gives the msgpack map (field name -> value); ``from_dict(d)`` checks it exactly: a
missing, unknown (e.g. renamed) or wrongly typed field raises :class:`MessageError` naming the
record and the field, so no reader ever sees a silent 0.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass, field

from xllm_eplb.eplb.info import NO_LAYER
from xllm_eplb.ipc.errors import MessageError


class Record:
    """Mixin of the typed records: exact ``to_dict`` / ``from_dict`` over the dataclass fields."""

    def to_dict(self) -> dict:
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, d) -> Record:
        name = cls.__name__
        if not isinstance(d, dict):
            raise MessageError(f"{name}: {type(d).__name__} where a map was expected")
        hints = _hints(cls)
        names = [f.name for f in dataclasses.fields(cls)]
        missing = [n for n in names if n not in d]
        unknown = sorted(str(k) for k in d if k not in hints)
        if missing or unknown:
            raise MessageError(f"{name}: fields missing {missing}, unknown {unknown} "
                               f"(worker and engine of different builds?)")
        return cls(**{n: _typed(f"{name}.{n}", d[n], hints[n]) for n in names})


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict:
    return typing.get_type_hints(cls)


def _plain(v):
    """msgpack-ready value: records -> maps, numpy scalars -> Python numbers."""
    if isinstance(v, Record):
        return v.to_dict()
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    return v.item() if hasattr(v, "item") and not isinstance(v, (int, float, str)) else v


def _typed(where: str, v, typ):
    if isinstance(typ, type) and issubclass(typ, Record):
        return typ.from_dict(v)
    if typ is float and isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    if typ in (int, str) and isinstance(v, typ) and not isinstance(v, bool):
        return v
    if typing.get_origin(typ) is list and isinstance(v, list):
        (item,) = typing.get_args(typ)
        return [_typed(f"{where}[{i}]", x, item) for i, x in enumerate(v)]
    if typing.get_origin(typ) is dict and isinstance(v, dict):
        _, item = typing.get_args(typ)
        return {_typed(f"{where} key", k, str): _typed(f"{where}[{k!r}]", x, item)
                for k, x in v.items()}
    raise MessageError(f"field {where}={v!r:.60}: must be {getattr(typ, '__name__', typ)}")


@dataclass
class StepTimings(Record):
    """One rank's timings of one step, seconds.

    ``step_s``: wall clock of the whole worker step; ``cpu_s``: its main-thread CPU;
    ``eplb_s``: main-thread CPU of the executor hooks (the EPLB cost of the step);
    ``expert_cpu_s`` [L_moe]: per MoE layer, the local expert compute thread CPU (the model's
    ``StepResult.timings["expert_cpu_s"]``; the engine's critical path is built from it).
    ``moe_s``: wall clock of the step's MoE layers (routing, dispatch, experts, combine);
    ``comm_s``: the part of it blocked on communication (the per-step count exchange of
    ``balanced`` / capacity included); ``route_s``: thread CPU seconds spent solving the per-step
    replica routing and capacity (0 under ``static`` without capacity), ``moe_cpu_s``: the
    main-thread CPU of the MoE layers (its denominator). ``dropped`` /
    ``rerouted``: routed rows (top-k occurrences) the expert capacity dropped / the fallback
    sent to another expert, summed over MoE layers (``moe_capacity_mode``).

    The step-time breakdown (``/eplb/status`` ``step_breakdown``, ``engine/breakdown.py``):
    ``phases``: seconds of this step's forward (``step_s``) by phase: the model's own
    (attention, router, experts, dispatch, sampling, other: the decoder's ``timer``),
    ``eplb_hooks`` (the executor before/after the forward) and ``other`` for the rest;
    ``wait_s``: the worker blocked on the input ring before this step (the engine's turn);
    ``ring_s``: the worker's ring work since its previous output (that output's encode and
    put, this input's read and decode). ``a2a_rounds``: the EP all-to-all rounds of the step
    (collectives on the EP group, or rounds of the shared-memory transport), summed over MoE
    layers; ``comm_s`` / ``a2a_rounds`` is the mean round as this rank waited for it.
    """

    step_s: float = 0.0
    cpu_s: float = 0.0
    eplb_s: float = 0.0
    expert_cpu_s: list[float] = field(default_factory=list)
    # --- replica routing / capacity ---
    moe_s: float = 0.0
    comm_s: float = 0.0
    route_s: float = 0.0
    moe_cpu_s: float = 0.0             # main-thread CPU of the step's MoE layers
    dropped: int = 0                   # routed rows dropped by expert capacity this step
    rerouted: int = 0                  # rows re-routed by the capacity fallback this step
    # --- step-time breakdown (issue 32) ---
    phases: dict[str, float] = field(default_factory=dict)
    wait_s: float = 0.0
    ring_s: float = 0.0
    a2a_rounds: int = 0                # EP all-to-all rounds this step (issue #39)


@dataclass
class ExecutorStats(Record):
    """The EPLB executor's counters on one rank (``EplbExecutor.stats()``; EPLB off: zeros).

    Heartbeats are wall-clock seconds; 0 means the component does not exist (null executor).
    """

    # prepares: cumulative counts, the last one's duration
    prepares_ok: int = 0
    prepares_failed: int = 0
    last_prepare_ms: float = 0.0
    # activations: cumulative
    activations: int = 0
    p2p_bytes_total: int = 0
    p2p_ops_total: int = 0
    slots_changed_total: int = 0
    # the last activation (from its MoveStats), ms and slots
    last_materialize_ms: float = 0.0
    last_transfer_ms: float = 0.0
    last_activation_ms: float = 0.0
    last_total_ms: float = 0.0
    last_slots_changed: int = 0
    last_update_layer: int = NO_LAYER       # -1: none yet
    # heartbeats: the prepare thread's last wake-up; the P2P path's last after_forward
    heartbeat_ts: float = 0.0
    p2p_heartbeat_ts: float = 0.0
    queued: int = 0                         # prepares waiting (queued or deferred)
    # --- multi-node (#14) ---
    p2p_cross_node_bytes_total: int = 0     # received from ranks on other nodes, cumulative

    # the executor's events (``worker/executor.py``, under its lock); ``now``: wall-clock s
    def prepare_thread_woke(self, now: float) -> None:
        """The prepare thread woke up (a task or its heartbeat timeout)."""
        self.heartbeat_ts = now

    def p2p_checked(self, now: float) -> None:
        """The P2P path passed ``after_forward`` with no transfer in flight."""
        self.p2p_heartbeat_ts = now

    def count_prepare(self, ok: bool, ms: float) -> None:
        """One prepare finished (``ok``: it succeeded) after ``ms`` milliseconds."""
        self.last_prepare_ms = ms
        if ok:
            self.prepares_ok += 1
        else:
            self.prepares_failed += 1

    def count_activation(self, layer: int, move, now: float) -> None:
        """Layer ``layer``'s move finished (its transfer and switch) at ``now``: ``move`` is its
        ``worker.migration.MoveStats`` (ms, slots, bytes, operations)."""
        self.p2p_heartbeat_ts = now
        self.activations += 1
        self.last_update_layer = layer
        self.last_materialize_ms = move.materialize_ms
        self.last_transfer_ms = move.transfer_ms
        self.last_activation_ms = move.activation_ms
        self.last_total_ms = move.total_ms
        self.last_slots_changed = move.changed_slots
        self.slots_changed_total += move.changed_slots
        self.p2p_bytes_total += move.p2p_bytes
        self.p2p_cross_node_bytes_total += move.cross_node_bytes
        self.p2p_ops_total += move.p2p_operations


@dataclass
class WorkerHeartbeat(Record):
    """``ts``: wall-clock seconds when the worker built the output (0 = no heartbeat);
    ``executor``: its executor's counters at that moment."""

    ts: float = 0.0
    executor: ExecutorStats = field(default_factory=ExecutorStats)
