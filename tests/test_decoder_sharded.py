"""Every family's checkpoint on 4 real gloo ranks through every dispatch mode: logits equal the
single-process model, counters are exactly the counted rows' routed slots (decode-only
counting, graph-mode padding never counted), trace routing, and a placement switch."""

from __future__ import annotations

from dataclasses import replace

import hf_util
import numpy as np
import pytest
from hf_parity_util import cfg_for

from xllm_eplb.config import RuntimeConfig
from xllm_eplb.eplb import counters as ctr
from xllm_eplb.eplb.placement import build_log2phy, initial_phy2log
from xllm_eplb.model.batch import RankBatch, SeqRow
from xllm_eplb.model.decoder import Decoder

D = 4


def steps_for(seed: int = 7) -> list[list[RankBatch]]:
    rng = np.random.default_rng(seed)

    def pre(rid, n):
        return SeqRow(rid, rng.integers(0, 512, n).tolist(), 0, True)

    def dec(rid, pos):
        return SeqRow(rid, [int(rng.integers(0, 512))], pos, False)

    return [[RankBatch([pre(0, 5), pre(1, 3)]), RankBatch([pre(2, 4)]), RankBatch([]),
             RankBatch([pre(3, 6)])],
            [RankBatch([dec(0, 5), dec(1, 3)]), RankBatch([dec(2, 4)]), RankBatch([]),
             RankBatch([dec(3, 6)])],
            [RankBatch([dec(0, 6)], release=[1]), RankBatch([dec(2, 5)]),
             RankBatch([pre(4, 3)]), RankBatch([dec(3, 7)])],
            [RankBatch([dec(0, 7)]), RankBatch([dec(2, 6)]), RankBatch([dec(4, 3)]),
             RankBatch([dec(3, 8)])]]


def variants(path, trace):
    base = cfg_for(path, ep_size=D, redundant_experts_num=1)
    base = replace(base, runtime=replace(base.runtime, ep_transport="dist"))
    e = base.eplb
    return {"plain": base, "fused": replace(base, eplb=replace(e, enable_fused_mc2=1)),
            "decode_fused+decode_only": replace(base, eplb=replace(
                e, enable_fused_mc2=2, eplb_use_decode_only_load=True)),
            "graph": replace(base, runtime=replace(base.runtime, enable_graph=True,
                                                   max_batch_size=4)),
            "trace": replace(base, model=replace(base.model, routing_mode="trace",
                                                 routing_trace=str(trace))),
            # --ep_transport=shm (issue #39): the fused path through the shared memory
            "shm_fused": replace(base, eplb=replace(e, enable_fused_mc2=1),
                                 runtime=RuntimeConfig(ep_transport="shm"))}


