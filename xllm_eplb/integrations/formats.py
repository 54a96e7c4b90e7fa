"""Placement files other engines read as they are (``xllm-eplb plan --format``), and checkers
that read them back by each engine's documented rules.

A plan covers MoE layers ``[first, stop)`` of a load file whose first ``dense`` rows were dense
(all-zero) layers; ``layers_total`` = dense + MoE layers of the file (the model's decoder layers).

- ``native``: this project's plan JSON (``serve --eplb_init_placement``), written by the plan
  command itself;
- ``sglang``: ``--init-expert-location FILE.json``: ``{"physical_to_logical_map": [L][P]}`` over
  every decoder layer (SGLang's ``num_hidden_layers``, dense layers included: they get SGLang's
  trivial map ``arange(P) % E``, as do MoE layers outside the planned range). SGLang passes the
  object's keys to ``init_by_mapping`` as keyword arguments, so it holds no other key;
- ``vllm-ascend``: ``expert_map_path`` JSON: ``{"moe_layer_count": M, "layer_list": [{"layer_id",
  "device_count", "device_list": [{"device_id", "device_expert": [S ids]}]}]}`` over the MoE
  layers (planned rows, the previous/initial table elsewhere); every layer holds every expert and
  no device an expert twice;
- ``trtllm``: the MoE load balancer YAML ``{num_slots: R, initial_global_assignments: {decoder
  layer index: [R ids]}, layer_updates_per_iter: 0}`` (static): keys are absolute decoder-layer
  indices (``dense + MoE index``), one per MoE layer, each list ``num_slots`` long holding every
  expert; ``num_slots`` divisible by the EP size.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

FORMATS = ("native", "sglang", "vllm-ascend", "trtllm")
SUFFIX = {"native": ".json", "sglang": ".json", "vllm-ascend": ".json", "trtllm": ".yaml"}


class FormatError(ValueError):
    """A placement file that breaks its engine's rules; the message names the file and rule."""


def full_table(table: np.ndarray, fill: np.ndarray, first: int) -> np.ndarray:
    """The MoE rows of ``fill`` [M, R] with ``table`` [L, R] written at ``first``."""
    out = np.array(fill, dtype=np.int64, copy=True)
    out[first:first + table.shape[0]] = table
    return out


def render(fmt: str, table: np.ndarray, *, num_logical: int, dense: int, first: int,
           moe_fill: np.ndarray) -> str:
    """The file text of ``fmt`` (not native) for planned rows ``table`` [L, R] at MoE layer
    ``first``; ``moe_fill`` [M, R] holds every MoE layer's table where nothing is planned."""
    moe = full_table(table, moe_fill, first)
    nslots = moe.shape[1]
    if fmt == "sglang":
        trivial = np.tile(np.arange(nslots) % num_logical, (dense, 1))
        rows = np.concatenate([trivial, moe]).tolist()
        return json.dumps({"physical_to_logical_map": rows}) + "\n"
    if fmt == "vllm-ascend":
        raise ValueError("vllm-ascend needs the EP size: use render_ascend")
    if fmt == "trtllm":
        lines = [f"num_slots: {nslots}", "initial_global_assignments:"]
        lines += [f"  {dense + i}: [{', '.join(str(int(x)) for x in row)}]"
                  for i, row in enumerate(moe)]
        lines.append("layer_updates_per_iter: 0")
        return "\n".join(lines) + "\n"
    raise ValueError(f"format {fmt!r}: one of {', '.join(FORMATS)}")


def render_ascend(table: np.ndarray, ep_size: int, *, first: int, moe_fill: np.ndarray) -> str:
    moe = full_table(table, moe_fill, first).reshape(moe_fill.shape[0], ep_size, -1)
    layers = [{"layer_id": i, "device_count": ep_size,
               "device_list": [{"device_id": d, "device_expert": row.tolist()}
                               for d, row in enumerate(devs)]}
              for i, devs in enumerate(moe)]
    return json.dumps({"moe_layer_count": len(layers), "layer_list": layers}) + "\n"


# --- read-back checkers -----------------------------------------------------------------------

def _fail(path, msg):
    raise FormatError(f"{path}: {msg}")


def _int_table(rows, path, what: str, width: int | None = None) -> np.ndarray:
    if not isinstance(rows, list) or not rows or not all(isinstance(r, list) for r in rows):
        _fail(path, f"{what} must be a non-empty list of lists")
    if len({len(r) for r in rows}) != 1 or (width is not None and len(rows[0]) != width):
        _fail(path, f"{what} rows differ in length or are not {width} long")
    if not all(isinstance(x, int) and not isinstance(x, bool) for r in rows for x in r):
        _fail(path, f"{what} holds a non-integer id")
    return np.asarray(rows, dtype=np.int64)


