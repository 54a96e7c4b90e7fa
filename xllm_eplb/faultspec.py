"""Fault-injection specs: ``--fault_inject=KIND:k=v,k=v`` -> :class:`Fault` (pure parsing).

Fault injection is off by default and refused unless ``--enable_fault_injection=true``. Each
spec names one kind and the keys that select when it fires; a key left out matches anything.
Every fault is deterministic: it fires on the ranks, MoE layers, rounds or engine steps named.

=================  ========================================  ======================================
kind               keys (required in bold)                   what happens on the selected rank
=================  ========================================  ======================================
``prepare_delay``  rank, layer, round, **seconds**           the prepare thread sleeps first
``prepare_fail``   rank, layer, round                        the prepare raises (never ready)
``p2p_delay``      rank, layer, round, **seconds**           the P2P wait sleeps first
``p2p_fail``       rank, layer, round, mode=raise|hang       the P2P wait raises / never returns
``crash``          rank, layer, round, **phase**             the worker process exits at once
``slow_step``      rank, step, **seconds**                   the forward of that step sleeps
``corrupt_output`` rank, step                                the output frame's checksum is wrong
``join_delay``     rank, **seconds**                         an elastic joiner, loaded, sleeps
                                                             before it signals ``join_ready``
=================  ========================================  ======================================

``layer`` is the MoE-local layer id; ``round`` counts, per rank and layer, the prepares
(``prepare_*``) or the activations (``p2p_*``, ``crash``) of that layer, from 1; ``step`` is
the engine's step number (the two warm-up forwards are steps 1 and 2). ``crash`` phases:
``before_activate`` (before the forward that activates a layer, nothing posted),
``mid_transfer`` (its P2P posted, during the forward), ``after_activate`` (the layer switched,
before that step's output is written).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: kind -> (allowed keys, required keys)
KINDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "prepare_delay": (("rank", "layer", "round", "seconds"), ("seconds",)),
    "prepare_fail": (("rank", "layer", "round"), ()),
    "p2p_delay": (("rank", "layer", "round", "seconds"), ("seconds",)),
    "p2p_fail": (("rank", "layer", "round", "mode"), ()),
    "crash": (("rank", "layer", "round", "phase"), ("phase",)),
    "slow_step": (("rank", "step", "seconds"), ("seconds",)),
    "corrupt_output": (("rank", "step"), ()),
    "join_delay": (("rank", "seconds"), ("seconds",)),
}
PHASES = ("before_activate", "mid_transfer", "after_activate")
P2P_MODES = ("raise", "hang")
#: the longest injected sleep (seconds): a delay is a fault, not a way to stop a run
MAX_SECONDS = 3600.0


class FaultSpecError(ValueError):
    """A ``--fault_inject`` value breaks a rule; the message is the rule (the caller names the
    flag and the value)."""


@dataclass(frozen=True)
class Fault:
    """One parsed spec; ``None`` selectors match anything."""

    kind: str
    rank: int | None = None
    layer: int | None = None
    round: int | None = None
    step: int | None = None
    seconds: float = 0.0
    phase: str = ""
    mode: str = "raise"

    def selects(self, rank: int, *, layer: int | None = None, round: int | None = None,
                step: int | None = None) -> bool:
        """True when this fault fires for ``rank`` at that layer / round / step."""
        return all(want is None or got is None or want == got for want, got in
                   ((self.rank, rank), (self.layer, layer), (self.round, round),
                    (self.step, step)))


def _int(key: str, text: str, lo: int) -> int:
    try:
        v = int(text)
    except ValueError:
        raise FaultSpecError(f"{key}={text!r} must be an integer >= {lo}") from None
    if v < lo:
        raise FaultSpecError(f"{key}={v} must be >= {lo}")
    return v


def _seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = math.nan
    if not (0 < v <= MAX_SECONDS):
        raise FaultSpecError(f"seconds={text!r} must be a number in (0, {MAX_SECONDS:g}]")
    return v


def _choice(key: str, text: str, allowed: tuple[str, ...]) -> str:
    if text not in allowed:
        raise FaultSpecError(f"{key}={text!r} must be one of {', '.join(allowed)}")
    return text


def parse_fault(text: str) -> Fault:
    """``KIND`` or ``KIND:k=v,k=v`` -> :class:`Fault`; :class:`FaultSpecError` names the rule."""
    if not isinstance(text, str):
        raise FaultSpecError(f"must be a string KIND:k=v,k=v, got {type(text).__name__}")
    kind, _, rest = text.strip().partition(":")
    kind = kind.strip()
    if kind not in KINDS:
        raise FaultSpecError(f"unknown fault kind {kind!r}: must be one of {', '.join(KINDS)}")
    allowed, required = KINDS[kind]
    vals: dict[str, object] = {}
    for item in (p.strip() for p in rest.split(",")) if rest.strip() else ():
        key, eq, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or not key or not value:
            raise FaultSpecError(f"{item!r} must look like key=value")
        if key not in allowed:
            raise FaultSpecError(f"{kind} takes no key {key!r}: allowed {', '.join(allowed)}")
        if key in vals:
            raise FaultSpecError(f"key {key!r} given twice")
        if key in ("rank", "layer"):
            vals[key] = _int(key, value, 0)
        elif key in ("round", "step"):
            vals[key] = _int(key, value, 1)
        elif key == "seconds":
            vals[key] = _seconds(value)
        elif key == "phase":
            vals[key] = _choice(key, value, PHASES)
        else:
            vals[key] = _choice(key, value, P2P_MODES)
    missing = [k for k in required if k not in vals]
    if missing:
        raise FaultSpecError(f"{kind} needs {', '.join(f'{k}=' for k in missing)}")
    return Fault(kind=kind, **vals)


def fault_rules(specs: tuple, enabled: bool, ep_size: int | None,
                num_moe_layers: int) -> list[tuple[str, str]]:
    """(spec text, rule) for every violation of the ``fault_inject`` list: a parse error, use
    without ``enable_fault_injection``, a rank outside ``[0, ep_size)`` or a layer outside
    ``[0, num_moe_layers)`` (a fault that could never fire)."""
    bad: list[tuple[str, str]] = []
    for text in specs:
        try:
            f = parse_fault(text)
        except FaultSpecError as e:
            bad.append((text, str(e)))
            continue
        if not enabled:
            bad.append((text, "needs --enable_fault_injection=true"))
        elif ep_size is not None and f.rank is not None and f.rank >= ep_size:
            bad.append((text, f"rank={f.rank} must be < --ep_size={ep_size}"))
        elif f.layer is not None and f.layer >= num_moe_layers:
            bad.append((text, f"layer={f.layer} must be < {num_moe_layers} (the MoE layers: "
                              f"--num_layers - --first_k_dense_replace)"))
    return bad


def parse_all(specs: tuple) -> list[Fault]:
    """Every spec parsed (the config already validated them)."""
    return [parse_fault(t) for t in specs]
