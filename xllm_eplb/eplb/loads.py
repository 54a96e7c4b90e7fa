"""Read expert-load files: ``[layers][experts]`` token counts per logical expert.

Formats: an SGLang expert-distribution dump ``{"logical_count": [[...], ...]}`` (``.json``), a JSON
list of lists, or a 2-D ``.npy`` array. Leading all-zero rows before a loaded one are dense layers
(DeepSeek's first 3) and are dropped; the caller reports how many. A table whose every row is zero
is refused, or with ``zero_ok`` kept whole (MoE layers without load information). Errors name the
file and the problem.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from xllm_eplb.errors import InputFileError


@dataclass(frozen=True)
class LoadFile:
    """loads: [moe_layers, E], int64 when every value is integral, else float64;
    dense_skipped: leading all-zero rows removed; path: where it came from."""

    loads: np.ndarray
    dense_skipped: int
    path: str


def read_json(p: Path, where: str):
    """The JSON value in file ``p``; a file that cannot be read or parsed raises
    :class:`~xllm_eplb.errors.InputFileError` starting with ``where``."""
    try:
        return json.loads(p.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise InputFileError(f"{where}: cannot read ({e})") from None
    except json.JSONDecodeError as e:
        raise InputFileError(f"{where}: invalid JSON ({e.msg} at line {e.lineno})") from None


def _read_raw(p: Path):
    suffix = p.suffix.lower()
    if suffix == ".npy":
        try:
            return np.load(p, allow_pickle=False)
        except (ValueError, OSError) as e:
            raise InputFileError(f"{p}: not a readable .npy array ({e})") from None
    if suffix != ".json":
        raise InputFileError(f"{p}: unknown load-file type {suffix!r} (expected .json or .npy)")
    data = read_json(p, str(p))
    if isinstance(data, dict):
        if "logical_count" not in data:
            raise InputFileError(f"{p}: JSON object without a 'logical_count' key (SGLang dump "
                                 f"expected; keys: {sorted(data)[:5]})")
        data = data["logical_count"]
    return data


def to_matrix(data, where: str) -> np.ndarray:
    """Validate a [layers][experts] table of finite, non-negative numbers; returns a 2-D array."""
    if isinstance(data, list) and data and not all(isinstance(r, list) for r in data):
        raise InputFileError(f"{where}: expected a list of per-layer lists [layers][experts]")
    if isinstance(data, list) and len({len(r) for r in data}) > 1:
        lens = sorted({len(r) for r in data})
        raise InputFileError(f"{where}: layers have different expert counts {lens[:4]} "
                             f"(expected [layers][experts])")
    try:
        a = np.asarray(data, dtype=np.float64)
    except (TypeError, ValueError):
        raise InputFileError(f"{where}: loads must be numbers") from None
    if a.ndim != 2 or a.shape[0] == 0 or a.shape[1] == 0:
        raise InputFileError(f"{where}: loads of shape {a.shape} are not a non-empty "
                             f"[layers, experts] table")
    bad = ~np.isfinite(a)
    if bad.any():
        li, e = (int(x[0]) for x in np.nonzero(bad))
        raise InputFileError(f"{where}: load of layer {li} expert {e} is {a[li, e]} (must be finite)")
    if (a < 0).any():
        li, e = (int(x[0]) for x in np.nonzero(a < 0))
        raise InputFileError(f"{where}: load of layer {li} expert {e} is {a[li, e]:g} "
                             f"(must be >= 0)")
    return a


def read_loads(path: str | Path, skip_dense: bool = True, zero_ok: bool = False) -> LoadFile:
    """Read and validate a load file (see module doc). ``zero_ok``: a table whose every layer
    is zero is kept whole (``xllm-eplb plan``: even replica counts) instead of refused."""
    p = Path(path)
    if not p.is_file():
        raise InputFileError(f"{p}: load file not found")
    a = to_matrix(_read_raw(p), str(p))
    skipped = 0
    if skip_dense:
        nz = np.nonzero(a.any(axis=1))[0]
        if nz.size == 0 and not zero_ok:
            raise InputFileError(f"{p}: every layer has zero load (no MoE layer to plan)")
        # zero_ok and every layer zero: no dense layer can be told apart, so every row is a MoE
        # layer without load information (planned with even replica counts)
        skipped = int(nz[0]) if nz.size else 0
        a = a[skipped:]
    if (a == np.round(a)).all() and a.max() < 2.0 ** 53:
        a = a.astype(np.int64)
    return LoadFile(a, skipped, str(p))


def parse_layer_range(spec: str | None, num_layers: int) -> range:
    """``a:b`` (python-style, either end optional) over MoE layers -> range; None -> all."""
    if not spec:
        return range(num_layers)
    try:
        lo_s, hi_s = spec.split(":")
        lo = int(lo_s) if lo_s.strip() else 0
        hi = int(hi_s) if hi_s.strip() else num_layers
    except ValueError:
        raise InputFileError(f"--moe-layers={spec!r}: expected a:b (e.g. 0:58)") from None
    if not 0 <= lo < hi <= num_layers:
        raise InputFileError(f"--moe-layers={spec!r}: must satisfy 0 <= a < b <= {num_layers} "
                             f"(MoE layers in the load file)")
    return range(lo, hi)
