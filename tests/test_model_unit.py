"""Single-process checks of the model: weights/slot contract, config errors, routing skew,
trace routing, reproducible sampling, weight files."""

from __future__ import annotations

import os
from dataclasses import replace

import numpy as np
import pytest
import torch

from xllm_eplb.config import Config, EplbConfig, ModelConfig
from xllm_eplb.eplb.placement import initial_phy2log
from xllm_eplb.errors import ConfigError, InputFileError
from xllm_eplb.model import topics
from xllm_eplb.model.batch import RankBatch, SeqRow
from xllm_eplb.model.moe import FusedMoE
from xllm_eplb.model.transformer import MoETransformer
from xllm_eplb.model.weights import expert_weights, full_state_dict

SMALL = ModelConfig(num_layers=3, num_experts=16, num_experts_per_tok=2, hidden_size=32,
                    moe_intermediate_size=16, intermediate_size=48, dtype="float64")
TRACE = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data",
                     "sglang_ep_statistics", "decode_in1000out1000.json")


def cfg_of(**model) -> Config:
    return Config(eplb=EplbConfig(ep_size=4), model=replace(SMALL, **model))


def test_fused_moe_storage_contract():
    cfg = cfg_of()
    S, D = cfg.slots_per_rank, 4
    table = initial_phy2log(16, D, 1)
    fm = FusedMoE(cfg, 1, 2, table)
    ts = fm.expert_tensors()
    assert list(ts) == ["w13", "w2", "tag", "csum"] and all(t.shape[0] == S for t in ts.values())
    assert ts["w13"].shape == (S, 32, 32) and ts["w2"].shape == (S, 32, 16)
    assert ts["tag"].dtype == torch.int64 and fm.check_tags() == []
    ptrs = [t.data_ptr() for t in ts.values()] + [fm.log2phy.data_ptr(),
                                                    fm.local_expert_ids.data_ptr()]
    for s, e in enumerate(fm.local_expert_ids.tolist()):
        w = expert_weights(cfg, 1, e)
        assert torch.equal(fm.w13[s], w["w13"]) and torch.equal(fm.w2[s], w["w2"])
        assert fm.tag[s].tolist() == [e, 1]
    # a strict placement with a 3-replica expert: source rank r uses replica r % 3
    extra = [9, 9, 0, 1]                                       # expert 9: slots 4, 9, 11
    new = np.concatenate([np.append(np.arange(4 * r, 4 * r + 4), extra[r]) for r in range(D)])
    fm.load_placement(new)
    assert [t.data_ptr() for t in fm.expert_tensors().values()] + [
        fm.log2phy.data_ptr(), fm.local_expert_ids.data_ptr()] == ptrs
    slots9 = np.flatnonzero(new == 9)
    assert slots9.tolist() == [4, 9, 11]
    for r in range(D):
        fr = FusedMoE(cfg, 0, r, new)
        assert int(fr.log2phy[9]) == slots9[r % len(slots9)]
    assert (fm.global_phy2log == new).all() and fm.check_tags() == []
    fm.tag[3, 0] = 99                                          # canary catches a bad slot
    assert fm.check_tags() == [3]
    assert fm.check_checksums() == [] and ts["csum"].dtype == torch.float64
    fm.w2[1].copy_(fm.w2[2])                                   # weights that no longer match
    assert fm.check_checksums() == [1]
    # compute adds its thread CPU seconds; take_compute_cpu reads them once
    fm.compute(torch.ones(6, 32, dtype=fm.w13.dtype), torch.tensor([0, 1, 2, 3, 4, 0]))
    assert fm.compute_cpu_s > 0 and fm.take_compute_cpu() > 0 and fm.compute_cpu_s == 0.0


@pytest.mark.parametrize("kw,err,match", [
    (dict(model=dict(num_experts=18)), ConfigError,
     "--num_experts=18: must be divisible by --ep_size=4"),
    (dict(model=dict(num_experts_per_tok=17)), ConfigError, "num_experts_per_tok=17"),
    (dict(model=dict(hidden_size=30)), ConfigError, "num_attention_heads"),
    (dict(model=dict(routing_mode="trace")), ConfigError, "routing_trace"),
    (dict(model=dict(routing_mode="trace", routing_trace="/nonexistent.npy")), InputFileError,
     "does not exist"),
])
def test_config_errors(kw, err, match):
    with pytest.raises(err, match=match):
        MoETransformer(cfg_of(**kw["model"]), 0)


