"""Load traces: per-step logical expert loads for offline replay.

File format (``.npz``): ``loads`` int64 ``[steps, layers, experts]`` = tokens routed to each
logical expert of each MoE layer in each forward step; optional ``meta`` (a JSON string: how it
was generated); optional ``sources`` int64 ``[steps, layers, ranks, experts]`` = the same counts
split by the source rank that routed them (its sum over ranks is ``loads``; ``simulate
--eplb_replica_routing`` uses it, else it draws a seeded split). Dense layers are not part of a
trace.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from xllm_eplb.errors import InputFileError


@dataclass
class Trace:
    """``loads`` int64 ``[steps, layers, experts]``; ``meta`` free-form provenance; ``sources``
    None or int64 ``[steps, layers, ranks, experts]`` (see module doc)."""

    loads: np.ndarray
    meta: dict = field(default_factory=dict)
    sources: np.ndarray | None = None

    @property
    def steps(self) -> int:
        return int(self.loads.shape[0])

    @property
    def layers(self) -> int:
        return int(self.loads.shape[1])

    @property
    def experts(self) -> int:
        return int(self.loads.shape[2])

    def head(self, steps: int) -> "Trace":
        """The first ``steps`` steps (a view)."""
        src = None if self.sources is None else self.sources[:steps]
        return Trace(self.loads[:steps], dict(self.meta), src)


def check_loads(loads, where: str) -> np.ndarray:
    """Validate a load array -> int64 ``[steps, layers, experts]``; InputFileError names the
    file, the value and the rule."""
    a = np.asarray(loads)
    if a.ndim != 3 or 0 in a.shape:
        raise InputFileError(f"{where}: loads of shape {a.shape}, expected a non-empty "
                             f"[steps, layers, experts] array")
    if a.dtype.kind not in "iuf":
        raise InputFileError(f"{where}: loads of dtype {a.dtype}, expected integer token counts")
    if a.dtype.kind == "f":
        bad = ~np.isfinite(a)
        if bad.any():
            s, l_, e = np.argwhere(bad)[0]
            raise InputFileError(f"{where}: loads[{s}, {l_}, {e}] = {a[s, l_, e]}: counts must "
                                 f"be finite")
        if (a != np.round(a)).any():
            s, l_, e = np.argwhere(a != np.round(a))[0]
            raise InputFileError(f"{where}: loads[{s}, {l_}, {e}] = {a[s, l_, e]}: counts must "
                                 f"be whole numbers")
    if (a < 0).any():
        s, l_, e = np.argwhere(a < 0)[0]
        raise InputFileError(f"{where}: loads[{s}, {l_}, {e}] = {a[s, l_, e]}: counts must be "
                             f">= 0")
    return a.astype(np.int64, copy=False)


def load_trace(path: str | Path) -> Trace:
    """Read a ``.npz`` trace (see module docstring)."""
    p = Path(path)
    if not p.is_file():
        raise InputFileError(f"trace {p}: not found")
    try:
        with np.load(p, allow_pickle=False) as z:
            if "loads" not in z.files:
                raise InputFileError(f"trace {p}: no 'loads' array (has: "
                                     f"{', '.join(z.files) or 'nothing'})")
            loads = z["loads"]
            meta = json.loads(str(z["meta"])) if "meta" in z.files else {}
            src = z["sources"] if "sources" in z.files else None
    except InputFileError:
        raise
    except Exception as e:  # zip/npy/JSON errors all mean the same thing to the user
        raise InputFileError(f"trace {p}: cannot read as .npz: {e}") from None
    lg = check_loads(loads, f"trace {p}")
    return Trace(lg, meta, None if src is None else check_sources(src, lg, f"trace {p}"))


def check_sources(sources, loads: np.ndarray, where: str) -> np.ndarray:
    """Validate per-source counts against ``loads [steps, layers, experts]`` -> int64
    ``[steps, layers, ranks, experts]`` (InputFileError naming the file, the value and the
    rule)."""
    a = np.asarray(sources)
    st, la, ex = loads.shape
    if a.ndim != 4 or a.shape[:2] != (st, la) or a.shape[3] != ex or a.shape[2] < 1:
        raise InputFileError(f"{where}: sources of shape {a.shape}, expected [steps={st}, "
                             f"layers={la}, ranks, experts={ex}]")
    if a.dtype.kind not in "iu" or (a < 0).any():
        raise InputFileError(f"{where}: sources must be integer counts >= 0 (dtype {a.dtype})")
    bad = a.sum(axis=2) != loads
    if bad.any():
        s, l_, e = np.argwhere(bad)[0]
        raise InputFileError(f"{where}: sources[{s}, {l_}, :, {e}] sum to "
                             f"{int(a[s, l_, :, e].sum())} but loads[{s}, {l_}, {e}] = "
                             f"{int(loads[s, l_, e])}: they must match")
    return a.astype(np.int64, copy=False)


def write_trace(trace: Trace, file) -> None:
    """Write ``trace`` as a compressed ``.npz`` to a path or a binary file object."""
    extra = {} if trace.sources is None else {"sources": np.asarray(trace.sources, np.int64)}
    np.savez_compressed(file, loads=np.asarray(trace.loads, dtype=np.int64),
                        meta=np.array(json.dumps(trace.meta)), **extra)


def save_trace(trace: Trace, path: str | Path) -> Path:
    """Write ``trace`` as a compressed ``.npz``; returns the path."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    write_trace(trace, p)
    return p
