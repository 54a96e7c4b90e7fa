"""A deployable placement file: the JSON ``xllm-eplb plan --output`` writes, read back for
``serve --eplb_init_placement=FILE``.

Keys read (the others, e.g. ``policy``, ``policy_seconds``, are ignored): ``phy2log``
``[moe_layers][ep_size * slots_per_rank]`` logical expert ids, ``ep_size``, ``slots_per_rank``,
``num_logical_experts`` and, when present, ``moe_layers`` (``[first, stop)``, MoE-local).
The file must match the server: same number of MoE layers and routed experts as the model, same
``ep_size``, ``slots_per_rank = num_experts / ep_size + redundant_experts_num``, and every layer
must hold every logical expert (ids in range; same-rank duplicates are allowed, as in xLLM's
initial layout). Every failure is one :class:`~xllm_eplb.errors.InputFileError` naming the file,
the field, its value and the rule.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from xllm_eplb.config import Config, rank_slots
from xllm_eplb.eplb.loads import read_json
from xllm_eplb.eplb.placement import initial_phy2log, validate_table
from xllm_eplb.errors import InputFileError

FLAG = "--eplb_init_placement"
REQUIRED = ("phy2log", "ep_size", "slots_per_rank", "num_logical_experts")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _load_json(path: str) -> dict:
    p = Path(path)
    where = f"{FLAG}={path}"
    if not p.is_file():
        raise InputFileError(f"{where}: placement file not found")
    data = read_json(p, where)
    if not isinstance(data, dict):
        raise InputFileError(f"{where}: expected a JSON object as `xllm-eplb plan --output` "
                             f"writes, got a {type(data).__name__}")
    missing = [k for k in REQUIRED if k not in data]
    if missing:
        raise InputFileError(f"{where}: missing key '{missing[0]}' (a plan output has "
                             f"{', '.join(REQUIRED)})")
    return data


def _check_sizes(data: dict, where: str, num_logical: int, ep_size: int, redundant: int,
                 num_moe_layers: int) -> int:
    """The scalar fields against the server; returns slots per rank."""
    slots = rank_slots(num_logical, ep_size, redundant)
    rules = (
        ("num_logical_experts", num_logical, f"must equal the model's {num_logical} routed "
                                             f"experts per layer"),
        ("ep_size", ep_size, f"must equal the server's --ep_size={ep_size}"),
        ("slots_per_rank", slots, f"must equal num_experts / ep_size + --redundant_experts_num"
                                  f" = {num_logical}/{ep_size}+{redundant} = {slots}"),
    )
    for key, want, rule in rules:
        v = data[key]
        if not _is_int(v) or v != want:
            raise InputFileError(f"{where}: {key}={json.dumps(v)}: {rule}")
    if "moe_layers" in data and data["moe_layers"] != [0, num_moe_layers]:
        raise InputFileError(f"{where}: moe_layers={json.dumps(data['moe_layers'])}: must be "
                             f"[0, {num_moe_layers}], every MoE layer of the model (plan "
                             f"without --moe-layers)")
    return slots


def _table(rows, where: str, num_moe_layers: int, width: int) -> np.ndarray:
    if not isinstance(rows, list) or len(rows) != num_moe_layers:
        n = len(rows) if isinstance(rows, list) else type(rows).__name__
        raise InputFileError(f"{where}: phy2log has {n} rows: must have one per MoE layer of "
                             f"the model ({num_moe_layers})")
    for i, row in enumerate(rows):
        if not isinstance(row, list) or len(row) != width:
            n = len(row) if isinstance(row, list) else type(row).__name__
            raise InputFileError(f"{where}: phy2log[{i}] has {n} slots: must have ep_size * "
                                 f"slots_per_rank = {width}")
        bad = next((j for j, v in enumerate(row) if not _is_int(v)), None)
        if bad is not None:
            raise InputFileError(f"{where}: phy2log[{i}][{bad}]={json.dumps(row[bad])}: must be "
                                 f"an integer expert id")
    return np.asarray(rows, dtype=np.int64).reshape(num_moe_layers, width)


def read_placement_file(path: str, *, num_logical: int, ep_size: int, redundant: int,
                        num_moe_layers: int) -> np.ndarray:
    """Read and validate a plan output (module docstring) -> int64 ``[num_moe_layers, D*S]``."""
    where = f"{FLAG}={path}"
    data = _load_json(path)
    slots = _check_sizes(data, where, num_logical, ep_size, redundant, num_moe_layers)
    table = _table(data["phy2log"], where, num_moe_layers, ep_size * slots)
    validate_table(table, num_logical, ep_size, f"{where}: phy2log[{{}}]", InputFileError,
                   per_rank_cap=slots)
    return table


def initial_placement(cfg: Config) -> np.ndarray:
    """The placement a server starts from, int64 ``[num_moe_layers, D*S]``: the
    ``eplb_init_placement`` file when set, else xLLM's initial layout on every layer.
    ``cfg`` must be resolved (``--model``: the checkpoint's sizes).

    NOTE: the engine and every worker read the file themselves at start; it must not change
    while the server starts (the launcher checked it before spawning anyone)."""
    e, m = cfg.eplb, cfg.model
    if e.eplb_init_placement:
        return read_placement_file(e.eplb_init_placement, num_logical=m.num_experts,
                                   ep_size=e.ep_size, redundant=e.redundant_experts_num,
                                   num_moe_layers=cfg.num_moe_layers)
    base = initial_phy2log(m.num_experts, e.ep_size, e.redundant_experts_num)
    return np.tile(base, (cfg.num_moe_layers, 1))
