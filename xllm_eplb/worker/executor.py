"""`EplbExecutor`: the worker side of one rebalance (after xLLM's EplbExecutor).

Per forward step, on the worker's main thread::

    executor.before_forward(info)   # start P2P for info.update_layer_id; queue the prepare
    model.forward_step(...)
    executor.after_forward()        # wait P2P, activate in place; release a deferred prepare
    token = executor.consume_ready_token()

Prepares run on one background thread (host-only work). A prepare that arrives in the same
step as an activation is deferred until that activation finishes, so it plans against the
placement the activation leaves behind. The ready token holds the latest successful prepare
and is read-and-cleared; a failed prepare is logged and never reported (the manager's timeout
aborts the layer).

``stats()`` is an :class:`~xllm_eplb.ipc.records.ExecutorStats` (it travels in every
``ForwardOutput.heartbeat``). Its heartbeats are wall-clock seconds of ``clock``: ``heartbeat_ts``
= the prepare thread's last wake-up (a task or its ``eplb_heartbeat_seconds`` timeout);
``p2p_heartbeat_ts`` = the P2P path's last ``after_forward``: an activation's transfer + switch
finished, or checked with nothing pending (the main thread passes there every step).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from dataclasses import dataclass

import numpy as np

from xllm_eplb.eplb.info import NO_LAYER, NO_TOKEN, EplbInfo
from xllm_eplb.ipc.records import ExecutorStats
from xllm_eplb.obs.logs import event
from xllm_eplb.worker.faults import NO_FAULTS
from xllm_eplb.worker.migration import ModelEplbHooks

log = logging.getLogger(__name__)


@dataclass
class _Task:
    layer: int
    token: int
    expert_ids: np.ndarray


class EplbExecutor:
    """``hooks``: a :class:`~xllm_eplb.worker.migration.ModelEplbHooks` (or anything with the
    same four methods, ``update_expert_weight`` returning a ``MoveStats``). ``clock``: wall
    clock for the heartbeat timestamp. ``faults``: fault-injection hooks
    (:mod:`xllm_eplb.worker.faults`; the null object by default)."""

    def __init__(self, hooks, cfg, *, clock=time.time, faults=NO_FAULTS):
        self.hooks = hooks
        self.faults = faults
        self.heartbeat_s = float(cfg.eplb.eplb_heartbeat_seconds)
        self._clock = clock
        self._lock = threading.Lock()
        self._tasks: queue.Queue[_Task | None] = queue.Queue()
        self._ready_token = NO_TOKEN
        self._pending_update = NO_LAYER
        self._deferred: _Task | None = None
        self._stats = ExecutorStats(heartbeat_ts=clock(), p2p_heartbeat_ts=clock())
        self._since = {"ok": 0, "failed": 0}
        self._buckets_seen = dict(getattr(hooks, "bucket_totals", {}))
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="eplb-executor", daemon=True)
        self._thread.start()

    # ---- main thread ------------------------------------------------------------------------
    def before_forward(self, info: EplbInfo) -> None:
        task = None
        if info.prepare_layer_id != NO_LAYER:
            if info.prepare_token <= 0:
                raise ValueError(f"EplbInfo: prepare_layer_id={info.prepare_layer_id} with "
                                 f"prepare_token={info.prepare_token}, must be > 0")
            task = _Task(int(info.prepare_layer_id), int(info.prepare_token),
                         np.asarray(info.expert_ids, dtype=np.int64).copy())
        if info.update_layer_id != NO_LAYER:
            if self._pending_update != NO_LAYER:
                raise RuntimeError(f"activation of layer {info.update_layer_id} while layer "
                                   f"{self._pending_update} is still pending")
            self.faults.before_activate(int(info.update_layer_id))
            self.hooks.start_expert_weight_transfer(int(info.update_layer_id))
            self._pending_update = int(info.update_layer_id)
            self.faults.mid_transfer(self._pending_update)
        if task is None:
            return
        if self._pending_update != NO_LAYER:
            if self._deferred is not None:
                raise RuntimeError("two prepares deferred behind one activation")
            self._deferred = task
        else:
            self._tasks.put(task)

    def after_forward(self) -> None:
        if self._pending_update == NO_LAYER:
            with self._lock:                        # checked: no transfer in flight
                self._stats.p2p_checked(self._clock())
            return
        layer, self._pending_update = self._pending_update, NO_LAYER
        self.faults.p2p_wait(layer)
        st = self.hooks.update_expert_weight(layer)
        self.faults.after_activate(layer)
        with self._lock:
            self._stats.count_activation(layer, st, self._clock())
        if self._deferred is not None:
            self._tasks.put(self._deferred)
            self._deferred = None

    def consume_ready_token(self) -> int:
        """The latest successful prepare token, exactly once; -1 if none since the last call."""
        with self._lock:
            t, self._ready_token = self._ready_token, NO_TOKEN
            return t

    def stats(self) -> ExecutorStats:
        """A copy of the counters, ``queued`` filled in."""
        with self._lock:
            return dataclasses.replace(self._stats, queued=self._tasks.qsize()
                                       + (self._deferred is not None))

    def close(self, timeout: float = 5.0) -> None:
        if self._closed:
            return
        self._closed = True
        self._tasks.put(None)
        self._thread.join(timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- background thread ------------------------------------------------------------------
    def _loop(self) -> None:
        next_beat = time.monotonic() + self.heartbeat_s
        while True:
            try:
                task = self._tasks.get(timeout=max(0.0, next_beat - time.monotonic()))
            except queue.Empty:
                task = _Task(NO_LAYER, NO_TOKEN, np.zeros(0, np.int64))
            if task is None:
                return
            if task.layer != NO_LAYER:
                self._run(task)
            with self._lock:
                self._stats.prepare_thread_woke(self._clock())
            if time.monotonic() >= next_beat:
                self._heartbeat()
                next_beat = time.monotonic() + self.heartbeat_s

    def _run(self, task: _Task) -> None:
        t0 = time.perf_counter()
        err = ""
        try:
            self.faults.prepare(task.layer)
            ok = bool(self.hooks.prepare_expert_weight(task.layer, task.expert_ids) is not False)
            ok = ok and bool(self.hooks.last_prepare_ok(task.layer))
            if not ok and hasattr(self.hooks, "last_prepare_error"):
                err = self.hooks.last_prepare_error(task.layer)
        except Exception as exc:  # noqa: BLE001 - a failed prepare is reported as not ready
            ok, err = False, f"{type(exc).__name__}: {exc}"
        ms = (time.perf_counter() - t0) * 1e3
        with self._lock:
            self._stats.count_prepare(ok, ms)
            if ok:
                self._ready_token = task.token
            self._since["ok" if ok else "failed"] += 1
        if ok:
            log.info(event("prepare_expert_weight", layer=task.layer, token=task.token,
                           experts=task.expert_ids.size, duration_ms=ms))
        else:
            log.error(event("prepare_expert_weight failed", layer=task.layer, token=task.token,
                            experts=task.expert_ids.size, duration_ms=ms,
                            error=err or "hook reported failure", ready="not_advanced"))

    def _heartbeat(self) -> None:
        with self._lock:
            ok, failed = self._since["ok"], self._since["failed"]
            self._since = {"ok": 0, "failed": 0}
            last = self._stats.last_prepare_ms
        log.info(event("EPLB heartbeat executor_thread", tasks_ok_since_last=ok,
                       tasks_failed_since_last=failed, last_prepare_ms=float(last),
                       queued=self._tasks.qsize()))
        totals = dict(getattr(self.hooks, "bucket_totals", {}))
        if ok and totals:
            delta = {f"delta_{k}": v - self._buckets_seen.get(k, 0) for k, v in totals.items()}
            self._buckets_seen = totals
            log.info(event("EPLB heartbeat p2p_bucket", rank=getattr(self.hooks, "rank", -1),
                           **delta, total_cross_rank=totals.get("cross_rank", 0)))


class NullExecutor:
    """EPLB off: no thread, no work; same interface."""

    def before_forward(self, info: EplbInfo) -> None:
        if not info.empty:
            raise RuntimeError("EplbInfo carries a command but enable_eplb=false")

    def after_forward(self) -> None:
        pass

    def consume_ready_token(self) -> int:
        return NO_TOKEN

    def stats(self) -> ExecutorStats:
        return ExecutorStats()              # no thread, no P2P path: heartbeats stay 0

    def close(self, timeout: float = 5.0) -> None:
        pass


def make_executor(model, eplb_group, cfg, *, canary: bool | None = None, faults=NO_FAULTS):
    """The worker's executor: :class:`EplbExecutor` over :class:`ModelEplbHooks` when
    ``cfg.eplb.enable_eplb``, else a :class:`NullExecutor` (reserves nothing)."""
    if not cfg.eplb.enable_eplb:
        log.info(event("EPLB executor", mode="off", thread=False, staging=False))
        return NullExecutor()
    ex = EplbExecutor(ModelEplbHooks(model, eplb_group, cfg, canary=canary), cfg, faults=faults)
    log.info(event("EPLB executor", mode="on", thread=True, staging=True))
    return ex
