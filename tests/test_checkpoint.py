"""`make_checkpoint` / `xllm-eplb make-checkpoint`: the folders load in transformers as they are
(no missing or unexpected keys, config.json as transformers saves it) and their routers carry the
designed topic skew, which moves when the workload's topic mix drifts."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors import safe_open

from xllm_eplb.engine.workload import TopicPrompts, topic_of_rank, zipf_probs
from xllm_eplb.model.checkpoint import (
    ARCHS,
    TOPICS_FILE,
    CheckpointError,
    make_checkpoint,
    read_topics,
)

os.environ["HF_HUB_OFFLINE"] = "1"
import transformers  # noqa: E402 (the oracle; a dev dependency, never skipped)

pytestmark = pytest.mark.oracle

FILES = {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
         "tokenizer_config.json", TOPICS_FILE}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {a: make_checkpoint(a, root / a) for a in ARCHS}


def _hf_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager",
        output_loading_info=True)


def _keys(path):
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape()))
                for k in f.keys()}


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_loads_it_with_no_missing_or_unexpected_keys(folders, arch):
    path = folders[arch]
    assert {p.name for p in path.iterdir()} == FILES
    model, info = _hf_model(path)
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        assert not info.get(kind), (kind, info[kind])
    assert model.config.model_type == arch
    sd = model.state_dict()
    with safe_open(str(path / "model.safetensors"), "pt") as f:   # the values, not just names
        emb = f.get_tensor("model.embed_tokens.weight")
    assert torch.equal(sd["model.embed_tokens.weight"], emb)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    assert len(tok) <= model.config.vocab_size


@pytest.mark.parametrize("arch", ARCHS)
def test_config_json_is_what_transformers_saves(folders, arch, tmp_path):
    ours = json.loads((folders[arch] / "config.json").read_text())
    cls = transformers.AutoConfig.for_model(arch).__class__
    fields = {k: v for k, v in ours.items() if k not in ("architectures", "model_type")}
    cfg = cls(**fields)
    cfg.architectures = ours["architectures"]
    cfg.save_pretrained(tmp_path)
    theirs = json.loads((tmp_path / "config.json").read_text())
    theirs.pop("transformers_version")
    assert ours == theirs


def test_deepseek_v3_uses_the_hub_key_names(folders):
    keys = _keys(folders["deepseek_v3"])
    attn = ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm",
            "kv_b_proj", "o_proj")
    for L in range(4):
        for a in attn:
            assert f"model.layers.{L}.self_attn.{a}.weight" in keys
    assert {f"model.layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down")} <= set(keys)
    assert not any(k.startswith("model.layers.0.mlp.experts") for k in keys)
    for L in (1, 2, 3):
        p = f"model.layers.{L}.mlp."
        assert keys[p + "gate.weight"] == ("F32", (64, 64))
        assert keys[p + "gate.e_score_correction_bias"] == ("F32", (64,))
        for e in range(64):
            assert keys[p + f"experts.{e}.gate_proj.weight"] == ("F32", (32, 64))
            assert keys[p + f"experts.{e}.down_proj.weight"] == ("F32", (64, 32))
        assert keys[p + "shared_experts.up_proj.weight"] == ("F32", (32, 64))
    assert "lm_head.weight" in keys and "model.norm.weight" in keys


def test_bfloat16_and_tied_embeddings(tmp_path):
    p32 = make_checkpoint("qwen3_moe", tmp_path / "f32", num_experts=8, top_k=2)
    p16 = make_checkpoint("qwen3_moe", tmp_path / "b16", num_experts=8, top_k=2,
                          dtype="bfloat16", tie_word_embeddings=True)
    k32, k16 = _keys(p32), _keys(p16)
    assert "lm_head.weight" in k32 and "lm_head.weight" not in k16
    assert {d for d, _ in k16.values()} == {"BF16"}
    with safe_open(str(p32 / "model.safetensors"), "pt") as a, \
            safe_open(str(p16 / "model.safetensors"), "pt") as b:
        k = "model.layers.1.mlp.experts.3.up_proj.weight"
        assert torch.equal(a.get_tensor(k).to(torch.bfloat16), b.get_tensor(k))
    assert json.loads((p16 / "config.json").read_text())["dtype"] == "bfloat16"
    _, info = _hf_model(p16)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ds = make_checkpoint("deepseek_v3", tmp_path / "ds16", num_experts=8, top_k=2,
                         dtype="bfloat16")
    kd = _keys(ds)
    assert kd["model.layers.1.mlp.gate.e_score_correction_bias"][0] == "F32"   # as in HF
    assert kd["model.layers.1.mlp.gate.weight"][0] == "BF16"


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path):
    a = make_checkpoint("mixtral", tmp_path / "a", num_experts=8, top_k=2, seed=3)
    b = make_checkpoint("mixtral", tmp_path / "b", num_experts=8, top_k=2, seed=3)
    c = make_checkpoint("mixtral", tmp_path / "c", num_experts=8, top_k=2, seed=4)
    for name in FILES:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()


def _selection_histograms(path, prompts: list[list[int]]) -> dict[int, np.ndarray]:
    """Per MoE layer and prompt: share of transformers' top-k selections per expert,
    float [prompts, E] (each row sums to 1)."""
    model, _ = _hf_model(path)
    rec: dict[int, list] = {}
    for name, mod in model.named_modules():
        if name.endswith(".gate") and "Router" in type(mod).__name__:   # returns (logits, w, ids)
            layer = int(name.split(".")[2])
            mod.register_forward_hook(
                lambda _m, _i, out, layer=layer: rec.setdefault(layer, []).append(out[2]))
    with torch.no_grad():
        model(torch.tensor(prompts))
    E, B = model.config.num_local_experts, len(prompts)
    out = {}
    for L, v in sorted(rec.items()):
        ids = torch.cat(v).reshape(B, -1).numpy()                      # [B, tokens * k]
        out[L] = np.stack([np.bincount(r, minlength=E) for r in ids]) / ids.shape[1]
    return out


def _topic_histograms(path, per_topic: int = 4, length: int = 16):
    """Per MoE layer: the mean selection histogram of prompts drawn from each topic by the
    workload's prompt generator (the new tokenizer's vocabulary), float [T, E]."""
    prompts = TopicPrompts.for_checkpoint(str(path))
    rng = np.random.default_rng(0)
    batch = [prompts.prompt(t, length, rng) for t in range(prompts.num_topics)
             for _ in range(per_topic)]
    hist = _selection_histograms(path, batch)
    return {L: h.reshape(prompts.num_topics, per_topic, -1).mean(axis=1) for L, h in hist.items()}


def _mix(elapsed: float, T: int) -> np.ndarray:
    """The synthetic workload's topic probabilities after ``elapsed`` s (Zipf 1.2, drift 100 s)."""
    p = np.zeros(T)
    for rank, q in enumerate(zipf_probs(T, 1.2)):
        p[topic_of_rank(rank, elapsed, T, 100.0)] += q
    return p


