"""``xllm-eplb make-checkpoint``: write a tiny Hugging Face-format MoE checkpoint.

Example::

    xllm-eplb make-checkpoint --arch qwen3_moe --out /tmp/qwen3-tiny
    xllm-eplb make-checkpoint --arch deepseek_v3 --quant fp8 --block-size 16 --out /tmp/ds-fp8
    xllm-eplb serve --model /tmp/qwen3-tiny --ep-size 4

(``serve`` without ``--model`` generates such a checkpoint from its own config, see
:mod:`xllm_eplb.model.default_checkpoint`.)

The folder (``config.json``, ``model.safetensors``, ``generation_config.json``,
``tokenizer.json``, ``tokenizer_config.json``, ``xllm_eplb_topics.json``) loads in transformers'
``AutoModelForCausalLM`` / ``AutoTokenizer`` as it is; its routers carry a deliberate topic skew
(see :mod:`xllm_eplb.model.checkpoint`). A non-empty ``--out`` is refused unless ``--force``.
Prints one line: the folder, family, sizes and bytes written.
"""

from __future__ import annotations

import click

from xllm_eplb.cli import handle_user_errors

ARCHS = ("deepseek_v3", "qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v2", "glm4_moe",
         "gpt_oss")
DTYPES = ("float32", "bfloat16", "float16", "float64")

# option name -> (CheckpointSpec field, type, help)
SIZE_OPTIONS = {
    "--num-layers": ("num_layers", int, "decoder layers (default 4)"),
    "--dense-layers": ("first_k_dense", int, "leading dense layers (default 1; mixtral, olmoe "
                       "and gpt_oss 0)"),
    "--num-experts": ("num_experts", int, "routed experts per MoE layer (default 64)"),
    "--top-k": ("top_k", int, "experts per token (default 4)"),
    "--shared-experts": ("n_shared_experts", int, "shared experts, deepseek_v3/deepseek_v2/"
                         "glm4_moe/qwen2_moe (default 1)"),
    "--hidden-size": ("hidden_size", int, "model width (default 64)"),
    "--moe-intermediate-size": ("moe_intermediate_size", int, "expert FFN width (default 32)"),
    "--intermediate-size": ("intermediate_size", int, "dense FFN width (default 128)"),
    "--num-heads": ("num_heads", int, "attention heads (default 4)"),
    "--num-kv-heads": ("num_kv_heads", int, "key/value heads (default heads/2; deepseek "
                       "MLA: heads)"),
    "--vocab-size": ("vocab_size", int, "vocabulary incl. 4 special tokens (default 512)"),
    "--max-position-embeddings": ("max_position_embeddings", int, "longest sequence "
                                  "(default 2048)"),
    "--routing-skew": ("routing_skew", float, "topic/router alignment strength, 0 = none "
                       "(default 1.0)"),
}


def _size_options(fn):
    for flag, (field, typ, help_) in reversed(SIZE_OPTIONS.items()):
        fn = click.option(flag, field, type=typ, default=None, help=help_)(fn)
    return fn


@click.command("make-checkpoint")
@click.option("--arch", type=click.Choice(ARCHS), default="deepseek_v3", show_default=True,
              help="model family")
@click.option("--out", required=True, help="output folder (created if missing)")
@click.option("--seed", type=int, default=0, show_default=True, help="weight seed")
@click.option("--dtype", type=click.Choice(DTYPES), default="float32", show_default=True,
              help="tensor dtype (the router bias stays float32)")
@click.option("--tie-word-embeddings", is_flag=True, help="no lm_head.weight: tied to the "
              "embedding")
@click.option("--force", is_flag=True, help="write into a non-empty folder")
@click.option("--quant", type=click.Choice(["none", "fp8", "mxfp4"]), default="none",
              show_default=True,
              help="fp8: every block-aligned decoder Linear as float8_e4m3fn + one "
              "weight_scale_inv per block (DeepSeek-V3 / Qwen3 FP8 format); the others stay in "
              "--dtype and are listed in quantization_config.modules_to_not_convert. mxfp4 "
              "(gpt_oss only): the routed experts as MXFP4 blocks + e8m0 scales, gpt-oss's "
              "hub format")
@click.option("--block-size", type=click.IntRange(min=1), default=128, show_default=True,
              help="--quant fp8: rows and columns per scale block")
@click.option("--scale-dtype", type=click.Choice(["float32", "bfloat16", "float16"]),
              default="float32", show_default=True, help="--quant fp8: dtype of the scales")
@_size_options
@handle_user_errors
def make_checkpoint(arch, out, seed, dtype, tie_word_embeddings, force, quant, block_size,
                    scale_dtype, **sizes) -> None:
    """Write a tiny HF-format MoE checkpoint with a skewed, drifting-workload-ready router."""
    from xllm_eplb.model.checkpoint import make_checkpoint as make

    given = {k: v for k, v in sizes.items() if v is not None}
    q = None if quant == "none" else quant
    p = make(arch, out, force=force, seed=seed, dtype=dtype,
             tie_word_embeddings=tie_word_embeddings, quant=q, block_size=block_size,
             scale_dtype=scale_dtype, **given)
    total = sum(f.stat().st_size for f in p.iterdir() if f.is_file())
    shown = " ".join(f"{k}={v}" for k, v in sorted(given.items()))
    if q:
        shown += f" quant={q} block_size={block_size} scale_dtype={scale_dtype}"
    click.echo(f"wrote {p} arch={arch} seed={seed} dtype={dtype} {shown.strip()}".rstrip()
               + f" bytes={total}")
