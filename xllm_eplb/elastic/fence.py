"""The silent-worker fence of elastic EP (``--elastic_silence_seconds``): a worker that has not
read a step's input for that long is SIGKILLed by the launcher, once per step, which turns a
hang into a death (recovered as one). Not a phase of the recovery state machine: the engine
keeps serving; ``/health`` shows ``recovering`` / ``fence`` until the next step.
"""

from __future__ import annotations

import logging
import time

from xllm_eplb.obs.logs import event

log = logging.getLogger(__name__)


class SilenceFence:
    """``silence_s``: the silence that fences; ``kill(worker)``: asks the launcher to SIGKILL
    (None: the fence is off, a test engine)."""

    def __init__(self, silence_s: float, kill=None):
        self.silence, self.kill = silence_s, kill
        self.step = -1          # the step whose silent ranks were SIGKILLed (-1: none)
        self.at = 0.0           # time.monotonic() of that fence

    @property
    def active(self) -> bool:
        return self.step >= 0

    def check(self, step: int, silent_for: float, unread) -> None:
        """Step ``step`` has waited ``silent_for`` seconds: past the silence, the workers that
        have not read its input (``unread()``) are SIGKILLed, once per step."""
        if self.kill is None or self.step == step or silent_for <= self.silence:
            return
        silent = unread()
        if not silent:
            return
        self.step, self.at = step, time.monotonic()
        log.warning(event("EPLB elastic silent", step=step, ranks=",".join(map(str, silent)),
                          seconds=round(silent_for, 2)))
        for w in silent:
            self.kill(w)

    def passed(self, step_no: int) -> None:
        """A step after the fenced one was sent: the fence is over."""
        if self.active and step_no > self.step:
            self.step = -1