def test_routers_are_skewed_by_the_workload_topic_mix_and_the_skew_drifts(folders):
    """Run in transformers: prompts of each topic send most selections to the topic's home
    experts; under the workload's Zipf mix the expert histogram is strongly non-uniform, and
    after one drift step its hot set moves to the next topic's homes."""
    path = folders["deepseek_v3"]
    info = read_topics(path)
    torch.set_num_threads(1)
    per_topic = _topic_histograms(path)
    T, E = info["num_topics"], 64
    assert T == 16
    mix0, mix1 = _mix(0.0, T), _mix(150.0, T)
    assert mix0.argmax() == 0 and mix1.argmax() == 1
    last = max(per_topic)
    for L, h in per_topic.items():
        homes = np.asarray(info["home_experts"][L - info["first_moe_layer"]])   # [T, E // T]
        uniform = homes.shape[1] / E
        own = np.array([h[t, homes[t]].sum() for t in range(T)])
        before, after = mix0 @ h, mix1 @ h                            # expected histograms [E]
        print(f"layer {L}: own-home share min {own.min():.3f} mean {own.mean():.3f} "
              f"(uniform {uniform:.4f}); mix max*E {before.max() * E:.2f}; hot homes "
              f"{before[homes[0]].sum():.3f} -> {after[homes[0]].sum():.3f}, next "
              f"{before[homes[1]].sum():.3f} -> {after[homes[1]].sum():.3f}; TV "
              f"{0.5 * np.abs(before - after).sum():.3f}")
        assert own.min() > 2 * uniform and own.mean() > 4 * uniform, (L, own)  # hot sets
        assert before.max() > 3.0 / E, (L, before.max())              # strongly non-uniform
        assert before[homes[0]].sum() > 2 * uniform, L                # hot: topic 0's homes
        assert after[homes[1]].sum() > 2 * uniform, L                 # drifted: topic 1's homes
        assert after[homes[0]].sum() < 0.5 * before[homes[0]].sum(), L
        if L == last:
            assert before[homes[0]].sum() > 3 * uniform
            assert set(np.argsort(-before)[:3]) <= set(homes[0])
            assert 0.5 * np.abs(before - after).sum() > 0.25          # total variation


