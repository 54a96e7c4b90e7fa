"""Run the sharded model without the engine: N real processes (one per EP rank), fed batches.

``run_sharded(cfgs, steps)`` spawns ``ep_size`` ranks with ``testing.dist.run_ranks``; every
rank builds one :class:`Decoder` per config variant (so several dispatch modes share one
spawn) and runs the same steps: ``steps[t][rank]`` is rank's :class:`RankBatch` at step t.
``reference_steps(cfg, steps)`` runs the single-process reference on the merged batches and
splits its outputs per rank the same way. A config without ``--model`` serves the generated
default checkpoint (:func:`with_default_checkpoint`, called here in the parent, never per rank). Results come back as :class:`StepResult` with numpy
logits (no tensor crosses a process boundary).
"""

from __future__ import annotations

import os
from dataclasses import replace

import numpy as np

from xllm_eplb.config import Config
from xllm_eplb.engine.scheduler import is_pure_decode_step
from xllm_eplb.model.batch import RankBatch
from xllm_eplb.model.decoder import Decoder
from xllm_eplb.model.default_checkpoint import with_default_checkpoint
from xllm_eplb.model.step import StepResult
from xllm_eplb.model.step_inputs import dispatched_rows
from xllm_eplb.testing.dist import run_ranks
from xllm_eplb.worker.comm import groups_from_world
from xllm_eplb.worker.transport import close_ep_transport, open_ep_transport


def _np(res: StepResult) -> StepResult:
    lg = None if res.logits is None else res.logits.numpy()
    return replace(res, logits=lg)


def run_steps(model: Decoder, steps: list[list[RankBatch]], rank: int,
              switch: dict | None = None, warmup_steps: tuple = ()) -> list[StepResult]:
    """Run ``steps`` on one rank's model, each rank told every rank's row count as the worker
    does (``peer_rows``). ``switch``: step index -> new placement
    [L_moe, D*S] materialised (weights + tables) before that step's forward."""
    out = []
    for t, batches in enumerate(steps):
        if switch and t in switch:
            for ml, fm in enumerate(model.moe_layers):
                fm.load_placement(np.asarray(switch[t])[ml])
        out.append(_np(model.forward_step(batches[rank], warmup=t in warmup_steps,
                                          pure_decode=is_pure_decode_step(batches),
                                          return_logits=True, return_routing=True,
                                          peer_rows=dispatched_rows(model.cfg, batches))))
    return out


def _rank_program(rank: int, world: int, cfgs: list[Config], steps, phy2log, switch, warmup):
    groups = groups_from_world(cfgs[0])
    results = []
    for v, cfg in enumerate(cfgs):
        model = Decoder(cfg, rank, groups.ep_group, phy2log)
        # --ep_transport=shm: one segment per variant (a fresh "generation"); the ranks of one
        # run_ranks spawn share its parent's pid, the run id when the config names none
        model.attach_transport(open_ep_transport(cfg, cfg.runtime.run_id or f"h{os.getppid()}",
                                                 v + 1, rank, world))
        try:
            res = run_steps(model, steps, rank, switch, warmup)
        finally:
            close_ep_transport(model.detach_transport())
        tags_bad = [fm.check_tags() + fm.check_checksums() for fm in model.moe_layers]
        results.append({"results": res, "bad_tags": tags_bad,
                        "kv_requests": len(model.kv)})
    return results


def run_sharded(cfgs: Config | list[Config], steps: list[list[RankBatch]], *,
                phy2log: np.ndarray | None = None, switch: dict | None = None,
                warmup_steps: tuple = (), timeout: float = 120.0) -> list[list[dict]]:
    """-> ``out[variant][rank]`` = {"results": [StepResult per step], "bad_tags": per-layer
    canary failures (slots whose tag or weight checksum is wrong), "kv_requests": open KV
    entries at the end}."""
    cfgs = [with_default_checkpoint(c) for c in ([cfgs] if isinstance(cfgs, Config) else cfgs)]
    world = cfgs[0].eplb.ep_size
    if any(c.eplb.ep_size != world for c in cfgs):
        raise ValueError("run_sharded: every config variant needs the same ep_size")
    for t, b in enumerate(steps):
        if len(b) != world:
            raise ValueError(f"run_sharded: step {t} has {len(b)} rank batches, ep_size={world}")
    per_rank = run_ranks(_rank_program, world, cfgs, steps, phy2log, switch, tuple(warmup_steps),
                         timeout=timeout)
    return [[per_rank[r][v] for r in range(world)] for v in range(len(cfgs))]


def reference_steps(cfg: Config, steps: list[list[RankBatch]]) -> list[list[StepResult]]:
    """Single-process reference: ``out[t][rank]`` with that rank's rows' sampled tokens and
    logits; counters (per logical expert, [L_moe, E]) are of the whole merged step and are
    stored on rank 0's entry only (others get zeros)."""
    model = Decoder.reference(with_default_checkpoint(cfg))
    out = []
    for batches in steps:
        merged = RankBatch([r for b in batches for r in b.rows],
                           [q for b in batches for q in b.release])
        res = _np(model.forward_step(merged, return_logits=True))
        per, start = [], 0
        for rank, b in enumerate(batches):
            n = len(b.rows)
            ids = [r.req_id for r in b.rows]
            ctr = res.counters if rank == 0 else np.zeros_like(res.counters)
            per.append(StepResult({i: res.sampled[i] for i in ids}, ctr,
                                  res.logits[start:start + n], False, res.mode, {}))
            start += n
        out.append(per)
    return out
