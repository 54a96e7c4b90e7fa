"""The flag schema derived from the sections' metadata (:data:`FIELDS`: name ->
:class:`FieldSpec`), value formatting and lookup, and the policy-kind names."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from xllm_eplb.config.fields import (
    Config,
    EplbConfig,
    FaultConfig,
    ModelConfig,
    RuntimeConfig,
    ServeConfig,
)

log = logging.getLogger(__name__)

# --- schema helpers -------------------------------------------------------------------------

SECTIONS: dict[str, type] = {"eplb": EplbConfig, "model": ModelConfig,
                             "runtime": RuntimeConfig, "serve": ServeConfig,
                             "faults": FaultConfig}


@dataclass(frozen=True)
class FieldSpec:
    """One flag: its section, Python type name (``bool``/``int``/``float``/``str``/``tuple``: a
    repeatable flag, one string per occurrence) and metadata."""

    name: str
    section: str
    type: str
    default: Any
    help: str
    unit: str = ""
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    choices: tuple | None = None
    required: bool = False

    def rule(self) -> str:
        """The constraint in words, e.g. ``in [0, 1]``, ``> 1``, ``one of -1, 0, 1, 2``."""
        if self.choices is not None:
            return "one of " + ", ".join(format_value(c) for c in self.choices)
        lo, hi = self.lo, self.hi
        if lo is not None and hi is not None:
            return (f"in {'(' if self.lo_open else '['}{format_value(lo)}, "
                    f"{format_value(hi)}{')' if self.hi_open else ']'}")
        if lo is not None:
            return f"{'>' if self.lo_open else '>='} {format_value(lo)}"
        if hi is not None:
            return f"{'<' if self.hi_open else '<='} {format_value(hi)}"
        return ""


def _build_fields() -> dict[str, FieldSpec]:
    out: dict[str, FieldSpec] = {}
    for sec, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            m = f.metadata
            assert f.name not in out, f"flag name {f.name} defined twice"
            out[f.name] = FieldSpec(
                name=f.name, section=sec, type=str(f.type).split("|")[0].strip(),
                default=f.default, help=m["help"], unit=m["unit"], lo=m["lo"], hi=m["hi"],
                lo_open=m["lo_open"], hi_open=m["hi_open"], choices=m["choices"],
                required=m["required"])
    return out


#: every flag, in section order: name -> FieldSpec
FIELDS: dict[str, FieldSpec] = _build_fields()


def format_value(v: Any) -> str:
    """Render a value the way a flag would be written: ``true``, ``0.05``, ``16``, ``""``."""
    if v is None:
        return "none"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, tuple):
        return "[" + "; ".join(format_value(x) for x in v) + "]"
    if isinstance(v, float):
        # NOTE: int(inf) / int(nan) raise: a YAML `.inf` must reach the field's rule check
        return f"{v:g}" if abs(v) < 1e15 and v == int(v) else repr(v)
    s = str(v)
    return s if s else '""'


def get_value(cfg: Config, name: str) -> Any:
    """The resolved value of flag ``name`` in ``cfg``."""
    return getattr(getattr(cfg, FIELDS[name].section), name)


def as_flat_dict(cfg: Config, *, redact: bool = False) -> dict[str, Any]:
    """``{flag name: value}`` for every field, in section order; ``redact``: a set secret
    (:data:`SECRETS`, e.g. ``api_key``) shows as ``<set>`` (what logs and ``config show`` print)."""
    return {name: "<set>" if redact and name in SECRETS and get_value(cfg, name)
            else get_value(cfg, name) for name in FIELDS}


#: fields never printed as they are (logs, ``config show``)
SECRETS = ("api_key",)


# --- policy kind ----------------------------------------------------------------------------

#: policies the registry implements
POLICY_KINDS = ("balanced", "greedy", "incremental", "node_aware")
#: historical xLLM names, all aliases of ``balanced``
LEGACY_POLICY_KINDS = ("flat", "deepseek_flat", "deepseek-flat", "deepseek_hier",
                       "deepseek-hier", "hier", "hierarchical")
_warned_kinds: set[str] = set()


def known_policy_kind(s: str) -> bool:
    """A policy kind :func:`normalize_policy_kind` maps without its fallback (a policy or a
    legacy name, any case): what config validation accepts (anything else is exit 2)."""
    k = str(s).strip().lower()
    return k in POLICY_KINDS or k in LEGACY_POLICY_KINDS


def normalize_policy_kind(s: str) -> str:
    """Case-insensitive policy name -> one of :data:`POLICY_KINDS`.

    Legacy names map to ``balanced``; anything else (typos, "") becomes ``greedy`` with one
    warning per distinct value per process, as xLLM does (never an error).
    """
    k = str(s).strip().lower()
    if k in POLICY_KINDS:
        return k
    if k in LEGACY_POLICY_KINDS:
        return "balanced"
    if k not in _warned_kinds:
        _warned_kinds.add(k)
        log.warning("EPLB config unknown_policy_kind=%r fallback=greedy valid=%s", s,
                    ",".join(POLICY_KINDS))
    return "greedy"