def test_zero_skew_routes_near_uniformly(tmp_path):
    """Control: the same checkpoint with routing_skew=0 has no topic structure to follow."""
    path = make_checkpoint("deepseek_v3", tmp_path / "flat", routing_skew=0.0)
    info = read_topics(path)
    torch.set_num_threads(1)
    for L, h in _topic_histograms(path, per_topic=2).items():
        homes = np.asarray(info["home_experts"][L - info["first_moe_layer"]])
        own = np.array([h[t, homes[t]].sum() for t in range(len(homes))])
        assert own.mean() < 2 * homes.shape[1] / 64, (L, own.mean())


def test_bad_specs_raise_one_clear_error(tmp_path):
    cases = [(dict(arch="llama"), "arch='llama'"),
             (dict(num_experts=10, top_k=2, n_group=4), "n_group=4"),
             (dict(top_k=80), "top_k=80"),
             (dict(vocab_size=100), "vocab_size=100"),
             (dict(arch="mixtral", first_k_dense=1), "mixtral has no dense layers"),
             (dict(num_layers=2, first_k_dense=2), "first_k_dense=2"),
             (dict(dtype="int8"), "dtype='int8'"),
             (dict(hidden_sizes=3), "hidden_sizes=3: unknown size")]
    for kw, msg in cases:
        with pytest.raises(CheckpointError, match=msg.replace("(", r"\(")):
            make_checkpoint(out=tmp_path / "x", **kw)
        assert not (tmp_path / "x").exists()                          # nothing written


def _cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "xllm_eplb", "make-checkpoint", *map(str, args)],
                          cwd=cwd, capture_output=True, text=True, timeout=120)


def test_cli_writes_refuses_a_non_empty_folder_and_reports_bad_input(tmp_path):
    r = _cli("--arch", "qwen2_moe", "--out", "q", "--num-experts", "8", "--top-k", "2",
             "--seed", "7", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("wrote q arch=qwen2_moe seed=7") and "bytes=" in r.stdout
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())
    assert cfg["num_experts"] == 8 and cfg["model_type"] == "qwen2_moe"
    before = (tmp_path / "q" / "model.safetensors").read_bytes()
    r = _cli("--arch", "qwen2_moe", "--out", "q", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.startswith("error: --out=q: folder is not empty")
    assert len(r.stderr.strip().splitlines()) == 1
    assert (tmp_path / "q" / "model.safetensors").read_bytes() == before
    r = _cli("--arch", "qwen2_moe", "--out", "q", "--num-experts", "8", "--top-k", "2",
             "--force", cwd=tmp_path)
    assert r.returncode == 0 and (tmp_path / "q" / "model.safetensors").read_bytes() != before
    r = _cli("--out", "d", "--num-experts", "12", "--top-k", "13", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.strip() == \
        "error: make_checkpoint: top_k=13: must be <= num_experts=12"
    assert not (tmp_path / "d").exists()
    (tmp_path / "file").write_text("x")
    r = _cli("--out", "file", cwd=tmp_path)
    assert r.returncode == 2 and "exists and is not a folder" in r.stderr