def test_weight_file_roundtrip_and_mismatch(tmp_path):
    cfg = cfg_of()
    sd = full_state_dict(cfg)
    good = tmp_path / "w.pt"
    torch.save(sd, good)
    batch = RankBatch([SeqRow(1, [5, 6, 7], 0, True)])
    a = MoETransformer.reference(cfg).forward_step(batch, return_logits=True)
    b = MoETransformer.reference(replace(cfg, model=replace(cfg.model, weights=str(good)))
                                 ).forward_step(batch, return_logits=True)
    assert torch.equal(a.logits, b.logits)
    assert len(a.timings["expert_cpu_s"]) == cfg.num_moe_layers      # reference: LogicalMoE
    sd["layers.1.experts.w2"] = sd["layers.1.experts.w2"][:, :, :8]
    bad = tmp_path / "bad.pt"
    torch.save(sd, bad)
    with pytest.raises(InputFileError, match=r"layers.1.experts.w2.*shape \[16, 32, 8\]"):
        MoETransformer(replace(cfg, model=replace(cfg.model, weights=str(bad))), 0)
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a state dict")
    with pytest.raises(InputFileError, match="junk.pt' as a torch state dict") as ei:
        MoETransformer(replace(cfg, model=replace(cfg.model, weights=str(junk))), 0)
    assert "\n" not in str(ei.value)                 # regression: torch's message is multi-line
    with pytest.raises(InputFileError, match=r"placement: shape \[2, 3\]"):
        MoETransformer(cfg, 0, phy2log=np.zeros((2, 3), dtype=np.int64))


def _topic_loads(model, cfg, topic, rid0):
    rng = np.random.default_rng(topic)
    rows = [SeqRow(rid0 + i, topics.topic_token_ids(cfg, topic, 24, rng), 0, True)
            for i in range(4)]
    res = model.forward_step(RankBatch(rows), warmup=True)
    return np.diff(res.counters, axis=1, prepend=0)          # [L, E]


def test_topic_skew_deeper_layers_and_shifting_mix():
    cfg = Config(eplb=EplbConfig(ep_size=4), model=ModelConfig(num_layers=5, dtype="float64"))
    model = MoETransformer.reference(cfg)
    T, E = topics.num_topics(cfg), cfg.model.num_experts
    a, b = _topic_loads(model, cfg, 0, 0), _topic_loads(model, cfg, 5, 100)
    m, L = E // T, cfg.num_moe_layers
    home = [a[ml][topics.home_experts(cfg, ml)[0]].sum() / a[ml].sum() for ml in range(L)]
    assert home[0] > 2 * m / E                   # hot set well above uniform (m/E)
    assert home[-1] > home[0] and home[-1] > 0.6  # deeper layers more skewed
    for ml in range(1, L):                       # another topic -> another hot set
        top_a = set(np.argsort(-a[ml])[:m].tolist())
        top_b = set(np.argsort(-b[ml])[:m].tolist())
        assert len(top_a & top_b) <= m // 2
    assert len(model.kv) == 0                    # warm-up keeps no KV


def test_trace_routing_deterministic_and_batch_independent(tmp_path):
    path = TRACE if os.path.exists(TRACE) else None
    if path is None:
        path = str(tmp_path / "t.npy")
        np.save(path, np.random.default_rng(0).gamma(0.3, size=(4, 64)))
    cfg = cfg_of(routing_mode="trace", routing_trace=path)
    row = SeqRow(7, [1, 2, 3, 4], 0, True)
    other = SeqRow(8, [9, 9], 0, True)
    r1 = MoETransformer.reference(cfg).forward_step(RankBatch([row]), return_routing=True)
    r2 = MoETransformer.reference(cfg).forward_step(RankBatch([other, row]),
                                                     return_routing=True)
    for ml in range(cfg.num_moe_layers):
        assert (r1.routed[ml] == r2.routed[ml][2:]).all()
        assert (np.sort(r1.routed[ml], axis=1)[:, :-1] != np.sort(r1.routed[ml], axis=1)[:, 1:]
                ).all()                                        # k distinct experts per token


def test_seeded_sampling_independent_of_batch():
    cfg = cfg_of()
    def run(extra):
        m = MoETransformer.reference(cfg)
        toks, pos, out = [3, 4, 5], 0, []
        for step in range(4):
            rows = [SeqRow(1, toks, pos, step == 0, 1.0, 42)]
            if extra:
                rows = [SeqRow(1000 + step, [7, 8], 0, True, 0.7, 1)] + rows
            res = m.forward_step(RankBatch(rows, release=[1000 + step - 1] if extra else []))
            pos += len(toks)
            toks = [res.sampled[1]]
            out.append(toks[0])
        return out
    assert run(False) == run(True)
    m = MoETransformer.reference(cfg)
    with pytest.raises(ValueError, match="start_pos=2 but the KV cache holds 0"):
        m.forward_step(RankBatch([SeqRow(1, [3], 2, False)]))


def test_bf16_and_float32_run():
    for dt in ("bfloat16", "float32"):
        res = MoETransformer.reference(cfg_of(dtype=dt)).forward_step(
            RankBatch([SeqRow(1, [3, 4], 0, True)]), return_logits=True)
        assert torch.isfinite(res.logits).all() and 1 in res.sampled
