"""Continuous-batching scheduler: requests -> one :class:`RankBatch` per DP rank per step.

One DP rank per EP rank. A request is pinned to the DP rank that prefilled it (its KV cache
lives there). Every step carries a decode row for each running request and admits waiting
requests (FIFO) as prefill rows onto the least-loaded rank that still has room
(``max_batch_size`` rows, ``max_prefill_tokens`` prompt tokens per rank per step). Ranks with
nothing to do get an empty batch: they still join every MoE all-to-all.

Chunked prefill: a prompt longer than a rank's prefill budget is prefilled in chunks over
several steps (one prefill row per step, ``start_pos`` = the prompt tokens already in the KV
cache), beside the decode rows of the other requests; the token the worker samples after a
non-final chunk is dropped, so the output is that of one whole-prompt prefill. NOTE: a chunk
row is a prefill row, so a step carrying one is never a pure-decode (EPLB) boundary.

``--async_scheduling`` (``schedule(ahead=True)``): the engine plans step n+1 while step n runs,
before n's tokens are known. A request with a token coming from step n gets a decode row whose
token is :data:`PENDING_TOKEN` (its rank puts in the token it sampled at step n) at the position
after it; one that step n ends by its length gets none; one that an EOS, a stop or a cancel
ends at step n runs one row for nothing (its token is dropped, its KV cache released by a later
step). Greedy and seeded tokens are those of the synchronous schedule.

``--elastic_ep`` (:meth:`void_step`, :meth:`resize`, :meth:`grow`): when a rank dies the step in
flight is void. The dead rank's requests go back to the head of the queue (re-prefilled from
prompt + output on the least-loaded rank); every other request keeps its rank and KV cache and
runs the void step's row again: the next batch of its rank cuts its cache back to the row's
``start_pos`` (``RankBatch.truncate``: the void step may have written or counted those
positions) and a chunk's progress is rolled back. The void step's KV releases are sent again.

Thread model: :meth:`submit` and :meth:`cancel` may be called from any thread (HTTP handlers,
the workload); everything else runs on the engine's step-loop thread only. A request's
``listener`` (if any) is called on the step-loop thread after each new token and once when it
finishes; it must not block (the HTTP layer hands the event to its event loop).
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from xllm_eplb.model.batch import PENDING_TOKEN, RankBatch, SeqRow


@dataclass
class Request:
    """One completion request and its progress. Times are ``time.monotonic()`` seconds."""

    prompt: list[int]
    max_tokens: int
    temperature: float = 0.0
    seed: int = 0
    source: str = "api"
    stop_at_eos: bool = True
    top_p: float = 1.0
    top_k: int = 0
    #: generation stops (reason "stop") on any of these ids when ``stop_at_eos``: the served
    #: tokenizer's ``eos_ids`` (a checkpoint's generation_config.json); empty = no EOS. NOTE:
    #: no default from a tokenizer: a checkpoint's id 257 is an ordinary token
    eos_ids: frozenset = frozenset()
    stop_ids: frozenset = frozenset()
    #: ``stop_check(output) -> True`` ends the request with reason "stop" (stop strings)
    stop_check: Callable[[list[int]], bool] | None = None
    #: ``listener(req, new_tokens, finish_reason)`` (see the module docstring)
    listener: Callable[["Request", list[int], str], None] | None = None
    #: >= 0: collect each output token's ``(logprob, [(id, logprob)] top alternatives)`` in
    #: ``token_logprobs`` (appended before the listener hears of the token); -1 = off
    logprobs: int = -1
    token_logprobs: list = field(default_factory=list)
    req_id: int = -1
    dp_rank: int = -1
    #: context tokens scheduled into the KV cache so far (chunked prefill; the context is
    #: prefilled when this reaches ``prefill_to``)
    prefilled: int = 0
    #: context tokens to prefill: the prompt, or prompt + output for a re-prefill (set when
    #: admitted; -1: the prompt)
    prefill_to: int = -1
    output: list[int] = field(default_factory=list)
    arrival: float = field(default_factory=time.monotonic)
    first_token_at: float = 0.0
    finished_at: float = 0.0
    finish_reason: str = ""
    error: str = ""
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def prefilling(self) -> bool:
        """Part of the context still waits for a prefill chunk."""
        return self.prefilled < (len(self.prompt) if self.prefill_to < 0 else self.prefill_to)

    @property
    def num_tokens(self) -> int:
        """Tokens in the KV cache after this request's next step (prompt + outputs)."""
        return len(self.prompt) + len(self.output)

    # --- the scheduler's operations on a request (nothing else writes its fields) ----------
    def accepted(self, req_id: int) -> None:
        """The scheduler took the request as ``req_id``."""
        self.req_id = req_id

    def admit(self, dp_rank: int) -> None:
        """Admitted to ``dp_rank``: its whole context (prompt, plus the output on a re-prefill)
        is to be prefilled from position 0."""
        self.dp_rank = dp_rank
        self.prefilled, self.prefill_to = 0, self.num_tokens

    def prefill_chunk(self, n: int) -> None:
        """``n`` more context tokens were scheduled into the KV cache."""
        self.prefilled += n

    def rewind_prefill(self, pos: int) -> None:
        """A void step: the context is in the KV cache up to ``pos`` only."""
        self.prefilled = pos

    def move_to(self, dp_rank: int) -> None:
        """The ranks were renumbered (an elastic resize): the request now runs on ``dp_rank``."""
        self.dp_rank = dp_rank

    def emit(self, tok: int, now: float) -> None:
        """Append the sampled token ``tok`` (``now``: its time; the first one's is kept)."""
        if not self.output:
            self.first_token_at = now
        self.output.append(tok)

    def finish(self, reason: str, error: str = "") -> None:
        self.finish_reason, self.error = reason, error
        self.finished_at = time.monotonic()
        self.done.set()
        if self.listener is not None:
            self.listener(self, [], reason)