def switch_table(model, seed=3):
    rng = np.random.default_rng(seed)
    E, S = model.cfg.model.num_experts, model.cfg.slots_per_rank
    out = []
    for _ in model.moe_layers:
        perm = rng.permutation(E).reshape(D, E // D)
        extra = rng.permutation(E)[:D]
        out.append(np.concatenate([np.append(perm[r], extra[r] if extra[r] not in perm[r]
                                             else perm[(r + 1) % D][0]) for r in range(D)]))
    assert all(len(t) == D * S for t in out)
    return np.stack(out).astype(np.int64)


def _rank(rank, world, paths, trace):
    import os

    from xllm_eplb.worker.comm import groups_from_world
    from xllm_eplb.worker.transport import close_ep_transport, open_ep_transport

    out = {}
    for i, (fam, path) in enumerate(paths.items()):
        out[fam] = {}
        for j, (name, cfg) in enumerate(variants(path, trace).items()):
            groups = groups_from_world(cfg)
            model = Decoder(cfg, rank, groups.ep_group)
            model.attach_transport(open_ep_transport(cfg, f"d{os.getppid()}", 100 * i + j + 1,
                                                     rank, D))
            new = switch_table(model)
            res = []
            for t, batches in enumerate(steps_for()):
                if t == 2:
                    for ml, fm in enumerate(model.moe_layers):
                        fm.load_placement(new[ml])
                nonempty = [b for b in batches if not b.is_empty]
                pure = bool(nonempty) and all(b.is_pure_decode for b in nonempty)
                r = model.forward_step(batches[rank], pure_decode=pure, return_logits=True,
                                       return_routing=True)
                res.append({"logits": r.logits.numpy(), "counters": r.counters, "mode": r.mode,
                            "routed": r.routed, "counted": r.counted})
            close_ep_transport(model.detach_transport())
            out[fam][name] = {"res": res, "new": new,
                              "bad": [fm.check_tags() + fm.check_checksums()
                                      for fm in model.moe_layers]}
    return out


def reference(path, steps):
    model = Decoder.reference(cfg_for(path, ep_size=D, redundant_experts_num=1))
    out = []
    for batches in steps:
        merged = RankBatch([r for b in batches for r in b.rows],
                           [q for b in batches for q in b.release])
        lg = model.forward_step(merged, return_logits=True).logits.numpy()
        per, start = [], 0
        for b in batches:
            per.append(lg[start:start + len(b.rows)])
            start += len(b.rows)
        out.append(per)
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_family_every_mode_on_four_ranks(hf_ckpts, tmp_path):
    from xllm_eplb.testing.dist import run_ranks

    trace = tmp_path / "trace.npy"
    np.save(trace, np.random.default_rng(1).gamma(0.3, size=(5, 16)))
    paths = {f: str(hf_ckpts[f]) for f in hf_util.SERVED_FAMILIES}
    out = run_ranks(_rank, D, paths, str(trace), timeout=280)
    steps = steps_for()
    want_modes = {"plain": ["plain"] * 4, "fused": ["fused"] * 4, "graph": ["plain"] * 4,
                  "trace": ["plain"] * 4, "shm_fused": ["fused"] * 4,
                  "decode_fused+decode_only": ["plain", "fused", "plain", "fused"]}
    for fam, path in paths.items():
        ref = reference(path, steps)
        for name, cfg in variants(path, trace).items():
            per = [out[r][fam][name] for r in range(D)]
            E = (per[0]["new"].shape[1] // D - 1) * D            # S = E / D + 1 slots
            init = np.tile(initial_phy2log(E, D, 1), (len(per[0]["new"]), 1))
            for t in range(len(steps)):
                table = per[0]["new"] if t >= 2 else init
                hist, got = 0, []
                for q in range(D):
                    r = per[q]["res"][t]
                    assert r["mode"] == want_modes[name][t], (fam, name, t)
                    rows = steps[t][q].rows
                    want_mask = [not (cfg.eplb.eplb_use_decode_only_load and x.is_prefill)
                                 for x in rows for _ in x.token_ids]
                    pad = r["counted"].size - len(want_mask)
                    assert r["counted"].tolist() == want_mask + [False] * pad, (fam, name, t, q)
                    if name == "graph" and (not rows or all(not x.is_prefill for x in rows)):
                        assert r["counted"].size >= 1 and pad == r["counted"].size - len(rows)
                    h = []
                    for ml, ids in enumerate(r["routed"]):
                        phys = build_log2phy(table[ml], E, q)[ids[r["counted"]].reshape(-1)]
                        h.append(np.bincount(phys, minlength=table.shape[1]))
                    hist = hist + np.stack(h)
                    got.append(ctr.decode(r["counters"]))
                    if rows and name != "trace":
                        lg = r["logits"]
                        assert np.abs(lg - ref[t][q]).max() < 1e-5 * np.abs(ref[t][q]).max(), \
                            (fam, name, t, q)
                assert (np.concatenate(got, axis=1) == hist).all(), (fam, name, t)
            assert all(b == [] for q in range(D) for b in per[q]["bad"]), (fam, name)
