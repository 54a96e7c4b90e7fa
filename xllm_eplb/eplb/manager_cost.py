"""The manager's cost side (:class:`CostGuard`): the cost model it feeds, the post-commit
checks, and the roll-back of layers measured slower. Called by
:class:`~xllm_eplb.eplb.manager.EplbManager` with its lock held; nothing here locks."""

from __future__ import annotations

import collections
import logging

import numpy as np

from xllm_eplb.eplb.cost_check import CheckResult, CostChecks
from xllm_eplb.eplb.cost_model import CostModel, CostSnapshot, critical_path
from xllm_eplb.obs.logs import event

log = logging.getLogger(__name__)

#: rounds a rolled-back layer is left out of
HOLD_ROUNDS = 2
#: rollback records kept for /eplb/status
ROLLBACKS_KEPT = 16
#: a cost-planned manager whose model has started to observe timings defers rounds until it is
#: fitted, unless its window already holds this many samples (then plan on token counts)
COST_WAIT_SAMPLES = 512


class CostGuard:
    """The cost model, the open commit checks and the roll-back state. It counts nothing
    itself: :meth:`observe` returns the checks it closed and :meth:`rollback_round` the layers
    it restores; the manager adds them to its
    :class:`~xllm_eplb.eplb.manager_stats.Counters` (``count_checks``, ``count_rollback``)."""

    def __init__(self, num_layers: int, ep_size: int, num_logical: int, *,
                 expect_timings: bool = False):
        self.model = CostModel(num_layers, ep_size, num_logical)
        self.checks = CostChecks(self.model)
        self.num_layers = num_layers
        self.rollback: dict[int, np.ndarray] = {}
        self.held: dict[int, int] = {}
        #: why each recent layer was rolled back (/eplb/status ``cost_model.rollbacks``)
        self.rolled: collections.deque = collections.deque(maxlen=ROLLBACKS_KEPT)
        #: layers of the rollback round in flight: their activation restores, it is no commit
        self.restoring: set[int] = set()
        #: the manager's caller reports expert timings (wait for the model from the start)
        self.expect_timings = bool(expect_timings)

    def snapshot(self) -> CostSnapshot | None:
        return self.model.snapshot()

    def waiting(self, window_samples: int, planner) -> bool:
        """True when a round due now should wait for the cost model: the planner plans on cost,
        timings are expected (``expect_timings``) or have started to arrive, but the model is not
        fitted yet (or has seen fewer steps than a post-commit check compares), and the window
        is still young (``COST_WAIT_SAMPLES``). A source without timings plans on token counts
        at once."""
        if getattr(planner, "plan_on", "") != "cost" or not (self.expect_timings
                                                             or self.model.steps > 0):
            return False
        unfit = self.model.steps < self.checks.steps or self.model.snapshot() is None
        return unfit and window_samples < COST_WAIT_SAMPLES

    def observe(self, deltas: np.ndarray, placement: np.ndarray, cpu: np.ndarray,
                epoch: int, logical: np.ndarray | None = None) -> list[CheckResult]:
        """One pure-decode step (measured under placement epoch ``epoch``): the model, then the
        open commit checks; returns the checks this step closed (logged; a regressed layer is
        queued for roll-back)."""
        self.model.observe(deltas, placement, cpu, logical)
        results = self.checks.on_sample(cpu, epoch)
        for res in results:
            self._checked(res)
        return results

    def _checked(self, res: CheckResult) -> None:
        log.info(event("EPLB layer cost check", layer=res.layer,
                       measured_before_ms=round(res.measured_before * 1e3, 4),
                       measured_after_ms=round(res.measured_after * 1e3, 4),
                       measured_gain=round(res.measured_gain, 4),
                       predicted_gain=(None if res.predicted_gain is None
                                       else round(res.predicted_gain, 4)),
                       regressed=res.regressed))
        if res.regressed:
            self.rollback[res.layer] = res.prev_row
            self.rolled.append(rollback_record(res, self.checks.steps, self.checks.tol))

    def status(self, active: np.ndarray, initial: np.ndarray) -> dict:
        """Fit (``fixed_s`` / ``row_s`` / ``samples`` per layer, ``ready``) and, once ready,
        the modelled critical path per step under ``active`` and ``initial`` (seconds)."""
        fit = self.model.fit()
        out = {"ready": fit.ready, "fixed_s": fit.fixed.tolist(), "row_s": fit.row.tolist(),
               "samples": fit.samples.tolist(), "observed_steps": self.model.steps,
               "predicted_critical_s": None, "predicted_critical_initial_s": None,
               "rollbacks": list(self.rolled)}
        if fit.ready:
            rate, d = self.model.per_step_rate(), self.model.D
            out["predicted_critical_s"] = float(critical_path(fit, rate, active, d).sum())
            out["predicted_critical_initial_s"] = float(critical_path(fit, rate, initial,
                                                                      d).sum())
        return out

    def on_commit(self, layer: int, prev_row: np.ndarray, epoch: int) -> bool:
        """``layer``'s new row is active; False when it was a rollback's restore (counted in
        ``layers_rolled_back``, not in ``layers_committed``)."""
        self.checks.on_commit(layer, prev_row, epoch)
        if layer in self.restoring:
            self.restoring.discard(layer)
            return False
        return True

    def rollback_round(self, active: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """(table [L, D*S], update [L]) restoring the rows of layers measured slower, or None;
        those layers then sit out the next ``HOLD_ROUNDS`` rounds."""
        if not self.rollback:
            return None
        table = np.array(active, dtype=np.int64)
        update = np.zeros(self.num_layers, dtype=bool)
        for layer, row in self.rollback.items():
            table[layer], update[layer] = row, True
            self.held[layer] = HOLD_ROUNDS
        self.rollback = {}
        self.restoring = set(np.nonzero(update)[0].tolist())
        log.warning(event("EPLB rolling back layers measured slower",
                          layers=",".join(map(str, np.nonzero(update)[0]))))
        return table, update

    def filter_round(self, rnd, active: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A planned round's (table, update) with held layers kept as deployed; remembers the
        round's cost predictions for the commit checks."""
        update = np.asarray(rnd.update, dtype=bool).copy()
        table = np.array(rnd.table, dtype=np.int64)
        self.restoring = set()              # a planned round: its activations are commits
        for layer in list(self.held):
            update[layer], table[layer] = False, active[layer]
            self.held[layer] -= 1
            if self.held[layer] <= 0:
                del self.held[layer]
        self.checks.on_round(rnd.gate)
        return table, update


def rollback_record(res: CheckResult, steps: int, tol: float) -> dict:
    """Why ``res.layer`` is rolled back, for /eplb/status: its slowest rank's expert time per
    decode step over ``steps`` steps before and after the commit, and the rule it broke."""
    pred = "" if res.predicted_gain is None else (
        f"; the cost model had predicted {-res.predicted_gain:+.1%}")
    return {"layer": res.layer,
            "measured_before_ms": round(res.measured_before * 1e3, 4),
            "measured_after_ms": round(res.measured_after * 1e3, 4),
            "measured_gain": round(res.measured_gain, 4),
            "predicted_gain": None if res.predicted_gain is None else round(res.predicted_gain, 4),
            "why": f"layer {res.layer}: its slowest rank's expert time per decode step was "
                   f"{res.measured_after * 1e3:.3f} ms over the {steps} steps after the commit "
                   f"vs {res.measured_before * 1e3:.3f} ms before ({-res.measured_gain:+.1%}, "
                   f"more than the {tol:.0%} tolerance){pred}: its previous row was restored "
                   f"and it sits out the next {HOLD_ROUNDS} rounds (the two windows also see different "
                   f"traffic: a change of load between them reads as a change of placement)"}
