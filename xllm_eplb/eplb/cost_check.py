"""After a commit: did the layer get faster, as the cost model said? (pure bookkeeping)

For each committed layer the manager opens a :class:`CommitCheck`: the measured critical path
of the layer before the commit (max over ranks of the mean expert seconds per step over the
last ``steps`` observed steps, :meth:`~xllm_eplb.eplb.cost_model.CostModel.measured`) and, when
the round was gated on cost, the modelled critical paths under the old and the new row. It then
sums the next ``steps`` pure-decode steps measured under the new placement (samples tagged with
the commit's placement epoch or a later one) and closes with a :class:`CheckResult`: the predicted
and the measured relative gain, and ``regressed`` when the layer got slower by more than
``tol`` (the manager then rolls it back to ``prev_row`` and counts it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from xllm_eplb.eplb.cost_model import CostModel

#: decode steps measured on each side of a commit
CHECK_STEPS = 48
#: a layer whose measured critical path grew by more than this share is "slower"
REGRESS_TOL = 0.05


@dataclass
class CommitCheck:
    """One open check (see the module doc); ``sums`` float64 [D] expert seconds per rank."""

    layer: int
    prev_row: np.ndarray
    placement_epoch: int
    measured_before: float
    predicted_before: float | None
    predicted_after: float | None
    sums: np.ndarray
    n: int = 0

    def add_step(self, seconds: np.ndarray) -> int:
        """One step measured under the new row: ``seconds`` float64 [D] expert seconds of the
        layer per rank. Returns the steps summed so far."""
        self.sums += seconds
        self.n += 1
        return self.n


@dataclass(frozen=True)
class CheckResult:
    """A closed check: gains are relative drops of the critical path (> 0: faster)."""

    layer: int
    prev_row: np.ndarray
    measured_before: float
    measured_after: float
    predicted_gain: float | None
    measured_gain: float
    regressed: bool


class CostChecks:
    """The open checks of one manager (not thread-safe: called under the manager's lock)."""

    def __init__(self, model: CostModel, steps: int = CHECK_STEPS, tol: float = REGRESS_TOL):
        self.model, self.steps, self.tol = model, int(steps), float(tol)
        self.predicted: dict[int, tuple[float, float]] = {}
        self.open: dict[int, CommitCheck] = {}

    def on_round(self, records) -> None:
        """A published round's gate records: keep the modelled (before, after) of cost-gated
        layers until they commit."""
        self.predicted = {r.layer: (r.current_peak, r.proposed_peak) for r in records
                          if r.basis == "cost" and r.placement_changed}

    def on_commit(self, layer: int, prev_row: np.ndarray, epoch: int) -> None:
        """``layer`` committed (its row was ``prev_row``); the window is now placement epoch
        ``epoch``."""
        before, n = self.model.measured(layer, self.steps)
        pred = self.predicted.pop(layer, (None, None))
        if n < self.steps // 2 or before <= 0:
            self.open.pop(layer, None)         # too little measured before: nothing to compare
            return
        self.open[layer] = CommitCheck(layer, np.array(prev_row, dtype=np.int64), epoch,
                                       before, pred[0], pred[1], np.zeros(self.model.D))

    def on_sample(self, expert_cpu: np.ndarray, epoch: int) -> list[CheckResult]:
        """One observed step (``expert_cpu`` [D, L]) measured under placement epoch ``epoch``;
        returns the checks it closed."""
        done = []
        for layer, c in list(self.open.items()):
            if epoch < c.placement_epoch:
                continue                        # measured under the old row (queue lag)
            if c.add_step(expert_cpu[:, layer]) >= self.steps:
                done.append(self._close(self.open.pop(layer)))
        return done

    def _close(self, c: CommitCheck) -> CheckResult:
        after = float((c.sums / c.n).max())
        gain = (c.measured_before - after) / c.measured_before
        pred = (None if c.predicted_before is None or c.predicted_before <= 0 else
                (c.predicted_before - c.predicted_after) / c.predicted_before)
        return CheckResult(c.layer, c.prev_row, c.measured_before, after, pred, gain,
                           after > c.measured_before * (1.0 + self.tol))
