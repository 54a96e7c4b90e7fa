"""Elastic shrink on a worker (``--elastic_ep``, issue #23 items 5-6): a survivor's model takes
its compact rank in the smaller world and the new deployed table.

The survivor keeps its local slots and their weights (stable local slot ids next to the compact
rank, ``eplb/shrink_plan.py``): only the slots whose logical expert changed (an orphan of the
dead rank placed into a donor slot) are read from the checkpoint's safetensors, through the
model's own expert source (dense or FP8, exactly as at load: same bytes, same checksum). Every
size-derived piece of each :class:`~xllm_eplb.model.moe.FusedMoE` follows
(``FusedMoE.reshard``: ``ep_rank``, ``ep_size``, ``global_phy2log`` [D*S], ``log2phy``, the
replica-routing plan, rebuilt on its next use), and the decoder's rank (``Decoder.take_rank``). The dispatch splits and capacity gathers read ``ep_size`` / ``ep_rank`` from the layer on
every step; the caller replaces the process groups and rebuilds the EPLB executor.

Afterwards every slot passes the transfer canary: tag = (expert, layer), weights = the checksum
taken when they were loaded (:func:`canary`), and each layer's table covers every expert
(``activate_table`` refuses a table with an expert missing).
"""

from __future__ import annotations

import time

import numpy as np


def reshard(model, ep_rank: int, ep_size: int, table: np.ndarray) -> dict:
    """Switch ``model`` (a sharded Decoder) to compact rank ``ep_rank`` of ``ep_size`` ranks
    and the deployed ``table`` [L, ep_size*S]; returns ``{"checkpoint": slots read,
    "kept": slots kept, "seconds": ...}``."""
    t0 = time.perf_counter()
    t = np.asarray(table, dtype=np.int64)
    layers = model.moe_layers
    S = layers[0].slots_per_rank if layers else 0
    if t.shape != (len(layers), ep_size * S):
        raise ValueError(f"reshard: table of shape {t.shape}, expected "
                         f"[layers, ep_size*slots]={(len(layers), ep_size * S)}")
    read = sum(fm.reshard(ep_rank, ep_size, t[ml]) for ml, fm in enumerate(layers))
    model.take_rank(ep_rank)
    return {"checkpoint": read, "kept": len(layers) * S - read,
            "seconds": time.perf_counter() - t0}


def canary(model) -> str | None:
    """The transfer canary over every MoE layer of ``model``: None when every slot's tag and
    weight checksum are right, else what is wrong."""
    for fm in model.moe_layers:
        bad = fm.check_tags()
        if bad:
            return (f"EPLB canary: layer {fm.layer_id} slot {bad[0]} holds tag "
                    f"{fm.tag[bad[0]].tolist()}, expected expert "
                    f"{int(fm.local_expert_ids[bad[0]])}")
        bad = fm.check_checksums()
        if bad:
            return (f"EPLB canary: layer {fm.layer_id} slot {bad[0]}: weights differ from the "
                    f"checksum of expert {int(fm.local_expert_ids[bad[0]])}")
    return None
