"""Per-rank reading of a Hugging Face safetensors checkpoint.

:class:`CheckpointReader` indexes every tensor of ``folder`` (``model.safetensors.index.json``
when present, else the headers of every ``*.safetensors`` file), checking each header itself so
a corrupt file fails with one clear error. Tensors are read through ``safetensors.safe_open``
(memory-mapped) one at a time, on demand: a rank materialises only what it asks for. ``reads``
records every tensor (and ``name[e]`` expert slice of a fused tensor) read so far.

Key names (prefix ``model.layers.{i}.``) follow :mod:`spec`'s families; experts may be stored
per expert (``experts.{e}.gate_proj|up_proj|down_proj``, Mixtral ``w1|w3|w2``) or fused
(``experts.gate_up_proj [E, 2I, H]``, ``experts.down_proj [E, H, I]``).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

from xllm_eplb.config import Config
from xllm_eplb.errors import InputFileError
from xllm_eplb.model.spec import ModelSpec

ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
             "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32}
INDEX = "model.safetensors.index.json"
MAX_HEADER = 100 << 20
TORCH_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
                "float16": torch.float16, "auto": torch.float32}


def torch_dtype(cfg: Config) -> torch.dtype:
    """``cfg.model.dtype`` as a torch dtype (``auto`` unresolved: float32)."""
    return TORCH_DTYPES[cfg.model.dtype]


def read_header(path: Path) -> dict:
    """The JSON header of one safetensors file (validated): name -> {dtype, shape, ...}."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ValueError("shorter than the 8-byte header length")
            (n,) = struct.unpack("<Q", raw)
            if n > MAX_HEADER:
                raise ValueError(f"header length {n} is implausible")
            hdr = json.loads(f.read(n))
            size = path.stat().st_size
    except OSError as exc:
        raise InputFileError(f"{path}: cannot read ({exc.strerror or exc})") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise InputFileError(f"{path}: corrupt safetensors header ({exc}); the file must start "
                             f"with a little-endian u64 length and a JSON header") from None
    if not isinstance(hdr, dict):
        raise InputFileError(f"{path}: corrupt safetensors header (not a JSON object)")
    hdr.pop("__metadata__", None)
    for name, t in hdr.items():
        ok = (isinstance(t, dict) and t.get("dtype") in ST_DTYPES and isinstance(t.get("shape"), list)
              and isinstance(t.get("data_offsets"), list) and len(t["data_offsets"]) == 2
              and 8 + n + int(t["data_offsets"][1]) <= size)
        if not ok:
            raise InputFileError(f"{path}: corrupt safetensors header entry for tensor {name!r} "
                                 f"(dtype in {sorted(ST_DTYPES)}, shape, data_offsets inside "
                                 f"the file)")
    return hdr