def is_pure_decode_step(batches: list[RankBatch]) -> bool:
    """The step-level flag ``ForwardInput.pure_decode``: some DP batch non-empty and every
    non-empty one pure decode (empty DP ranks take part and do not veto). The engine computes it
    once per step; the workers pass it to ``forward_step`` (dispatch mode, graph path)."""
    busy = [b for b in batches if not b.is_empty]
    return bool(busy) and all(b.is_pure_decode for b in busy)


def is_eplb_boundary(batches: list[RankBatch], warmup: bool) -> bool:
    """May this step carry EPLB commands? Only a pure-decode step (:func:`is_pure_decode_step`)
    that is not a warm-up forward, as xLLM sends them."""
    return not warmup and is_pure_decode_step(batches)


class Scheduler:
    """Holds waiting and running requests of ``dp_size`` DP ranks."""

    def __init__(self, dp_size: int, max_batch_size: int, max_prefill_tokens: int):
        self.dp_size = dp_size
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.inbox: queue.Queue[Request] = queue.Queue()
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}
        self._release: list[list[int]] = [[] for _ in range(dp_size)]
        self._truncate: list[list[list[int]]] = [[] for _ in range(dp_size)]
        #: the steps scheduled and not yet committed, oldest first (the step in flight, and
        #: the one planned ahead of it): their batches (what :meth:`void_step` rolls back) and
        #: the req_ids whose row yields a token (a decode row or a context's last chunk)
        self._sent: list[tuple[list[RankBatch], set[int]]] = []
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._cancels: dict[int, str] = {}     # req_id -> why (logged by the engine)
        self._cancelled: list[Request] = []
        self._flush = False      # a cancelled running request's KV cache awaits release
        #: requests left waiting by the last :meth:`schedule` because every rank ran
        #: ``max_batch_size`` rows (0 when a slot was free or nothing waited)
        self.waiting_for_slot = 0

    # --- any thread ----------------------------------------------------------------------
    def submit(self, req: Request) -> Request:
        """Queue ``req`` (thread-safe); returns it with its ``req_id`` set."""
        with self._lock:
            req.accepted(next(self._ids))
        if req.max_tokens <= 0:
            req.finish("length")
            return req
        self.inbox.put(req)
        return req

    def cancel(self, req_id: int, why: str = "client gone") -> None:
        """Ask for ``req_id`` to stop (thread-safe): the step loop retires it at its next
        :meth:`pull` (finish reason "cancelled", ``error`` = ``why``); its KV cache is released
        by the next step."""
        with self._lock:
            self._cancels.setdefault(int(req_id), why)

    # --- step-loop thread ----------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        """Rows to run, or a cancelled request's KV cache to release (one step frees it)."""
        return bool(self.waiting or self.running or self._flush)

    def pull(self, timeout: float | None = None) -> None:
        """Move submitted requests into the waiting queue, then retire cancelled ones. Blocks
        up to ``timeout`` seconds for the first one when there is nothing to do (so an idle
        engine burns no CPU)."""
        if not self.has_work and timeout is not None and not self._cancels:
            try:
                self.waiting.append(self.inbox.get(timeout=timeout))
            except queue.Empty:
                pass
        while True:
            try:
                self.waiting.append(self.inbox.get_nowait())
            except queue.Empty:
                break
        if self._cancels:
            self._apply_cancels()

    def _apply_cancels(self) -> None:
        with self._lock:
            ids, self._cancels = self._cancels, {}
        for req in [r for r in self.waiting if r.req_id in ids]:
            self.waiting.remove(req)
            req.finish("cancelled", ids[req.req_id])
            self._cancelled.append(req)
        for rid, why in ids.items():
            req = self.running.get(rid)
            if req is not None:
                self._retire(req, "cancelled", why)
                self._cancelled.append(req)
                self._flush = True

    def reap_cancelled(self) -> list[Request]:
        """Requests cancelled since the last call (for accounting and the log)."""
        out, self._cancelled = self._cancelled, []
        return out

    def _rows_per_rank(self) -> list[int]:
        rows = [0] * self.dp_size
        for r in self.running.values():
            rows[r.dp_rank] += 1
        return rows

    def _pick_rank(self, rows: list[int], prefill: list[int], n: int) -> int:
        """Least-loaded rank with room for one more row of ``n`` prompt tokens, or -1 (a
        re-prefill longer than ``max_prefill_tokens`` goes alone onto a rank)."""
        best = -1
        for k in range(self.dp_size):
            over = prefill[k] + n > self.max_prefill_tokens and (
                prefill[k] or n <= self.max_prefill_tokens)
            if rows[k] >= self.max_batch_size or over:
                continue
            if best < 0 or rows[k] < rows[best]:
                best = k
        return best

    def can_plan_ahead(self) -> bool:
        """Would ``schedule(ahead=True)`` give some rank a row? (Not when every running request
        ends by its length in the step in flight and none waits.)"""
        pending = self._producing
        return bool(self.waiting) or any(
            r.prefilling or not _ends_in_flight(r, r.req_id in pending)
            for r in self.running.values())

    @property
    def _producing(self) -> set[int]:
        """The req_ids whose row in the newest scheduled step yields a token."""
        return self._sent[-1][1] if self._sent else set()

    def schedule(self, ahead: bool = False) -> list[RankBatch]:
        """Build this step's batches: decode rows of running requests, the next chunk of each
        request still prefilling, then admissions (see the module docstring). ``ahead``: the
        step in flight is not committed yet (``--async_scheduling``, the module docstring)."""
        batches = [RankBatch(release=rel, truncate=cut)
                   for rel, cut in zip(self._release, self._truncate, strict=True)]
        self._flush = False
        self._release = [[] for _ in range(self.dp_size)]
        self._truncate = [[] for _ in range(self.dp_size)]
        pending = self._producing if ahead else set()
        producing: set[int] = set()
        self._sent = (self._sent if ahead else []) + [(batches, producing)]
        prefill = [0] * self.dp_size
        for r in self.running.values():
            if not r.prefilling:
                row = _decode_row(r, pending=r.req_id in pending)
                if row is not None:
                    batches[r.dp_rank].rows.append(row)
                    producing.add(r.req_id)
        for r in self.running.values():
            if r.prefilling:
                self._add_chunk(batches, prefill, r)
        rows = self._rows_per_rank()
        self.waiting_for_slot = 0
        while self.waiting:
            req = self.waiting[0]
            # NOTE: prompt + output: a re-prefill (void_step) continues where it stopped
            k = self._pick_rank(rows, prefill, min(req.num_tokens, self.max_prefill_tokens))
            if k < 0:
                if min(rows) >= self.max_batch_size:
                    self.waiting_for_slot = len(self.waiting)
                break  # NOTE: FIFO admission; the head waits until a rank has room
            self.waiting.popleft()
            req.admit(k)
            rows[k] += 1
            self.running[req.req_id] = req
            self._add_chunk(batches, prefill, req)
        return batches

    def _add_chunk(self, batches: list[RankBatch], prefill: list[int], req: Request) -> None:
        """The next prefill chunk of ``req`` on its rank: as many of its remaining context tokens
        (prompt, plus the output so far for a re-prefill) as the rank's prefill budget still
        holds this step (none when it is spent)."""
        k = req.dp_rank
        n = min(req.prefill_to - req.prefilled, self.max_prefill_tokens - prefill[k])
        if n <= 0:
            return
        start = req.prefilled
        prefill[k] += n
        req.prefill_chunk(n)
        if not req.prefilling:          # the context's last chunk: a token comes of it
            self._sent[-1][1].add(req.req_id)
        ctx = req.prompt[start:start + n] if start + n <= len(req.prompt) else \
            (list(req.prompt) + list(req.output))[start:start + n]
        batches[k].rows.append(SeqRow(req.req_id, ctx, start, True,
                                      req.temperature, req.seed, req.top_p, req.top_k,
                                      req.logprobs))

    def update(self, sampled: dict[int, int], logprobs: dict | None = None) -> list[Request]:
        """Append each running request's sampled token (and its ``logprobs`` entry, for a
        request that asked); returns the requests that finished (their KV cache is released in
        the next step's batch of their rank). The token sampled after a non-final prefill
        chunk is dropped (the prompt is not all in the KV cache yet)."""
        now = time.monotonic()
        finished = []
        committed = self._sent.pop(0) if self._sent else None    # no longer a step to void
        producing = committed[1] if committed is not None else None
        for rid, tok in sampled.items():
            req = self.running.get(int(rid))
            if req is None or (req.prefilling if producing is None else rid not in producing):
                continue
            req.emit(int(tok), now)
            if req.logprobs >= 0:
                req.token_logprobs.append((logprobs or {}).get(int(rid), (float("nan"), [])))
            if req.listener is not None:
                req.listener(req, [int(tok)], "")
            reason = _finish_reason(req)
            if reason:
                self._retire(req, reason)
                finished.append(req)
        return finished

    def fail_all(self, error: str) -> None:
        """Finish every waiting and running request with ``error`` (engine shutdown/fault)."""
        self.pull()
        with self._lock:
            self._cancels.clear()
        for req in list(self.running.values()) + list(self.waiting):
            req.finish("error", error)
        self.running.clear()
        self.waiting.clear()

    def void_step(self, lost: int) -> list[Request]:
        """``--elastic_ep``: the step in flight died with DP rank ``lost``; none of its tokens
        is committed. The requests pinned to ``lost`` (their KV cache died with it) go back to
        the head of the queue, to be re-prefilled from prompt + output (sampling is seeded by
        (seed, position), so they continue with the same tokens). Every other running request
        keeps its rank and KV cache and recomputes its row of the void step: its rank's next
        batch cuts its cache back to that row's ``start_pos`` and a prefill chunk's progress
        is rolled back. The void step's KV releases are sent again (a rank may have failed
        before applying them). A step planned ahead of the void one (``--async_scheduling``)
        is void with it: each request rolls back to its row in the older step. Returns the
        requeued requests."""
        sent, self._sent = [b for b, _ in self._sent], []
        for k in range(self.dp_size):
            if k == lost:
                continue
            self._release[k][:0] = [rid for step in sent for rid in step[k].release]
            first: dict[int, SeqRow] = {}
            for step in sent:
                for row in step[k].rows:
                    first.setdefault(row.req_id, row)
            for rid, row in first.items():
                req = self.running.get(rid)
                if req is None:
                    continue
                self._truncate[k].append([rid, row.start_pos])
                if row.is_prefill:
                    req.rewind_prefill(row.start_pos)
        back = sorted((r for r in self.running.values() if r.dp_rank == lost),
                      key=lambda r: r.req_id)
        for req in back:
            del self.running[req.req_id]
            self._release[lost].append(req.req_id)
        self._flush = self._flush or any(self._release) or any(self._truncate)
        self.waiting.extendleft(reversed(back))
        return back

    def resize(self, keep: list[int]) -> None:
        """``--elastic_ep`` shrink, after :meth:`void_step`: DP rank ``r`` of the smaller set
        is old rank ``keep[r]``; the running requests (all on kept ranks) and the pending KV
        releases and truncations follow their ranks; the dead rank's go. The requeued
        requests are re-prefilled on the least-loaded survivors."""
        stray = [r.req_id for r in self.running.values() if r.dp_rank not in keep]
        if stray:
            raise RuntimeError(f"Scheduler.resize: requests {stray} still running on a rank "
                               f"not in keep={keep} (void_step(lost) first)")
        new = {old: r for r, old in enumerate(keep)}
        for req in self.running.values():
            req.move_to(new[req.dp_rank])
        self._release = [self._release[r] for r in keep]
        self._truncate = [self._truncate[r] for r in keep]
        self.dp_size = len(keep)

    def grow(self) -> None:
        """``--elastic_ep`` rejoin: one more DP rank (the last, empty); the running requests
        keep their ranks and KV caches."""
        self._release.append([])
        self._truncate.append([])
        self.dp_size += 1

    def fail_in_flight(self, error: str) -> list[Request]:
        """Finish every running and waiting request with ``error`` (a stalled step,
        ``engine/failures.py``) while the engine keeps running: the running ones' KV caches are
        released by the next step, a late token of theirs is ignored. Returns them."""
        self.pull()
        reqs = list(self.running.values())
        for req in reqs:
            self._retire(req, "error", error)
        self._flush = self._flush or bool(reqs)
        waiting, self.waiting = list(self.waiting), deque()
        for req in waiting:
            req.finish("error", error)
        return reqs + waiting

    def _retire(self, req: Request, reason: str, error: str = "") -> None:
        del self.running[req.req_id]
        self._release[req.dp_rank].append(req.req_id)
        req.finish(reason, error)

    def load(self) -> dict[str, int]:
        return {"waiting": len(self.waiting) + self.inbox.qsize(), "running": len(self.running)}


def _decode_row(r: Request, pending: bool = False) -> SeqRow | None:
    """``r``'s decode row; ``pending``: a token of ``r``'s comes from the step in flight, so the
    row is the one after it, its token :data:`PENDING_TOKEN` (None: that token is ``r``'s last)."""
    if not pending:
        return SeqRow(r.req_id, [r.output[-1]], r.num_tokens - 1, False, r.temperature,
                      r.seed, r.top_p, r.top_k, r.logprobs)
    if _ends_in_flight(r, True):
        return None
    return SeqRow(r.req_id, [PENDING_TOKEN], r.num_tokens, False, r.temperature, r.seed,
                  r.top_p, r.top_k, r.logprobs)


def _ends_in_flight(r: Request, pending: bool) -> bool:
    """Does the token ``r`` gets from the step in flight (``pending``) reach its ``max_tokens``?"""
    return pending and len(r.output) + 1 >= r.max_tokens


def _finish_reason(r: Request) -> str:
    last = r.output[-1]
    if (r.stop_at_eos and last in r.eos_ids) or last in r.stop_ids:
        return "stop"
    if r.stop_check is not None and r.stop_check(r.output):
        return "stop"
    return "length" if len(r.output) >= r.max_tokens else ""
