"""Where the engine's step-loop wall time goes, by phase (``/eplb/status`` ``step_breakdown``,
the Prometheus counter ``xllm_eplb_step_phase_seconds_total{phase}``).

The step loop marks *laps*: each :meth:`StepBreakdown.lap` gives the seconds since the previous
mark to one phase, so the phases sum to the loop's wall time exactly. Engine phases:

- ``idle``: blocked on the request queue with nothing to run;
- ``schedule``: pulling requests, building the batches, the once-a-second refresh;
- ``eplb_hooks``: the EPLB manager's per-step work (``eplb_info``, ``on_outputs``);
- ``telemetry``: per-step metrics, recorder and expert-load bookkeeping;
- ``http``: handing the sampled tokens to the requests (listeners -> the HTTP event loop).

The forward (from writing the input to holding every rank's output) is split along the
critical path, the rank whose forward (``StepTimings.step_s``) was slowest: its phases
(``StepTimings.phases``: attention, router, experts, dispatch, sampling, other from the model's
timer, ``eplb_hooks`` of the executor) and ``ring``, the rest of the wait (encode, shared-memory
hand-over and decode both ways, the workers' loop). ``per_rank`` keeps every rank's own forward
phases plus ``wait`` (blocked on its input ring: the engine's turn) and ``ring_io``.
``all_to_all`` keeps, per rank, the EP all-to-all rounds and the seconds blocked on
communication (``StepTimings.a2a_rounds``, ``comm_s``): rounds per step and the mean round.

Always on: a lap is one ``perf_counter`` call and a dict update (~1 us; a step is milliseconds).
"""

from __future__ import annotations

import threading
import time


class StepBreakdown:
    """Cumulative seconds per phase since :meth:`reset` (the step loop's thread writes; HTTP
    threads read :meth:`summary` under the lock)."""

    def __init__(self, ranks: int, clock=time.perf_counter):
        self._clock = clock
        self._lock = threading.Lock()
        self.per_rank: list[dict[str, float]] = [{} for _ in range(ranks)]
        self.reset(ranks)

    def reset(self, ranks: int | None = None) -> None:
        """Start counting now (the serving loop's start); ``ranks``: a new rank count."""
        with self._lock:
            n = len(self.per_rank) if ranks is None else ranks
            self.seconds: dict[str, float] = {}
            self.per_rank = [{} for _ in range(n)]
            self.comm = [[0, 0.0] for _ in range(n)]         # per rank: [rounds, seconds]
            self.steps = 0
            self._exported: dict[str, float] = {}        # the counter keeps what it had: it only grows
            self._last = self._clock()

    def resize(self, ranks: int) -> None:
        """The rank count changed (elastic shrink / rejoin): per-rank sums start again."""
        with self._lock:
            self.per_rank = [{} for _ in range(ranks)]
            self.comm = [[0, 0.0] for _ in range(ranks)]

    def lap(self, phase: str) -> None:
        """The seconds since the previous mark belong to ``phase``."""
        now = self._clock()
        dt, self._last = now - self._last, now
        with self._lock:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + dt

    def forward(self, outs) -> None:
        """Mark the end of a forward: the lap since the input was written, split along the
        slowest rank's phases, the remainder ``ring``; every rank's own phases per rank."""
        now = self._clock()
        dt, self._last = now - self._last, now
        crit = max(range(len(outs)), key=lambda r: outs[r].timings.step_s)
        phases = outs[crit].timings.phases
        inside = sum(phases.values())
        scale = min(1.0, dt / inside) if inside > 0 else 0.0   # never more than the lap
        with self._lock:
            for p, s in phases.items():
                self.seconds[p] = self.seconds.get(p, 0.0) + s * scale
            self.seconds["ring"] = self.seconds.get("ring", 0.0) + max(0.0, dt - inside)
            self.steps += 1
            if len(self.per_rank) != len(outs):
                self.per_rank = [{} for _ in outs]
                self.comm = [[0, 0.0] for _ in outs]
            for acc, c, o in zip(self.per_rank, self.comm, outs, strict=True):
                t = o.timings
                for p, s in (*t.phases.items(), ("wait", t.wait_s), ("ring_io", t.ring_s)):
                    acc[p] = acc.get(p, 0.0) + s
                c[0] += t.a2a_rounds
                c[1] += t.comm_s

    def summary(self) -> dict:
        """``{"wall_s", "steps", "seconds": {phase: s}, "fraction": {phase: share of wall},
        "per_rank": [{phase: s}], "all_to_all": [{"rounds", "comm_s", "rounds_per_step",
        "round_us"}] per rank}`` (seconds since :meth:`reset`; ``round_us``: comm seconds per
        round, 0 without rounds)."""
        with self._lock:
            sec = dict(self.seconds)
            ranks = [dict(r) for r in self.per_rank]
            comm = [list(c) for c in self.comm]
            steps = self.steps
        wall = sum(sec.values())
        a2a = [{"rounds": n, "comm_s": s, "rounds_per_step": n / steps if steps else 0.0,
                "round_us": 1e6 * s / n if n else 0.0} for n, s in comm]
        return {"wall_s": wall, "steps": steps, "seconds": sec,
                "fraction": {p: s / wall for p, s in sec.items()} if wall > 0 else {},
                "per_rank": ranks, "all_to_all": a2a}

    def export(self, counter) -> None:
        """Bring the Prometheus counter (label ``phase``) up to the sums (at scrape time)."""
        with self._lock:
            sec = dict(self.seconds)
        for p, s in sec.items():
            d = s - self._exported.get(p, 0.0)
            if d > 0:
                counter.labels(p).inc(d)
                self._exported[p] = s