class CheckpointReader:
    """Index + lazy, memory-mapped reads of a checkpoint folder's tensors."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        files = sorted(self.folder.glob("*.safetensors"))
        index = self.folder / INDEX
        wanted = None
        if index.is_file():
            try:
                wm = json.loads(index.read_text())["weight_map"]
                wanted = sorted(set(wm.values()))
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise InputFileError(f"{index}: cannot read its weight_map ({exc})") from None
            for fn in wanted:
                if not (self.folder / fn).is_file():
                    raise InputFileError(f"{index}: names file {fn!r}, which is missing")
            files = [self.folder / fn for fn in wanted]
        if not files:
            raise InputFileError(f"{self.folder}: no *.safetensors file (a checkpoint folder "
                                 f"needs its weights in safetensors format)")
        self.meta: dict[str, tuple[Path, str, tuple[int, ...]]] = {}
        for path in files:
            for name, t in read_header(path).items():
                self.meta[name] = (path, t["dtype"], tuple(int(s) for s in t["shape"]))
        self.reads: list[str] = []
        self._open: dict[Path, object] = {}

    def has(self, name: str) -> bool:
        return name in self.meta

    def _handle(self, path: Path):
        from safetensors import safe_open

        if path not in self._open:
            try:
                self._open[path] = safe_open(str(path), framework="pt")
            except Exception as exc:  # noqa: BLE001 - any unreadable file is the user's input
                raise InputFileError(f"{path}: cannot open as safetensors ({exc})") from None
        return self._open[path]

    def _check(self, name: str, shape: tuple | None) -> tuple[Path, tuple]:
        if name not in self.meta:
            raise InputFileError(f"{self.folder}: missing tensor {name!r} (the config.json "
                                 f"architecture needs it)")
        path, _, got = self.meta[name]
        if shape is not None and tuple(got) != tuple(shape):
            raise InputFileError(f"{path}: tensor {name!r} has shape {list(got)}, config.json "
                                 f"needs {list(shape)}")
        return path, got

    def get(self, name: str, shape: tuple | None, dtype: torch.dtype) -> torch.Tensor:
        """One whole tensor, checked against ``shape``, cast to ``dtype``."""
        path, _ = self._check(name, shape)
        self.reads.append(name)
        return self._handle(path).get_tensor(name).to(dtype).contiguous()

    def get_row(self, name: str, row: int, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """``name[row]`` of a stacked tensor (``shape`` is the whole tensor's), reading only
        that row's bytes."""
        path, _ = self._check(name, shape)
        self.reads.append(f"{name}[{row}]")
        return self._handle(path).get_slice(name)[row].to(dtype).contiguous()

    def check_shape(self, name: str, shape: tuple) -> None:
        self._check(name, shape)


# ---- family key names ------------------------------------------------------------------------

def moe_prefix(spec: ModelSpec, reader: CheckpointReader, i: int) -> str:
    """The MoE block's key prefix of decoder layer i (Mixtral: ``block_sparse_moe`` on disk,
    ``mlp`` in transformers' own fused format)."""
    base = f"model.layers.{i}."
    if spec.family == "mixtral" and reader.has(base + "block_sparse_moe.gate.weight"):
        return base + "block_sparse_moe."
    return base + "mlp."


def fused_experts(spec: ModelSpec, reader: CheckpointReader, i: int) -> bool:
    return reader.has(moe_prefix(spec, reader, i) + "experts.gate_up_proj")


def expert_weights(spec: ModelSpec, reader: CheckpointReader, i: int, e: int,
                   dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Expert ``e`` of decoder layer ``i``: ``w13`` [2I, H] (gate rows then up rows), ``w2``
    [H, I], read from either layout."""
    H, inter, E = spec.hidden_size, spec.moe_intermediate_size, spec.num_experts
    pre = moe_prefix(spec, reader, i) + "experts."
    if fused_experts(spec, reader, i):
        return {"w13": reader.get_row(pre + "gate_up_proj", e, (E, 2 * inter, H), dtype),
                "w2": reader.get_row(pre + "down_proj", e, (E, H, inter), dtype)}
    names = ("w1", "w3", "w2") if spec.family == "mixtral" else ("gate_proj", "up_proj",
                                                                  "down_proj")
    g = reader.get(f"{pre}{e}.{names[0]}.weight", (inter, H), dtype)
    u = reader.get(f"{pre}{e}.{names[1]}.weight", (inter, H), dtype)
    d = reader.get(f"{pre}{e}.{names[2]}.weight", (H, inter), dtype)
    return {"w13": torch.cat([g, u], dim=0), "w2": d}


def check_experts(spec: ModelSpec, reader: CheckpointReader) -> None:
    """Every expert tensor of every MoE layer exists with its shape (headers only)."""
    H, inter, E = spec.hidden_size, spec.moe_intermediate_size, spec.num_experts
    for i in spec.moe_layers:
        pre = moe_prefix(spec, reader, i) + "experts."
        if fused_experts(spec, reader, i):
            reader.check_shape(pre + "gate_up_proj", (E, 2 * inter, H))
            reader.check_shape(pre + "down_proj", (E, H, inter))
            continue
        names = ("w1", "w3", "w2") if spec.family == "mixtral" else ("gate_proj", "up_proj",
                                                                      "down_proj")
        for e in range(E):
            reader.check_shape(f"{pre}{e}.{names[0]}.weight", (inter, H))
            reader.check_shape(f"{pre}{e}.{names[1]}.weight", (inter, H))
            reader.check_shape(f"{pre}{e}.{names[2]}.weight", (H, inter))
