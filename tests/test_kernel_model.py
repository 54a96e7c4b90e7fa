"""The fused kernels inside the model, on 2 real gloo ranks, fp32 and bf16: a request's logits
are the same bits alone or inside a batch of 8, and through a live move (P2P copies of every
layer's experts into a placement with other replicas) with per-step replica routing
(``balanced``) — batch invariance end to end (attention, dense layers, router, experts,
combine), which is what keeps live moves output-preserving in bf16."""

from __future__ import annotations

import numpy as np
import pytest
from migration_util import random_placement

from xllm_eplb.config import Config, EplbConfig, ModelConfig
from xllm_eplb.model.batch import RankBatch, SeqRow
from xllm_eplb.model.checkpoint import make_checkpoint
from xllm_eplb.testing.dist import run_ranks

E, D, STEPS = 8, 2, 5


def _cfg(path, dtype: str) -> Config:
    return Config(eplb=EplbConfig(ep_size=D, redundant_experts_num=1,
                                  eplb_replica_routing="balanced"),
                  model=ModelConfig(model=str(path), dtype=dtype, moe_kernel="fused"))


def _batches(rank: int, t: int, crowd: bool) -> RankBatch:
    """Request 0 on rank 0 (prompt, then one decode token a step); with ``crowd``, 3 more
    requests beside it and 4 on rank 1, of other lengths and tokens."""
    rng = np.random.default_rng(100 + t)
    rows = []
    if rank == 0:
        rows.append(SeqRow(0, [11, 5, 90, 7, 3, 60] if t == 0 else [40 + t], 0 if t == 0 else
                           5 + t, t == 0))
    if crowd:
        for j in range(4):
            rid = 1 + rank * 4 + j
            n = 3 + j + rank
            toks = rng.integers(0, 200, n if t == 0 else 1).tolist()
            rows.append(SeqRow(rid, toks, 0 if t == 0 else n + t - 1, t == 0))
    return RankBatch(rows)


def _program(rank, world, path, dtype, placements):
    from xllm_eplb.model.decoder import Decoder
    from xllm_eplb.worker.comm import groups_from_world
    from xllm_eplb.worker.migration import ModelEplbHooks

    groups = groups_from_world(_cfg(path, dtype))
    out = {}
    for name, crowd, switch in (("alone", False, None), ("crowd", True, None),
                                ("moved", True, 2)):
        model = Decoder(_cfg(path, dtype), rank, groups.ep_group)
        assert model.fused_dense and all(m.fused for m in model.moe_layers)
        hooks = ModelEplbHooks(model, groups.eplb_group, model.cfg, canary=True)
        got = []
        for t in range(STEPS):
            if switch == t:             # a live move of every layer: P2P copies, canary on
                for ml, fm in enumerate(model.moe_layers):
                    assert hooks.prepare_expert_weight(fm.layer_id, placements[ml])
                    hooks.start_expert_weight_transfer(fm.layer_id)
                    assert hooks.update_expert_weight(fm.layer_id).changed_slots > 0
                    assert fm.check_tags() == [] and fm.check_checksums() == []
            res = model.forward_step(_batches(rank, t, crowd), pure_decode=t > 0,
                                     return_logits=True)
            if rank == 0:
                got.append(res.logits[0].numpy().copy())
        out[name] = got
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_requests_logits_do_not_depend_on_its_batch_or_the_placement(tmp_path, dtype):
    path = make_checkpoint("qwen3_moe", tmp_path / "ckpt", num_layers=3, num_experts=E, top_k=2,
                           seed=3)
    S = E // D + 1
    rng = np.random.default_rng(0)
    placements = np.stack([random_placement(rng, E, D, S) for _ in range(2)])
    assert all((np.bincount(p, minlength=E) >= 1).all() for p in placements)
    out = run_ranks(_program, D, path, dtype, placements, timeout=280)[0]
    for t in range(STEPS):
        a, c, m = out["alone"][t], out["crowd"][t], out["moved"][t]
        assert np.isfinite(a).all()
        assert np.array_equal(a, c), f"step {t}: batch changed the logits ({dtype})"
        assert np.array_equal(a, m), f"step {t}: the placement changed the logits ({dtype})"
