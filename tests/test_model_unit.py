"""Single-process checks of the model on generated checkpoints (no --model): weights/slot
contract, config errors, routing skew, trace routing, reproducible sampling."""

from __future__ import annotations

import os
from dataclasses import replace

import numpy as np
import pytest
import torch

from xllm_eplb.config import Config, EplbConfig, ModelConfig
from xllm_eplb.eplb.placement import initial_phy2log
from xllm_eplb.errors import ConfigError, InputFileError
from xllm_eplb.model.batch import RankBatch, SeqRow
from xllm_eplb.model.checkpoint import read_topics
from xllm_eplb.model.decoder import Decoder
from xllm_eplb.model.default_checkpoint import with_default_checkpoint
from xllm_eplb.model.loader import CheckpointReader, expert_weights
from xllm_eplb.model.moe import FusedMoE
from xllm_eplb.model.resolve import resolve_config
from xllm_eplb.model.spec import parse_spec

SMALL = ModelConfig(num_layers=3, num_experts=16, num_experts_per_tok=2, hidden_size=32,
                    moe_intermediate_size=16, intermediate_size=48, dtype="float64")
TRACE = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data",
                     "sglang_ep_statistics", "decode_in1000out1000.json")


def cfg_of(**model) -> Config:
    """SMALL with ``model`` changes, served from its generated checkpoint."""
    return with_default_checkpoint(Config(eplb=EplbConfig(ep_size=4),
                                          model=replace(SMALL, **model)))


def checkpoint_source(cfg: Config):
    """(resolved cfg, ``source(ml, e)``: logical expert e of MoE layer ml read from the file)."""
    spec = parse_spec(cfg.model.model)
    reader = CheckpointReader(cfg.model.model)
    return resolve_config(cfg, spec), (lambda ml, e, out=None: expert_weights(
        spec, reader, spec.moe_layers[ml], e, torch.float64, out))


def test_fused_moe_storage_contract():
    cfg, src = checkpoint_source(cfg_of())
    S, D = cfg.slots_per_rank, 4
    table = initial_phy2log(16, D, 1)
    fm = FusedMoE(cfg, 1, 2, table, source=src)
    ts = fm.expert_tensors()
    assert list(ts) == ["w13", "w2", "tag", "csum"] and all(t.shape[0] == S for t in ts.values())
    assert ts["w13"].shape == (S, 32, 32) and ts["w2"].shape == (S, 32, 16)
    assert ts["tag"].dtype == torch.int64 and fm.check_tags() == []
    ptrs = [t.data_ptr() for t in ts.values()] + [fm.log2phy.data_ptr(),
                                                    fm.local_expert_ids.data_ptr()]
    for s, e in enumerate(fm.local_expert_ids.tolist()):
        w = src(1, e)
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
        fr = FusedMoE(cfg, 0, r, new, source=src)
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
    (dict(model=dict(hidden_size=30, model_arch="qwen3_moe")), ConfigError,
     "num_attention_heads=4: must divide hidden_size=30"),
    (dict(model=dict(n_shared_experts=0)), ConfigError,
     "n_shared_experts=0: the generated deepseek_v3 checkpoint always has a shared expert"),
    (dict(model=dict(routing_mode="trace")), ConfigError, "routing_trace"),
    (dict(model=dict(routing_mode="trace", routing_trace="/nonexistent.npy")), InputFileError,
     "does not exist"),
])
def test_config_errors(kw, err, match):
    with pytest.raises(err, match=match):
        Decoder(cfg_of(**kw["model"]), 0)


def test_reference_timings_and_bad_placement():
    cfg = cfg_of()
    batch = RankBatch([SeqRow(1, [5, 6, 7], 0, True)])
    a = Decoder.reference(cfg).forward_step(batch, return_logits=True)
    assert len(a.timings["expert_cpu_s"]) == cfg.num_moe_layers      # reference: LogicalMoE
    with pytest.raises(InputFileError, match=r"placement: shape \[2, 3\]"):
        Decoder(cfg, 0, phy2log=np.zeros((2, 3), dtype=np.int64))


def _topic_loads(model, info, topic, rid0):
    rng = np.random.default_rng(topic)
    T, (lo, hi) = info["num_topics"], info["text_token_ids"]
    pool = np.arange(lo + (topic - lo) % T, hi, T)              # ordinary ids of the topic
    rows = [SeqRow(rid0 + i, [int(x) for x in rng.choice(pool, size=24)], 0, True)
            for i in range(4)]
    res = model.forward_step(RankBatch(rows), warmup=True)
    return np.diff(res.counters, axis=1, prepend=0)          # [L, E]


