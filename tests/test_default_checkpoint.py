"""The built-in default model: a checkpoint generated from the config when --model is empty
(``model.default_checkpoint``), cached by content, written atomically, then served like any
``--model DIR``."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest

from xllm_eplb.config import Config, EplbConfig, ModelConfig
from xllm_eplb.errors import ConfigError
from xllm_eplb.model.checkpoint import make_checkpoint
from xllm_eplb.model.default_checkpoint import cache_path, with_default_checkpoint
from xllm_eplb.model.resolve import resolve_config


def cfg_in(cache, **model) -> Config:
    return Config(eplb=EplbConfig(ep_size=4),
                  model=ModelConfig(model_cache_dir=str(cache), **model))


def test_default_config_serves_make_checkpoints_default_deepseek_v3(tmp_path):
    cfg = with_default_checkpoint(cfg_in(tmp_path / "cache"))
    got = cfg.model.model
    assert os.path.isabs(got) and os.path.dirname(got) == str((tmp_path / "cache").resolve())
    assert os.path.basename(got).startswith("deepseek_v3-")
    ref = make_checkpoint("deepseek_v3", tmp_path / "ref")     # `xllm-eplb make-checkpoint`
    names = sorted(os.listdir(ref))
    assert sorted(os.listdir(got)) == names
    for n in names:                                            # byte-identical files
        assert (ref / n).read_bytes() == open(os.path.join(got, n), "rb").read(), n
    # every process then reads the architecture back from config.json, as for --model
    r = resolve_config(cfg).model
    d = ModelConfig()
    assert (r.num_layers, r.first_k_dense_replace, r.num_experts, r.num_experts_per_tok,
            r.n_shared_experts, r.hidden_size, r.moe_intermediate_size, r.intermediate_size,
            r.num_attention_heads, r.vocab_size, r.max_position_embeddings) == (
        d.num_layers, d.first_k_dense_replace, d.num_experts, d.num_experts_per_tok,
        d.n_shared_experts, d.hidden_size, d.moe_intermediate_size, d.intermediate_size,
        d.num_attention_heads, d.vocab_size, d.max_position_embeddings)
    assert r.scoring_func == "sigmoid" and r.dtype == "float32"


def test_cached_by_shape_and_seed_written_once_without_leftovers(tmp_path):
    cache = tmp_path / "cache"
    small = dict(num_layers=2, num_experts=8, num_experts_per_tok=2, hidden_size=16,
                 vocab_size=300)
    a = with_default_checkpoint(cfg_in(cache, **small)).model.model
    stamp = os.stat(os.path.join(a, "model.safetensors")).st_mtime_ns
    again = with_default_checkpoint(cfg_in(cache, **small, routing_mode="model")).model.model
    assert again == a                                          # reused, not rewritten
    assert os.stat(os.path.join(a, "model.safetensors")).st_mtime_ns == stamp
    other_seed = with_default_checkpoint(cfg_in(cache, **small, seed=1)).model.model
    other_arch = with_default_checkpoint(cfg_in(cache, **small, model_arch="mixtral"))
    assert len({a, other_seed, other_arch.model.model}) == 3
    assert os.path.basename(other_arch.model.model).startswith("mixtral-")
    assert resolve_config(other_arch).model.first_k_dense_replace == 0   # mixtral: no dense
    assert sorted(p.name for p in cache.iterdir() if p.name.startswith(".")) == []
    assert cache_path(cfg_in(cache, **small)).resolve() == type(cache)(a)
    # --model set: left alone, nothing generated
    given = replace(cfg_in(cache), model=replace(cfg_in(cache).model, model=a))
    assert with_default_checkpoint(given) is given


@pytest.mark.parametrize("model,match", [
    (dict(num_experts_per_tok=70), r"num_experts_per_tok=70: must be <= num_experts=64"),
    (dict(first_k_dense_replace=4), r"first_k_dense_replace=4: must be in \[0, num_layers=4\)"),
    (dict(n_shared_experts=0), r"n_shared_experts=0: the generated deepseek_v3 checkpoint"),
    (dict(model_arch="qwen3_moe", hidden_size=30), r"num_attention_heads=4: must divide"),
    (dict(num_experts=18), r"--num_experts=18: must be divisible by --ep_size=4"),
])
def test_bad_sizes_name_the_config_field_and_write_nothing(tmp_path, model, match):
    with pytest.raises(ConfigError, match=match):
        with_default_checkpoint(cfg_in(tmp_path / "cache", **model))
    assert not (tmp_path / "cache").exists() or list((tmp_path / "cache").iterdir()) == []


def test_unwritable_cache_folder_is_one_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match=r"model_cache_dir=.*file/c: cannot create"):
        with_default_checkpoint(cfg_in(blocker / "c"))


def test_workers_never_generate_build_model_needs_the_resolved_folder(tmp_path):
    from xllm_eplb.model.decoder import build_model

    with pytest.raises(ValueError, match="cfg.model.model is empty"):
        build_model(cfg_in(tmp_path / "cache"), 0)
    assert not (tmp_path / "cache").exists()


def test_at_its_default_the_cache_folder_comes_from_the_environment(tmp_path, monkeypatch):
    # issue 35: the suite builds into its own folder (conftest), not the clone's .cache
    from xllm_eplb.model.default_checkpoint import CACHE_ENV, cache_root

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "env"))
    cfg = Config(eplb=EplbConfig(ep_size=4))
    assert cache_root(cfg) == tmp_path / "env"
    assert cache_path(cfg).parent == tmp_path / "env"
    given = cfg_in(tmp_path / "mine")                     # a folder given wins
    assert cache_root(given) == tmp_path / "mine"
    monkeypatch.delenv(CACHE_ENV)
    assert str(cache_root(cfg)) == ".cache/checkpoints"