def _every_expert(row: np.ndarray, num_logical: int, path, where: str) -> None:
    if row.min() < 0 or row.max() >= num_logical:
        _fail(path, f"{where}: expert id outside [0, {num_logical})")
    missing = np.setdiff1d(np.arange(num_logical), row)
    if missing.size:
        _fail(path, f"{where}: expert {int(missing[0])} has no slot ({missing.size} missing)")


def check_sglang(path, *, num_layers: int, num_physical: int, num_logical: int, ep_size: int,
                 dense: int) -> np.ndarray:
    """SGLang's rules for ``--init-expert-location``: a JSON object whose only key is
    ``physical_to_logical_map`` (its keys become ``init_by_mapping`` keyword arguments), [L][P]
    integers with L = the model's decoder layers and P = its physical experts (a multiple of the
    EP size), ids in range, every expert on every MoE layer. -> int64 [L, P]."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or set(data) != {"physical_to_logical_map"}:
        _fail(path, "must be a JSON object with the single key 'physical_to_logical_map'")
    if num_physical % ep_size:
        _fail(path, f"{num_physical} physical experts not divisible by ep_size={ep_size}")
    t = _int_table(data["physical_to_logical_map"], path, "physical_to_logical_map",
                   num_physical)
    if t.shape[0] != num_layers:
        _fail(path, f"{t.shape[0]} layers, the model has {num_layers} decoder layers")
    for i in range(num_layers):
        if i >= dense:
            _every_expert(t[i], num_logical, path, f"layer {i}")
        elif t[i].min() < 0 or t[i].max() >= num_logical:
            _fail(path, f"layer {i}: expert id outside [0, {num_logical})")
    return t


def check_vllm_ascend(path, *, num_moe_layers: int, ep_size: int, num_logical: int) -> np.ndarray:
    """vllm-ascend's rules for ``expert_map_path``: ``moe_layer_count`` = the MoE layers =
    len(layer_list), each layer's ``device_count`` = len(device_list) = the EP size, equal-length
    ``device_expert`` lists (one tensor), every expert on every layer, no expert twice on one
    device. -> int64 [M, D, S]."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or not {"moe_layer_count", "layer_list"} <= set(data):
        _fail(path, "must be a JSON object with 'moe_layer_count' and 'layer_list'")
    layers = data["layer_list"]
    if data["moe_layer_count"] != num_moe_layers or len(layers) != num_moe_layers:
        _fail(path, f"moe_layer_count={data['moe_layer_count']} with {len(layers)} layers: "
                    f"the model has {num_moe_layers} MoE layers")
    out = []
    for i, lay in enumerate(layers):
        devs = lay.get("device_list", [])
        if lay.get("device_count") != len(devs) or len(devs) != ep_size:
            _fail(path, f"layer {i}: device_count={lay.get('device_count')} with {len(devs)} "
                        f"devices, ep_size={ep_size}")
        t = _int_table([d.get("device_expert") for d in devs], path, f"layer {i} device_expert")
        for d, row in enumerate(t):
            if np.unique(row).size != row.size:
                _fail(path, f"layer {i} device {d}: holds an expert twice")
        _every_expert(t.reshape(-1), num_logical, path, f"layer {i}")
        out.append(t)
    if len({t.shape for t in out}) != 1:
        _fail(path, "layers differ in slots per device")
    return np.stack(out)


def check_trtllm(path, *, dense: int, num_moe_layers: int, num_logical: int,
                 ep_size: int) -> np.ndarray:
    """TensorRT-LLM's MoE load balancer rules: ``num_slots`` a multiple of the EP size, a static
    ``layer_updates_per_iter: 0``, ``initial_global_assignments`` keyed by absolute decoder-layer
    index (dense layers counted, one key per MoE layer ``dense .. dense+M-1``), each list
    ``num_slots`` long holding every expert. -> int64 [M, num_slots]."""
    import yaml

    data = yaml.safe_load(Path(path).read_text())
    if not isinstance(data, dict) or not {"num_slots", "initial_global_assignments",
                                          "layer_updates_per_iter"} <= set(data):
        _fail(path, "needs num_slots, initial_global_assignments, layer_updates_per_iter")
    n = data["num_slots"]
    if not isinstance(n, int) or n % ep_size:
        _fail(path, f"num_slots={n} must be an integer multiple of ep_size={ep_size}")
    if data["layer_updates_per_iter"] != 0:
        _fail(path, "layer_updates_per_iter must be 0 (static placement)")
    asg = data["initial_global_assignments"]
    want = list(range(dense, dense + num_moe_layers))
    if not isinstance(asg, dict) or sorted(asg) != want:
        _fail(path, f"initial_global_assignments keys must be the decoder layers {want[0]}.."
                    f"{want[-1]}")
    t = _int_table([asg[k] for k in want], path, "initial_global_assignments", n)
    for i, row in zip(want, t, strict=True):
        _every_expert(row, num_logical, path, f"layer {i}")
    return t
