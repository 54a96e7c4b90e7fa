"""Flag names users bring from other engines (vLLM, SGLang), and flags with a bare form.

- :data:`ALIASES`: another engine's name for one of our fields with the same meaning
  (``--max-model-len`` is ``--max_position_embeddings``); accepted on the command line, in
  flagfiles and config files.
- :data:`FOREIGN`: another engine's flag for a feature this engine does not have; using one is
  an error that says so (instead of a "did you mean" guess).
- :data:`BARE`: a choice field that also reads like a boolean: ``--workload`` alone is
  ``--workload=synthetic``, ``--noworkload`` is ``--workload=none``.

Names are in the ``_`` spelling (``-`` is normalised before the lookup).
"""

from __future__ import annotations

import dataclasses

from xllm_eplb.errors import ConfigError

#: other engine's flag -> our field (same meaning)
ALIASES: dict[str, str] = {
    "max_model_len": "max_position_embeddings",      # vLLM (prompt + output positions)
    "context_length": "max_position_embeddings",     # SGLang
    "max_num_seqs": "max_batch_size",                # vLLM: rows per DP rank (= EP rank) per step
    "max_running_requests": "max_batch_size",        # SGLang
    "chunked_prefill_size": "max_prefill_tokens",    # SGLang: prefill chunk per rank per step
    "model_path": "model",                           # SGLang
    "tokenizer_path": "tokenizer",                   # SGLang
    "expert_parallel_size": "ep_size",               # SGLang
    "num_redundant_experts": "redundant_experts_num",  # vLLM (extra physical experts per rank)
}

_NO_TP = ("this engine has no tensor parallelism: every EP rank holds the whole attention and "
          "dense layers and a share of the routed experts; set the ranks with --ep-size")
_NO_PP = "this engine has no pipeline parallelism: set the ranks with --ep-size"
_DP = ("this engine runs one data-parallel attention rank per EP rank: the DP size is "
       "--ep-size")

#: other engine's flag for a feature we do not have -> why (the error text)
FOREIGN: dict[str, str] = {
    "tensor_parallel_size": _NO_TP,
    "tp_size": _NO_TP,
    "tp": _NO_TP,
    "pipeline_parallel_size": _NO_PP,
    "pp_size": _NO_PP,
    "data_parallel_size": _DP,
    "dp_size": _DP,
    "dp": _DP,
    "enable_expert_parallel": "expert parallelism is always on in this engine: set the EP ranks "
                              "with --ep-size",
    "gpu_memory_utilization": "this engine has no preallocated KV-cache pool to size: each "
                              "rank's KV cache grows with its requests (--max_batch_size rows)",
    "mem_fraction_static": "this engine has no preallocated KV-cache pool to size: each rank's "
                           "KV cache grows with its requests (--max_batch_size rows)",
    "enable_prefix_caching": "this engine has no prefix caching",
    "speculative_config": "this engine has no speculative decoding",
    "speculative_algorithm": "this engine has no speculative decoding",
    "trust_remote_code": "this engine runs no model code from the checkpoint: its eight "
                         "families (deepseek_v3, deepseek_v2, glm4_moe, gpt_oss, qwen3_moe, "
                         "qwen2_moe, mixtral, olmoe) are built in",
    "quantization": "this engine takes the quantization from the checkpoint's config.json "
                    "(block-wise FP8 checkpoints are served as they are; --fp8_dequant_cache "
                    "keeps dequantized copies): no flag chooses it",
    "kv_cache_dtype": "this engine keeps the KV cache in the model's --dtype: there is no "
                      "separate KV-cache dtype",
    "enforce_eager": "this engine always runs eagerly (no CUDA graphs, no torch.compile): "
                     "there is nothing to turn off; drop the flag",
    "disable_log_requests": "this engine logs no request contents: there is nothing to turn "
                            "off; drop the flag",
    "enable_log_requests": "this engine logs no request contents (the stats line counts "
                           "requests every --log_stats_interval seconds)",
    "disable_log_stats": "the stats line is --log_stats_interval (seconds; 0 turns it off)",
    "eplb_config": "vLLM's JSON of EPLB settings has no single counterpart: each setting is its "
                   "own flag here: --eplb_update_interval (seconds, not steps), "
                   "--redundant_experts_num (vLLM's num_redundant_experts), "
                   "--eplb_policy_kind, --eplb_first_round_samples (docs/configuration.md)",
    "eplb_window_size": "this engine's load window is every sample since the last commit, "
                        "halved at each round: there is no window size to set",
    "eplb_step_interval": "this engine paces EPLB rounds in seconds: --eplb_update_interval "
                          "(and --eplb_first_round_samples for the first round)",
    "max_num_batched_tokens": "this engine budgets prefill tokens per EP rank per step: use "
                              "--max_prefill_tokens (longer prompts are prefilled in chunks); "
                              "decode rows are bounded by --max_batch_size",
}

#: choice field -> (value of the bare ``--name``, value of ``--noname``)
BARE: dict[str, tuple[str, str]] = {
    "workload": ("synthetic", "none"),
}


#: single-dash short flags of other engines (vLLM's ``-tp 2``) -> the long name they stand for
SHORT: dict[str, str] = {"tp": "tensor_parallel_size", "pp": "pipeline_parallel_size",
                         "dp": "data_parallel_size", "q": "quantization"}


def short_flag(tok: str) -> str:
    """The error text of a single-dash token (``-tp``): another engine's short flag gets the
    same reason as its long form; anything else says how flags look here."""
    name = tok[1:].partition("=")[0].replace("-", "_")
    long = SHORT.get(name, name)
    if long in FOREIGN:
        return f"{tok.partition('=')[0]}: {FOREIGN[long]}"
    return (f"unexpected argument '{tok}': flags look like --name=value (two dashes; "
            f"'xllm-eplb serve --help' lists them)")


def canonical(name: str, shown: str) -> str:
    """Our field name for flag ``name`` (``_`` spelling); ConfigError for a :data:`FOREIGN`
    flag (``shown``: the flag as the user wrote it)."""
    if name in FOREIGN:
        raise ConfigError(f"{shown}: {FOREIGN[name]}")
    return ALIASES.get(name, name)


def with_served_alias(cfg):
    """``cfg`` whose ``--served_model_alias`` is the ``--model`` string as given when none was
    set: vLLM serves a model under the name it was started with (the path, or ORG/NAME), so a
    client written for vLLM sends that name; this engine answers to it beside
    ``--served_model_name``. Unchanged without ``--model``."""
    s, m = cfg.serve, cfg.model
    if s.served_model_alias or not m.model or m.model == s.served_model_name:
        return cfg
    return dataclasses.replace(cfg, serve=dataclasses.replace(s, served_model_alias=m.model))
