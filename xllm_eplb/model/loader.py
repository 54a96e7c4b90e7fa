"""Per-rank reading of a Hugging Face safetensors checkpoint.

:class:`CheckpointReader` indexes every tensor of ``folder`` (``model.safetensors.index.json``
when present, else the headers of every ``*.safetensors`` file), checking each header itself so
a corrupt file fails with one clear error. Tensors are read one at a time, on demand, with
``os.preadv`` straight into the tensor that keeps them (an expert's gate and up rows into the
halves of its ``w13``): a rank materialises only what it asks for, and its peak RSS holds no
memory-mapped file pages and no staging copies (``scripts/bench_memory.py``). ``reads`` records
every tensor (and ``name[e]`` expert slice of a fused tensor) read so far.

Key names (prefix ``model.layers.{i}.``) follow :mod:`spec`'s families; experts may be stored
per expert (``experts.{e}.gate_proj|up_proj|down_proj``, Mixtral ``w1|w3|w2``) or fused
(``experts.gate_up_proj [E, 2I, H]``, ``experts.down_proj [E, H, I]``; gpt_oss, always fused:
``gate_up_proj [E, H, 2I]`` with interleaved gate/up columns and ``down_proj [E, I, H]``, plus
their ``_bias`` tensors, rearranged into the store's layout at load).
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import torch

from xllm_eplb.config import Config
from xllm_eplb.errors import InputFileError
from xllm_eplb.model import fp8, mxfp4
from xllm_eplb.model.spec import ModelSpec

ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
             "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
             fp8.ST_FP8: fp8.FP8, mxfp4.ST_U8: torch.uint8}
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
              and all(isinstance(d, int) and d >= 0 for d in t["shape"])
              and isinstance(t.get("data_offsets"), list) and len(t["data_offsets"]) == 2
              and 8 + n + int(t["data_offsets"][1]) <= size
              and int(t["data_offsets"][1]) - int(t["data_offsets"][0])
              == math.prod(t["shape"]) * ST_DTYPES[t["dtype"]].itemsize)
        if not ok:
            raise InputFileError(f"{path}: corrupt safetensors header entry for tensor {name!r} "
                                 f"(dtype in {sorted(ST_DTYPES)}, shape, data_offsets inside "
                                 f"the file and as long as the shape's bytes)")
    return hdr


class CheckpointReader:
    """Index + lazy positioned reads (``os.preadv``) of a checkpoint folder's tensors.

    ``quant``: the checkpoint's FP8 format (``ModelSpec.quant``). Its fp8 tensors are paired
    with their scales at construction (headers only, :func:`fp8.check_pairing`); :meth:`get`
    of an fp8 tensor as another dtype dequantizes it with its scale (the non-expert weights),
    as fp8 it reads the raw bytes (expert slots)."""

    def __init__(self, folder: str | Path, quant: fp8.Fp8Format | None = None):
        self.folder = Path(folder)
        self.quant = quant
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
        self.offset: dict[str, int] = {}        # name -> absolute byte offset of its data
        for path in files:
            with open(path, "rb") as f:
                data_start = 8 + struct.unpack("<Q", f.read(8))[0]
            for name, t in read_header(path).items():
                self.meta[name] = (path, t["dtype"], tuple(int(s) for s in t["shape"]))
                self.offset[name] = data_start + int(t["data_offsets"][0])
        self.reads: list[str] = []
        self.fp8_weights = fp8.check_pairing(self.meta, quant, self.folder)

    def has(self, name: str) -> bool:
        return name in self.meta

    def _pread(self, name: str, out: torch.Tensor, at: int) -> None:
        """Fill contiguous ``out`` (the file's dtype) with its bytes from offset ``at``."""
        path = self.meta[name][0]
        view = memoryview(out.reshape(-1).view(torch.uint8).numpy())
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            raise InputFileError(f"{path}: cannot read ({exc.strerror or exc})") from None
        try:
            done = 0
            while done < len(view):
                n = os.preadv(fd, [view[done:]], at + done)
                if n <= 0:
                    raise InputFileError(f"{path}: tensor {name!r} is cut short (the file ends "
                                         f"before its data_offsets)")
                done += n
        finally:
            os.close(fd)

    def _read(self, name: str, shape: tuple, at: int, dtype: torch.dtype,
              out: torch.Tensor | None) -> torch.Tensor:
        """``shape`` elements of ``name`` from byte ``at``, as ``dtype``; into ``out`` if given
        (no copy when the file already holds ``dtype``)."""
        src = ST_DTYPES[self.meta[name][1]]
        if out is None:
            out = torch.empty(shape, dtype=dtype)
        buf = out if src == dtype and out.is_contiguous() else torch.empty(shape, dtype=src)
        self._pread(name, buf, at)
        if buf is not out:
            out.copy_(buf)
        return out

    def _check(self, name: str, shape: tuple | None) -> tuple[Path, tuple]:
        if name not in self.meta:
            raise InputFileError(f"{self.folder}: missing tensor {name!r} (the config.json "
                                 f"architecture needs it)")
        path, _, got = self.meta[name]
        if shape is not None and tuple(got) != tuple(shape):
            raise InputFileError(f"{path}: tensor {name!r} has shape {list(got)}, config.json "
                                 f"needs {list(shape)}")
        return path, got

    def get(self, name: str, shape: tuple | None, dtype: torch.dtype,
            out: torch.Tensor | None = None) -> torch.Tensor:
        """One whole tensor, checked against ``shape``, cast to ``dtype`` (written into
        ``out``, a tensor of that shape, when given)."""
        path, got = self._check(name, shape)
        if self.meta[name][1] == fp8.ST_FP8 and dtype != fp8.FP8:
            return self._dequantized(name, got, dtype, out)
        self.reads.append(name)
        return self._read(name, got, self.offset[name], dtype, out)

    def get_scale(self, weight: str, shape: tuple, out: torch.Tensor | None = None) -> torch.Tensor:
        """The float32 scale grid of fp8 tensor ``weight`` [R, C] (into ``out`` when given),
        checked finite and > 0."""
        name = fp8.scale_name(weight)
        s = self.get(name, fp8.grid(shape, self.quant.block), torch.float32, out=out)
        fp8.check_values(name, self.meta[name][0], s)
        return s

    def _dequantized(self, name: str, shape: tuple, dtype: torch.dtype,
                     out: torch.Tensor | None) -> torch.Tensor:
        q = self.get(name, shape, fp8.FP8)
        return fp8.dequantize(q, self.get_scale(name, shape), self.quant.block, dtype, out=out)

    def check_scales(self) -> None:
        """Read every scale of the checkpoint and check its values (finite, > 0): what
        ``serve`` runs before it starts anything (scales are ~0.02 % of an FP8 file)."""
        for n in self.fp8_weights:
            self.get_scale(n, self.meta[n][2])

    def get_row(self, name: str, row: int, shape: tuple, dtype: torch.dtype,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """``name[row]`` of a stacked tensor (``shape`` is the whole tensor's), reading only
        that row's bytes (into ``out`` when given)."""
        _, got = self._check(name, shape)
        if self.meta[name][1] == fp8.ST_FP8:
            raise InputFileError(f"{self.meta[name][0]}: tensor {name!r} is a fused {fp8.ST_FP8} "
                                 f"expert tensor; FP8 experts are read per expert "
                                 f"(experts.{{e}}.gate_proj|up_proj|down_proj + weight_scale_inv)")
        if not 0 <= row < got[0]:
            raise IndexError(f"{name}: row {row} of {got[0]}")
        self.reads.append(f"{name}[{row}]")
        row_elems = math.prod(got[1:])
        at = self.offset[name] + row * row_elems * ST_DTYPES[self.meta[name][1]].itemsize
        return self._read(name, got[1:], at, dtype, out)

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
                   dtype: torch.dtype, out: dict | None = None) -> dict[str, torch.Tensor]:
    """Expert ``e`` of decoder layer ``i``: ``w13`` [2I, H] (gate rows then up rows), ``w2``
    [H, I], read from either layout; into ``out`` (tensors of those shapes, e.g. the slot that
    keeps them: no temporary copy of the expert) when given."""
    H, inter, E = spec.hidden_size, spec.moe_intermediate_size, spec.num_experts
    pre = moe_prefix(spec, reader, i) + "experts."
    out = out or {}
    if spec.mxfp4:
        return _mxfp4_expert(reader, pre, e, (E, H, inter), dtype, out)
    if spec.family == "gpt_oss":
        return _gpt_oss_expert(reader, pre, e, (E, H, inter), dtype, out)
    if fused_experts(spec, reader, i):
        return {"w13": reader.get_row(pre + "gate_up_proj", e, (E, 2 * inter, H), dtype,
                                      out=out.get("w13")),
                "w2": reader.get_row(pre + "down_proj", e, (E, H, inter), dtype,
                                     out=out.get("w2"))}
    names = expert_names(spec)
    if "w13_q" in out:
        return _fp8_expert(reader, f"{pre}{e}.", names, (H, inter), out)
    w13 = out.get("w13")
    if w13 is None:
        w13 = torch.empty((2 * inter, H), dtype=dtype)    # gate and up read into its halves
    reader.get(f"{pre}{e}.{names[0]}.weight", (inter, H), dtype, out=w13[:inter])
    reader.get(f"{pre}{e}.{names[1]}.weight", (inter, H), dtype, out=w13[inter:])
    d = reader.get(f"{pre}{e}.{names[2]}.weight", (H, inter), dtype, out=out.get("w2"))
    return {"w13": w13, "w2": d}


GPT_OSS_EXPERTS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


def _gpt_oss_shapes(E: int, H: int, inter: int) -> dict[str, tuple[int, ...]]:
    """gpt_oss's fused expert tensors (``x @ W`` layout, gate and up columns interleaved)."""
    return dict(zip(GPT_OSS_EXPERTS, ((E, H, 2 * inter), (E, 2 * inter), (E, inter, H), (E, H)),
                    strict=True))


def _gpt_oss_expert(reader: CheckpointReader, pre: str, e: int, dims: tuple, dtype: torch.dtype,
                    out: dict) -> dict:
    """Row ``e`` of gpt_oss's fused experts into the store's layout: ``gate_up_proj[e]``
    [H, 2I] (gate = columns 0::2, up = 1::2) -> ``w13`` [2I, H] (gate rows, then up rows),
    its bias -> ``b13`` [2I] likewise, ``down_proj[e]`` [I, H] -> ``w2`` [H, I], ``b2`` [H]."""
    E, H, inter = dims
    shapes = _gpt_oss_shapes(E, H, inter)
    gu, gub, dn, db = (reader.get_row(pre + n, e, shapes[n], dtype) for n in GPT_OSS_EXPERTS)
    w13 = out.get("w13", torch.empty((2 * inter, H), dtype=dtype))
    w13[:inter].copy_(gu[:, 0::2].t())
    w13[inter:].copy_(gu[:, 1::2].t())
    b13 = out.get("b13", torch.empty(2 * inter, dtype=dtype))
    b13[:inter].copy_(gub[0::2])
    b13[inter:].copy_(gub[1::2])
    w2 = out.get("w2", torch.empty((H, inter), dtype=dtype))
    w2.copy_(dn.t())
    b2 = out.get("b2", torch.empty(H, dtype=dtype))
    b2.copy_(db)
    return {"w13": w13, "w2": w2, "b13": b13, "b2": b2}


def _mxfp4_shapes(E: int, H: int, inter: int) -> dict[str, tuple[int, ...]]:
    """gpt_oss's MXFP4 expert tensors (:mod:`mxfp4`) and the bf16 biases."""
    G, g = H // mxfp4.BLOCK, inter // mxfp4.BLOCK
    return {"gate_up_proj_blocks": (E, 2 * inter, G, 16), "gate_up_proj_scales": (E, 2 * inter, G),
            "down_proj_blocks": (E, H, g, 16), "down_proj_scales": (E, H, g),
            "gate_up_proj_bias": (E, 2 * inter), "down_proj_bias": (E, H)}


def _mxfp4_expert(reader: CheckpointReader, pre: str, e: int, dims: tuple, dtype: torch.dtype,
                  out: dict) -> dict:
    """Row ``e`` of gpt_oss's MXFP4 experts into an :class:`~expert_store.Mxfp4Slots` slot,
    as stored (no dequantization): the gate_up rows de-interleaved (gate rows 0::2, then up
    rows 1::2) with their scales; ``down_proj`` blocks and scales as they are; the biases as
    in :func:`_gpt_oss_expert`."""
    E, H, inter = dims
    shapes = _mxfp4_shapes(E, H, inter)
    u8 = torch.uint8
    gb, gs, db, ds = (reader.get_row(pre + n, e, shapes[n], u8) for n in mxfp4.EXPERT_TENSORS)
    gub = reader.get_row(pre + "gate_up_proj_bias", e, shapes["gate_up_proj_bias"], dtype)
    dnb = reader.get_row(pre + "down_proj_bias", e, shapes["down_proj_bias"], dtype)
    res = {"w13_b": out.get("w13_b", torch.empty_like(gb)),
           "w13_e": out.get("w13_e", torch.empty_like(gs)),
           "w2_b": out.get("w2_b", torch.empty_like(db)),
           "w2_e": out.get("w2_e", torch.empty_like(ds)),
           "b13": out.get("b13", torch.empty_like(gub)), "b2": out.get("b2", torch.empty_like(dnb))}
    for name, src in (("w13_b", gb), ("w13_e", gs), ("b13", gub)):
        res[name][:inter].copy_(src[0::2])
        res[name][inter:].copy_(src[1::2])
    res["w2_b"].copy_(db)
    res["w2_e"].copy_(ds)
    res["b2"].copy_(dnb)
    return res


def expert_names(spec: ModelSpec) -> tuple[str, str, str]:
    """Per-expert projection names: gate, up, down."""
    return ("w1", "w3", "w2") if spec.family == "mixtral" else ("gate_proj", "up_proj",
                                                                 "down_proj")


def _fp8_expert(reader: CheckpointReader, pre: str, names: tuple, dims: tuple,
                out: dict) -> dict:
    """An FP8 expert's bytes and float32 scales straight into its slot tensors ``out``:
    ``w13_q`` [2I, H] (gate rows, up rows), ``w13_s`` [2, gI, gH] (gate grid, up grid),
    ``w2_q`` [H, I], ``w2_s`` [gH', gI']."""
    H, inter = dims
    for j, half in enumerate((slice(0, inter), slice(inter, 2 * inter))):
        w = f"{pre}{names[j]}.weight"
        reader.get(w, (inter, H), fp8.FP8, out=out["w13_q"][half])
        reader.get_scale(w, (inter, H), out=out["w13_s"][j])
    w = f"{pre}{names[2]}.weight"
    reader.get(w, (H, inter), fp8.FP8, out=out["w2_q"])
    reader.get_scale(w, (H, inter), out=out["w2_s"])
    return out


def experts_fp8(spec: ModelSpec, reader: CheckpointReader) -> bool:
    """Whether the routed experts are FP8 (all of them, or an error: a checkpoint whose
    experts mix fp8 and plain weights is refused)."""
    if not reader.fp8_weights:
        return False
    kinds = set()
    for i in spec.moe_layers:
        pre = moe_prefix(spec, reader, i) + "experts."
        if fused_experts(spec, reader, i):
            kinds.add(reader.meta[pre + "gate_up_proj"][1] == fp8.ST_FP8)
            continue
        for e in range(spec.num_experts):
            for n in expert_names(spec):
                name = f"{pre}{e}.{n}.weight"
                if name in reader.meta:
                    kinds.add(reader.meta[name][1] == fp8.ST_FP8)
    if len(kinds) > 1:
        raise InputFileError(f"{reader.folder}: some routed expert weights are {fp8.ST_FP8} and "
                             f"some are not; an FP8 checkpoint quantizes every routed expert")
    return kinds == {True}


def check_experts(spec: ModelSpec, reader: CheckpointReader) -> None:
    """Every expert tensor of every MoE layer exists with its shape (headers only)."""
    H, inter, E = spec.hidden_size, spec.moe_intermediate_size, spec.num_experts
    for i in spec.moe_layers:
        pre = moe_prefix(spec, reader, i) + "experts."
        if spec.family == "gpt_oss":
            shapes = _mxfp4_shapes(E, H, inter) if spec.mxfp4 else _gpt_oss_shapes(E, H, inter)
            for n, shape in shapes.items():
                reader.check_shape(pre + n, shape)
            continue
        if fused_experts(spec, reader, i):
            reader.check_shape(pre + "gate_up_proj", (E, 2 * inter, H))
            reader.check_shape(pre + "down_proj", (E, H, inter))
            continue
        names = expert_names(spec)
        for e in range(E):
            reader.check_shape(f"{pre}{e}.{names[0]}.weight", (inter, H))
            reader.check_shape(f"{pre}{e}.{names[1]}.weight", (inter, H))
            reader.check_shape(f"{pre}{e}.{names[2]}.weight", (H, inter))
