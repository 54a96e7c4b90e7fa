"""Expert-load recordings of other engines, as :class:`~xllm_eplb.eplb.loads.LoadFile`.

- TensorRT-LLM (``TLLM_EXPERT_STATISTIC_PATH``, read by its ``generate_eplb_config.py``): a
  folder with ``meta_info.json`` (``num_experts``, ...) and one ``rank*.safetensors`` per rank
  whose tensors are keyed ``"{iteration}_{layer}"`` (per-expert token counts; ``*_raw`` files are
  raw routings and are skipped). Counts are summed over ranks and iterations; layers are absolute
  decoder-layer indices of the MoE layers, which must be contiguous: the first one is the number
  of dense layers before them.
- SGLang dumps and plain tables are read by :func:`xllm_eplb.eplb.loads.read_loads`.
- vLLM writes no expert-load file (its window lives in GPU memory); not readable.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from xllm_eplb.eplb.loads import LoadFile, read_loads, to_matrix
from xllm_eplb.errors import InputFileError


def read_trtllm_statistics(folder: str | Path) -> LoadFile:
    """A TensorRT-LLM expert-statistic folder (module doc) -> loads [MoE layers, E] int64."""
    p = Path(folder)
    meta = p / "meta_info.json"
    if not meta.is_file():
        raise InputFileError(f"{p}: no meta_info.json (a TensorRT-LLM expert statistic folder "
                             f"has meta_info.json and rank*.safetensors)")
    try:
        num_e = int(json.loads(meta.read_text())["num_experts"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise InputFileError(f"{meta}: cannot read num_experts ({e})") from None
    files = sorted(f for f in p.glob("rank*.safetensors") if not f.name.endswith("_raw.safetensors"))
    if not files:
        raise InputFileError(f"{p}: no rank*.safetensors statistic files")
    from safetensors.numpy import load_file

    per_layer: dict[int, np.ndarray] = {}
    for f in files:
        try:
            tensors = load_file(str(f))
        except Exception as e:
            raise InputFileError(f"{f}: not a readable safetensors file ({e})") from None
        for key, data in tensors.items():
            try:
                _, layer = (int(x) for x in key.split("_"))
            except ValueError:
                raise InputFileError(f"{f}: key {key!r} is not 'iteration_layer'") from None
            if data.shape != (num_e,):
                raise InputFileError(f"{f}: {key} has shape {data.shape}, expected ({num_e},)")
            per_layer[layer] = per_layer.get(layer, 0) + data.astype(np.int64)
    layers = sorted(per_layer)
    if layers != list(range(layers[0], layers[0] + len(layers))):
        raise InputFileError(f"{p}: MoE layers {layers[:4]}... are not contiguous")
    a = to_matrix([per_layer[i].tolist() for i in layers], str(p)).astype(np.int64)
    return LoadFile(a, layers[0], str(p))


def read_any(path: str | Path, zero_ok: bool = False) -> LoadFile:
    """A TensorRT-LLM statistic folder, else a load file :func:`read_loads` reads (``zero_ok``:
    an all-zero table is kept whole)."""
    if Path(path).is_dir():
        return read_trtllm_statistics(path)
    return read_loads(path, zero_ok=zero_ok)