def test_topic_skew_deeper_layers_and_shifting_mix():
    cfg = with_default_checkpoint(Config(eplb=EplbConfig(ep_size=4),
                                         model=ModelConfig(num_layers=5, dtype="float64")))
    model = Decoder.reference(cfg)
    info = read_topics(cfg.model.model)
    T, E = info["num_topics"], cfg.model.num_experts
    a, b = _topic_loads(model, info, 0, 0), _topic_loads(model, info, 5, 100)
    m, L = E // T, model.cfg.num_moe_layers
    home = [a[ml][info["home_experts"][ml][0]].sum() / a[ml].sum() for ml in range(L)]
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
    r1 = Decoder.reference(cfg).forward_step(RankBatch([row]), return_routing=True)
    r2 = Decoder.reference(cfg).forward_step(RankBatch([other, row]),
                                              return_routing=True)
    for ml in range(cfg.num_moe_layers):
        assert (r1.routed[ml] == r2.routed[ml][2:]).all()
        assert (np.sort(r1.routed[ml], axis=1)[:, :-1] != np.sort(r1.routed[ml], axis=1)[:, 1:]
                ).all()                                        # k distinct experts per token


def test_seeded_sampling_independent_of_batch():
    cfg = cfg_of()
    def run(extra):
        m = Decoder.reference(cfg)
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
    m = Decoder.reference(cfg)
    with pytest.raises(ValueError, match="start_pos=2 but the KV cache holds 0"):
        m.forward_step(RankBatch([SeqRow(1, [3], 2, False)]))


def test_bf16_and_float32_run():
    for dt in ("bfloat16", "float32"):
        res = Decoder.reference(cfg_of(dtype=dt)).forward_step(
            RankBatch([SeqRow(1, [3, 4], 0, True)]), return_logits=True)
        assert torch.isfinite(res.logits).all() and 1 in res.sampled


def test_token_logprobs_are_log_softmax_of_the_raw_logits():
    from xllm_eplb.model.step import token_logprobs

    logits = torch.tensor([1.0, 3.0, -2.0, 3.0, 0.5], dtype=torch.float32)
    ref = torch.log_softmax(logits.double(), dim=-1)
    lp, top = token_logprobs(logits, 4, 3)
    assert lp == pytest.approx(float(ref[4]), abs=1e-12)
    assert [i for i, _ in top][2] == 0 and {i for i, _ in top[:2]} == {1, 3}
    assert [x for _, x in top] == pytest.approx([float(ref[1]), float(ref[3]), float(ref[0])])
    assert token_logprobs(logits, 1, 0) == (pytest.approx(float(ref[1])), [])
    assert len(token_logprobs(logits, 1, 99)[1]) == 5


def test_reshard_switches_every_layer_through_its_own_methods():
    """An elastic shrink on a survivor (``Decoder.reshard``): rank 2 of 4 becomes compact rank 1
    of 3; only the orphans' slots are read, every slot passes the canary and holds the weights
    of the checkpoint's expert, every layer's size-derived fields follow."""
    from xllm_eplb.eplb.membership_plan import plan_shrink
    cfg = with_default_checkpoint(Config(eplb=EplbConfig(ep_size=4, redundant_experts_num=2),
                                         model=SMALL))
    model = Decoder(cfg, 2, _joining=True)     # no process group: the model alone
    S, L = cfg.slots_per_rank, len(model.moe_layers)
    table = np.stack([fm.global_phy2log.copy() for fm in model.moe_layers])
    plan = plan_shrink(table, 1, 4, 16)
    before = [fm.local_expert_ids.tolist() for fm in model.moe_layers]
    got = model.reshard(1, 3, plan.table)
    changed = sum(int((plan.table[i, S:2 * S] != np.array(before[i])).sum()) for i in range(L))
    assert got["checkpoint"] == changed > 0 and got["kept"] == L * S - changed
    assert model.ep_rank == 1 and model.canary() is None
    rcfg, src = checkpoint_source(cfg)
    for i, fm in enumerate(model.moe_layers):
        assert (fm.ep_rank, fm.ep_size) == (1, 3)
        assert fm.global_phy2log.tolist() == plan.table[i].tolist()
        assert fm.local_expert_ids.tolist() == plan.table[i, S:2 * S].tolist()
        assert fm.routing_plan().phy2log.size == 3 * S
        for s, e in enumerate(fm.local_expert_ids.tolist()):
            assert torch.equal(fm.w13[s], src(i, e)["w13"])
