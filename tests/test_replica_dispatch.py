"""Per-step replica routing wired into dispatch (``eplb_replica_routing``), on generated HF-format
checkpoints and 4 real gloo ranks: greedy tokens identical under static / spread / balanced and
through a placement switched in place mid-decode (the routing plan is rebuilt), logits equal to
static's, and every slot's counter equal to what the pure module (``eplb/replica_routing.py``)
assigns from the step's counts."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hf_parity_util import cfg_for

from xllm_eplb.eplb import counters as ctr
from xllm_eplb.eplb import replica_routing as rr
from xllm_eplb.model.batch import RankBatch, SeqRow

D, R = 4, 2                       # EP size, redundant slots per rank
MODES = ("static", "spread", "balanced")
FAMILIES = ("deepseek_v3", "qwen3_moe")
N_DECODE, SWITCH = 5, 3          # decode steps; the placement switches before this step
PROMPTS = {0: [[11, 5, 300, 7, 9], [42, 17, 3]], 1: [[100, 200, 33, 44]], 2: [],
           3: [[5, 6, 7, 8, 9, 10], [250]]}


def placement(E: int, seed: int) -> np.ndarray:
    """A valid table [D*S] with S = E/D + R: a permutation in the base slots, then R replicas
    of experts not already on the rank."""
    rng = np.random.default_rng(seed)
    perm = rng.permutation(E).reshape(D, E // D)
    rows = []
    for r in range(D):
        others = [e for e in rng.permutation(E).tolist() if e not in perm[r]]
        rows.append(np.concatenate([perm[r], others[:R]]))
    return np.concatenate(rows).astype(np.int64)


def _generate(rank, cfg, new_tables):
    from xllm_eplb.model.decoder import Decoder
    from xllm_eplb.worker.comm import groups_from_world

    model = Decoder(cfg, rank, groups_from_world(cfg).ep_group)
    reqs = {i: list(p) for i, p in enumerate(PROMPTS[rank])}
    rid = {i: 10 * rank + i for i in reqs}
    out = {"tokens": {i: [] for i in reqs}, "logits": [], "counters": [], "routed": [],
           "plans": []}
    pos = {i: 0 for i in reqs}
    for t in range(1 + N_DECODE):
        if t == SWITCH:
            for ml, fm in enumerate(model.moe_layers):
                fm.load_placement(new_tables[ml])          # in place, like an activation
        rows = [SeqRow(rid[i], reqs[i][pos[i]:], pos[i], t == 0) for i in reqs]
        # every rank prefills at step 0 (rank 2: nothing), so the step is pure decode after it
        res = model.forward_step(RankBatch(rows), pure_decode=t > 0, return_logits=True,
                                 return_routing=True)
        for i in reqs:
            pos[i] = len(reqs[i])
            reqs[i].append(res.sampled[rid[i]])
            out["tokens"][i].append(res.sampled[rid[i]])
        out["logits"].append(res.logits.numpy())
        out["counters"].append(ctr.decode(res.counters))
        out["routed"].append(res.routed)
        out["plans"].append([fm.routing_plan().phy2log.copy() for fm in model.moe_layers])
    return out


def _rank(rank, world, paths):
    out = {}
    for fam, path in paths.items():
        base = cfg_for(path, ep_size=D, redundant_experts_num=R)
        tables = _tables(path)
        for fused in (0, 1):
            for mode in MODES:
                cfg = replace(base, eplb=replace(base.eplb, eplb_replica_routing=mode,
                                                 enable_fused_mc2=fused))
                out[(fam, fused, mode)] = _generate(rank, cfg, tables)
        # a capacity nothing reaches (and the fallback that never fires) leaves outputs exact
        cfg = replace(base, eplb=replace(base.eplb, eplb_replica_routing="balanced",
                                         moe_capacity_mode="dynamic", moe_capacity_factor=50.0,
                                         moe_fallback_routing=True))
        out[(fam, 0, "capacity_unreached")] = _generate(rank, cfg, tables)
    return out


def _tables(path):
    from xllm_eplb.model.resolve import resolve_config
    from xllm_eplb.model.spec import parse_spec

    spec = parse_spec(str(path))
    E = resolve_config(cfg_for(path, ep_size=D, redundant_experts_num=R), spec).model.num_experts
    return np.stack([placement(E, 100 + ml) for ml in range(len(spec.moe_layers))])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_modes_same_tokens_and_counters_match_the_pure_assignment(hf_ckpts):
    from xllm_eplb.testing.dist import run_ranks

    paths = {f: str(hf_ckpts[f]) for f in FAMILIES}
    per = run_ranks(_rank, D, paths, timeout=560)
    for fam in FAMILIES:
        for fused in (0, 1):
            ref = [per[q][(fam, fused, "static")] for q in range(D)]
            for mode in MODES:
                got = [per[q][(fam, fused, mode)] for q in range(D)]
                _check_run(fam, fused, mode, ref, got)
        got = [per[q][(fam, 0, "capacity_unreached")] for q in range(D)]
        _check_run(fam, 0, "balanced", [per[q][(fam, 0, "static")] for q in range(D)], got)


def _check_run(fam, fused, mode, ref, got):
    where = (fam, fused, mode)
    for q in range(D):
        assert got[q]["tokens"] == ref[q]["tokens"], where
        for t, lg in enumerate(got[q]["logits"]):
            if lg.size == 0:                     # rank 2 has no requests
                continue
            assert np.abs(lg - ref[q]["logits"][t]).max() <= 1e-5 * max(
                1.0, np.abs(lg).max()), (where, q, t)
    n_layers = len(got[0]["routed"][0])
    moved = 0                        # (step, layer) cells where the mode's loads differ from static
    for t in range(1 + N_DECODE):
        for ml in range(n_layers):
            p2l = got[0]["plans"][t][ml]
            assert all((g["plans"][t][ml] == p2l).all() for g in got), (where, t, ml)
            plan = rr.prepare(p2l, int(p2l.max()) + 1, D)
            E = plan.num_logical
            counts = np.stack([np.bincount(g["routed"][t][ml].reshape(-1), minlength=E)
                               for g in got])
            want = rr.route(counts, plan, mode).sum(axis=0)
            seen = np.concatenate([g["counters"][t][ml] for g in got])
            assert (seen == want).all(), (where, t, ml, seen, want)
            moved += int((want != rr.route(counts, plan, "static").sum(axis=0)).any())
    assert (moved == 0) == (mode == "static"), (where, moved)   # the mode really re-routes
    # the switch really changed the table and every rank rebuilt the plan from it
    assert not (got[0]["plans"][SWITCH - 1][0] == got[0]["plans"][SWITCH][0]).all(), where


def test_spread_slots_give_each_replica_the_pure_modules_share():
    """``spread`` on the dispatch path (no [D, D*S] matrix) = ``replica_routing.route`` row, for
    every source rank, dropped (-1) rows left alone; and the plan follows an in-place switch."""
    import torch

    from xllm_eplb.config import Config, EplbConfig, ModelConfig
    from xllm_eplb.model.moe import FusedMoE
    from xllm_eplb.model.replica_dispatch import spread_slots

    E, Rr = 16, 3
    cfg = Config(eplb=EplbConfig(ep_size=D, redundant_experts_num=Rr),
                 model=ModelConfig(num_experts=E, hidden_size=8, moe_intermediate_size=4))
    rng = np.random.default_rng(5)
    tables = []
    for _ in range(2):
        perm = rng.permutation(E).reshape(D, E // D)
        tables.append(np.concatenate([np.append(perm[r], [e for e in rng.permutation(E)
                                                         if e not in perm[r]][:Rr])
                                      for r in range(D)]).astype(np.int64))

    def src(layer, e, out=None):
        return {"w13": torch.full((8, 8), float(e)), "w2": torch.full((8, 4), float(e))}

    for r in range(D):
        moe = FusedMoE(cfg, 0, r, tables[0], source=src)
        for table, n_tok in ((tables[0], 11), (tables[1], 11), (tables[0], 160)):
            moe.global_phy2log[:] = table                 # what a migration's switch does
            # 11 tokens: the plain-list path; 160 x 4 rows > ROWS_PY: the numpy path
            ids = torch.as_tensor(np.stack([rng.choice(E, 4, replace=False)
                                            for _ in range(n_tok)]))
            ids[3, 2] = -1
            got = spread_slots(moe, ids).reshape(-1).numpy()
            assert got[3 * 4 + 2] == -1 and (got[np.arange(got.size) != 14] >= 0).all()
            flat = ids.reshape(-1).numpy()
            c = np.zeros((D, E), dtype=np.int64)
            c[r] = np.bincount(flat[flat >= 0], minlength=E)
            plan = moe.routing_plan()
            assert (plan.phy2log == table).all()
            assert (table[got[got >= 0]] == flat[flat >= 0]).all()      # same logical expert
            want = rr.route(c, plan, "spread")[r]
            assert (np.bincount(got[got >= 0], minlength=table.size) == want).all()
