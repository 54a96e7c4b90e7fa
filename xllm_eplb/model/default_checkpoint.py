"""The built-in default model: a checkpoint generated from ``cfg.model``'s shape fields.

With ``--model`` empty, the run serves a checkpoint that :func:`checkpoint.make_checkpoint`
writes from the config (family ``model_arch``, deepseek_v3 by default), so every process treats
it exactly like ``--model DIR``. The launcher (and ``testing.harness``) call
:func:`with_default_checkpoint` once, before anything is spawned; workers never generate.

Field mapping (ModelConfig -> :class:`checkpoint.CheckpointSpec`): ``num_layers``,
``first_k_dense_replace`` (-> ``first_k_dense``; mixtral and olmoe have no dense layers: 0),
``num_experts``, ``num_experts_per_tok`` (-> ``top_k``), ``n_shared_experts`` (deepseek_v3,
deepseek_v2, glm4_moe and qwen2_moe; qwen3_moe, mixtral and olmoe have none), ``hidden_size``, ``moe_intermediate_size``,
``intermediate_size``, ``num_attention_heads`` (-> ``num_heads``), ``vocab_size``,
``max_position_embeddings``, ``routing_skew``, ``seed`` and ``dtype`` (``auto``: float32).
Everything else (MLA ranks, expert groups, RoPE) takes the generator's family defaults. After
generation :func:`resolve.resolve_config` reads the architecture back from ``config.json``, as
for any checkpoint (so ``scoring_func`` reports the family's router).

Cache: ``{model_cache_dir}/{arch}-{key}`` where ``key`` is the first 16 hex digits of the
sha256 of the resolved spec and of the generator's source (``checkpoint*.py``): the same shape
and seed reuse one folder, a changed generator writes a new one. A folder is written into a
temporary sibling and renamed into place, so a complete ``config.json`` means a complete
checkpoint and concurrent runs never see a half-written one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

from xllm_eplb.config import Config, ModelConfig, layout_error
from xllm_eplb.errors import ConfigError
from xllm_eplb.model import checkpoint, checkpoint_configs, checkpoint_tokenizer
from xllm_eplb.obs.logs import event

log = logging.getLogger(__name__)

# CheckpointSpec field -> the ModelConfig field that sets it (for error messages)
FIELDS = {"num_layers": "num_layers", "first_k_dense": "first_k_dense_replace",
          "num_experts": "num_experts", "top_k": "num_experts_per_tok",
          "n_shared_experts": "n_shared_experts", "hidden_size": "hidden_size",
          "moe_intermediate_size": "moe_intermediate_size",
          "intermediate_size": "intermediate_size", "num_heads": "num_attention_heads",
          "vocab_size": "vocab_size", "max_position_embeddings": "max_position_embeddings",
          "routing_skew": "routing_skew", "seed": "seed", "dtype": "dtype"}
NO_SHARED = ("qwen3_moe", "mixtral", "olmoe", "gpt_oss")


def spec_for(cfg: Config) -> tuple[str, checkpoint.CheckpointSpec]:
    """(family, resolved spec) of the checkpoint ``cfg.model`` describes; raises ConfigError
    naming the config field, its value and the family's rule."""
    m = cfg.model
    arch = m.model_arch
    sizes = dict(num_layers=m.num_layers, first_k_dense=m.first_k_dense_replace,
                 num_experts=m.num_experts, top_k=m.num_experts_per_tok,
                 n_shared_experts=m.n_shared_experts, hidden_size=m.hidden_size,
                 moe_intermediate_size=m.moe_intermediate_size,
                 intermediate_size=m.intermediate_size, num_heads=m.num_attention_heads,
                 vocab_size=m.vocab_size, max_position_embeddings=m.max_position_embeddings,
                 routing_skew=float(m.routing_skew), seed=int(m.seed),
                 dtype="float32" if m.dtype == "auto" else m.dtype)
    if arch in checkpoint.NO_DENSE:
        sizes["first_k_dense"] = 0
    if arch in NO_SHARED:
        sizes["n_shared_experts"] = 0
    elif m.n_shared_experts < 1:
        raise ConfigError(f"n_shared_experts={m.n_shared_experts}: the generated {arch} "
                          f"checkpoint always has a shared expert (>= 1); use "
                          f"--model_arch=qwen3_moe, mixtral, olmoe or gpt_oss for none")
    try:
        return arch, checkpoint.resolve(arch, checkpoint.CheckpointSpec(**sizes))
    except checkpoint.CheckpointError as e:
        raise ConfigError(_config_message(str(e), arch)) from None


def _config_message(msg: str, arch: str) -> str:
    """``make_checkpoint: top_k=9: rule`` -> ``num_experts_per_tok=9: rule (generated ...)``."""
    body = msg.removeprefix("make_checkpoint: ")
    name, _, rest = body.partition("=")
    return (f"{FIELDS.get(name, name)}={rest} (generated default {arch} checkpoint; "
            f"set --model to serve another)")


def cache_key(arch: str, spec: checkpoint.CheckpointSpec) -> str:
    """16 hex digits naming one (family, spec, generator source) combination."""
    h = hashlib.sha256()
    h.update(json.dumps({"arch": arch, "spec": asdict(spec)}, sort_keys=True).encode())
    for mod in (checkpoint, checkpoint_configs, checkpoint_tokenizer):
        h.update(Path(mod.__file__).read_bytes())
    return h.hexdigest()[:16]


#: overrides ``--model_cache_dir``'s default (not a value given): the test suite's own folder
CACHE_ENV = "XLLM_EPLB_MODEL_CACHE_DIR"


def cache_root(cfg: Config) -> Path:
    """``--model_cache_dir``; at its default, ``$XLLM_EPLB_MODEL_CACHE_DIR`` when set."""
    d = cfg.model.model_cache_dir
    if d == ModelConfig().model_cache_dir and os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return Path(d)


def cache_path(cfg: Config) -> Path:
    """The folder the default checkpoint of ``cfg`` lives in (written or not)."""
    arch, spec = spec_for(cfg)
    return cache_root(cfg) / f"{arch}-{cache_key(arch, spec)}"


def ensure_checkpoint(cfg: Config) -> Path:
    """The default checkpoint of ``cfg``, generated into the cache unless already there."""
    arch, spec = spec_for(cfg)
    final = cache_root(cfg) / f"{arch}-{cache_key(arch, spec)}"
    if (final / "config.json").is_file():
        return final
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    except OSError as e:
        raise ConfigError(f"model_cache_dir={cfg.model.model_cache_dir}: cannot create a "
                          f"folder there ({e.strerror})") from None
    t0 = time.perf_counter()
    try:
        checkpoint.make_checkpoint(arch, tmp, force=True, **asdict(spec))
        os.chmod(tmp, 0o755)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "config.json").is_file():   # not a concurrent writer's result
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info(event("model default checkpoint written", path=str(final), arch=arch,
                   seconds=f"{time.perf_counter() - t0:.2f}"))
    return final


def with_default_checkpoint(cfg: Config) -> Config:
    """``cfg`` unchanged when ``--model`` is set, else with ``model`` = the generated default
    checkpoint's folder (absolute, so every process finds it whatever its working folder)."""
    if cfg.model.model:
        return cfg
    m, e = cfg.model, cfg.eplb
    err = layout_error(m.num_experts, e.ep_size, e.redundant_experts_num)
    if err:                   # before writing anything, naming the flags the user gave
        raise ConfigError(err)
    path = ensure_checkpoint(cfg).resolve()
    return replace(cfg, model=replace(cfg.model, model=str(path)))
