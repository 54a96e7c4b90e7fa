"""Collective rounds of a step, counted on real gloo ranks: a 1-rank group runs none; with every
rank's row count known (``peer_rows``, as the worker passes it) a layer costs two all_to_alls
(dispatch, combine) instead of three, and the logits are bit-identical to the exchanged path."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from xllm_eplb.config import Config, EplbConfig
from xllm_eplb.model.batch import RankBatch, SeqRow
from xllm_eplb.model.default_checkpoint import with_default_checkpoint
from xllm_eplb.model.dispatch import padded_bounds
from xllm_eplb.model.step_inputs import dispatched_rows
from xllm_eplb.testing.dist import run_ranks
from xllm_eplb.testing.harness import reference_steps

COLLECTIVES = ("all_to_all_single", "all_gather", "all_reduce", "broadcast", "barrier",
               "all_to_all", "send", "recv", "isend", "irecv")


def _steps(world: int) -> list[list[RankBatch]]:
    pre = [RankBatch([SeqRow(10 * r + j, [3 + r + j, 7, 11 + j], 0, True) for j in range(2)])
           for r in range(world)]
    dec = [RankBatch([SeqRow(10 * r + j, [5 + j], 3, False) for j in range(2)])
           for r in range(world)]
    if world > 1:
        dec[world - 1] = RankBatch([SeqRow(10 * (world - 1), [9], 3, False)],
                                   release=[10 * (world - 1) + 1])
    return [pre, dec]


def _count_rounds(rank, world, cfgs):
    import torch.distributed as dist

    from xllm_eplb.model.decoder import Decoder
    from xllm_eplb.worker.comm import groups_from_world

    calls = {"n": 0}
    for name in COLLECTIVES:
        real = getattr(dist, name)

        def wrapped(*a, _real=real, **k):
            calls["n"] += 1
            return _real(*a, **k)
        setattr(dist, name, wrapped)
    groups = groups_from_world(cfgs[0])
    out = []
    for cfg in cfgs:
        for peers in (False, True):
            model = Decoder(cfg, rank, groups.ep_group)
            rounds, logits = [], []
            for batches in _steps(world):
                calls["n"] = 0
                r = model.forward_step(batches[rank], return_logits=True,
                                       peer_rows=dispatched_rows(cfg, batches) if peers
                                       else None)
                rounds.append(calls["n"])
                logits.append(r.logits.numpy())
            out.append({"rounds": rounds, "logits": logits, "layers": cfg.num_moe_layers})
    return out


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [1, 2])
def test_rounds_per_step(world):
    base = with_default_checkpoint(Config(eplb=EplbConfig(
        ep_size=world, redundant_experts_num=0 if world == 1 else 1)))
    fused = replace(base, eplb=replace(base.eplb, enable_fused_mc2=1))
    per_rank = run_ranks(_count_rounds, world, [base, fused], timeout=110)
    ref = reference_steps(base, _steps(world))
    for rank, variants in enumerate(per_rank):
        for v, res in enumerate(variants):
            L = res["layers"]
            peers = v % 2 == 1
            want = 0 if world == 1 else (2 if peers else 3) * L
            assert res["rounds"] == [want, want], (rank, v, res["rounds"])
            for t, lg in enumerate(res["logits"]):
                np.testing.assert_allclose(lg, ref[t][rank].logits, rtol=1e-4, atol=1e-4)
                # the padded dispatch moves the same rows: identical to the exchanged path
                np.testing.assert_array_equal(lg, variants[v - 1 if peers else v]["logits"][t])


def test_padded_bounds_rules():
    assert padded_bounds(None, 3, 2, 0, 2, 64) is None
    assert padded_bounds([3, 5], 3, 2, 0, 2, 64) == [6, 10]
    assert padded_bounds([3, 5, 1], 3, 2, 0, 2, 64) is None          # not this group's size
    assert padded_bounds([3, 10 ** 6], 3, 2, 0, 2, 64) is None        # too large to pad
    with pytest.raises(RuntimeError, match="dispatches 4 rows but peer_rows says 3"):
        padded_bounds([3, 5], 4, 2, 0, 2, 64)
