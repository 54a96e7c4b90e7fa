"""``make_checkpoint``: write a tiny Hugging Face-format MoE checkpoint with a deliberate routing skew.

The folder it writes is what ``save_pretrained`` of transformers would write for the family
(``deepseek_v3``, ``qwen3_moe``, ``qwen2_moe``, ``mixtral``, ``olmoe``, ``deepseek_v2``,
``glm4_moe``, ``gpt_oss``; gpt_oss's experts fused as its hub files hold them, unquantized), so transformers and this engine load
the same files; nothing here imports transformers:

- ``config.json``: the family's config as transformers 5 saves it (same keys, same values, no
  ``transformers_version``), see :mod:`xllm_eplb.model.checkpoint_configs`;
- ``model.safetensors``: the hub key names (per-expert tensors, ``e_score_correction_bias`` in
  fp32), every tensor in ``dtype``;
- ``generation_config.json``; ``tokenizer.json`` + ``tokenizer_config.json`` (a byte-level BPE
  trained on a fixed corpus, chat template), see :mod:`xllm_eplb.model.checkpoint_tokenizer`;
- ``xllm_eplb_topics.json``: which tokens belong to which topic and which experts serve it (read
  by the synthetic workload, ignored by transformers).

Untrained routers route near-uniformly, so the weights build the skew in:

- token id ``v`` belongs to topic ``v % T`` with ``T = min(16, E // top_k)``; topic ``t`` has a
  unit direction ``dir[t]`` [H]; embedding row ``v = sqrt(H) * (skew * dir[topic(v)] + noise)``,
  noise ~ N(0, 1/H) per entry;
- in MoE layer ``l`` topic ``t`` has ``E // T`` *home experts* (a seeded permutation per layer);
  their router rows are noise plus ``gain_l * (1 - 0.12 j) * dir[t]`` (j = rank among the
  homes), ``gain_l`` growing with depth from 0.3 to 1.0 times ``skew``;
- branch outputs are small (output projections drawn with std ``0.25 / sqrt(fan_in)``), so the
  residual stream stays dominated by the token's topic direction and a prompt drawn from topic
  ``t`` sends most of its tokens to t's home experts; the LM head is ``embed / sqrt(H)``, so
  greedy output stays in the prompt's topic (decode load is skewed too).

Every tensor is drawn in float64 from its own generator seeded by ``(seed, key)`` and cast to
``dtype``: a float32 and a bfloat16 checkpoint hold the same values up to rounding.
"""

from __future__ import annotations

import json
import os
import tempfile
import zlib
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save

from xllm_eplb.errors import UserError
from xllm_eplb.model import checkpoint_tokenizer as ctok
from xllm_eplb.model import fp8, mxfp4
from xllm_eplb.model.checkpoint_configs import generation_config, hf_config, tensor_shapes

ARCHS = ("deepseek_v3", "qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v2", "glm4_moe",
         "gpt_oss")
NO_DENSE = ("mixtral", "olmoe", "gpt_oss")          # every layer MoE
GROUPED = ("deepseek_v3", "deepseek_v2", "glm4_moe")  # n_group / topk_group routers
MLA = ("deepseek_v3", "deepseek_v2")
SHARED = ("deepseek_v3", "deepseek_v2", "glm4_moe", "qwen2_moe")   # always a shared expert
NO_RENORM = ("qwen2_moe", "olmoe", "deepseek_v2")   # norm_topk_prob False by default
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}
MAX_TOPICS = 16
TOPICS_FILE = "xllm_eplb_topics.json"
TOPICS_FORMAT = "xllm-eplb topics v1"


class CheckpointError(UserError):
    """A checkpoint specification or output folder that cannot be used."""


@dataclass(frozen=True)
class CheckpointSpec:
    """Sizes of a generated checkpoint. ``None`` = the family's default (see :func:`resolve`).

    Defaults match the engine's tiny CPU model: 4 layers (1 dense), 64 experts top-4, hidden 64,
    vocabulary 512 (a 508-token BPE + 4 special tokens), fp32.
    """

    num_layers: int = 4
    first_k_dense: int | None = None        # 1; mixtral/olmoe/gpt_oss: 0 (none)
    num_experts: int = 64
    top_k: int = 4
    n_shared_experts: int = 1               # deepseek / glm4_moe shared experts, qwen2_moe's one
    hidden_size: int = 64
    moe_intermediate_size: int = 32
    intermediate_size: int = 128            # dense layers' FFN width
    num_heads: int = 4
    num_kv_heads: int | None = None         # GQA families: num_heads // 2 (MLA: num_heads)
    head_dim: int | None = None             # qwen3_moe/glm4_moe head_dim (default hidden/heads)
    q_lora_rank: int = 32
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    n_group: int | None = None              # GROUPED: largest of 8/4/2/1 dividing E, >= 2 each
    topk_group: int | None = None           # GROUPED: half the groups (at least 1)
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool | None = None      # True; NO_RENORM families: False
    tie_word_embeddings: bool = False
    vocab_size: int = 512
    max_position_embeddings: int = 2048
    rope_theta: float | None = None         # 10000 (mixtral: 1e6, gpt_oss: 1.5e5)
    rms_norm_eps: float | None = None       # 1e-6 (mixtral: 1e-5)
    routing_skew: float = 1.0
    seed: int = 0
    dtype: str = "float32"


def _fail(field: str, value, rule: str):
    raise CheckpointError(f"make_checkpoint: {field}={value!r}: {rule}")


def _auto_groups(E: int) -> int:
    for g in (8, 4, 2):
        if E % g == 0 and E // g >= 2:
            return g
    return 1


def resolve(arch: str, spec: CheckpointSpec) -> CheckpointSpec:
    """Fill the family defaults into ``spec`` and check it; raises CheckpointError."""
    if arch not in ARCHS:
        _fail("arch", arch, f"must be one of {', '.join(ARCHS)}")
    mixtral, ds, mla = arch == "mixtral", arch in GROUPED, arch in MLA
    s = replace(
        spec,
        first_k_dense=(0 if arch in NO_DENSE else 1) if spec.first_k_dense is None
        else spec.first_k_dense,
        num_kv_heads=spec.num_kv_heads or (spec.num_heads if mla else max(1, spec.num_heads // 2)),
        norm_topk_prob=(arch not in NO_RENORM) if spec.norm_topk_prob is None
        else spec.norm_topk_prob,
        rope_theta=spec.rope_theta or (1e6 if mixtral else 1.5e5 if arch == "gpt_oss" else 1e4),
        rms_norm_eps=spec.rms_norm_eps or (1e-5 if mixtral else 1e-6))
    if s.n_group is None:
        s = replace(s, n_group=_auto_groups(s.num_experts) if ds else None)
    if ds and s.topk_group is None:
        s = replace(s, topk_group=max(1, s.n_group // 2))
    _check(arch, s)
    return s


def _check(arch: str, s: CheckpointSpec) -> None:
    for f in ("num_layers", "num_experts", "top_k", "hidden_size", "moe_intermediate_size",
              "intermediate_size", "num_heads", "num_kv_heads", "q_lora_rank", "kv_lora_rank",
              "qk_nope_head_dim", "v_head_dim", "max_position_embeddings"):
        if getattr(s, f) < 1:
            _fail(f, getattr(s, f), "must be >= 1")
    if s.dtype not in DTYPES:
        _fail("dtype", s.dtype, f"must be one of {', '.join(DTYPES)}")
    if not 0 <= s.first_k_dense < s.num_layers:
        _fail("first_k_dense", s.first_k_dense, f"must be in [0, num_layers={s.num_layers})")
    if arch in NO_DENSE and s.first_k_dense:
        _fail("first_k_dense", s.first_k_dense, f"{arch} has no dense layers (use 0)")
    if s.top_k > s.num_experts:
        _fail("top_k", s.top_k, f"must be <= num_experts={s.num_experts}")
    if s.qk_rope_head_dim < 2 or s.qk_rope_head_dim % 2:
        _fail("qk_rope_head_dim", s.qk_rope_head_dim, "must be even and >= 2")
    hd = s.head_dim or s.hidden_size // s.num_heads
    if arch == "olmoe" and hd * s.num_heads != s.hidden_size:
        _fail("head_dim", hd, f"olmoe's q_norm spans hidden_size: must be hidden_size / "
              f"num_heads = {s.hidden_size}/{s.num_heads}")
    if arch == "glm4_moe" and hd % 4:
        _fail("head_dim", hd, "glm4_moe rotates half of each head: must be a multiple of 4")
    if arch not in MLA:
        if s.head_dim is None and s.hidden_size % s.num_heads:
            _fail("num_heads", s.num_heads, f"must divide hidden_size={s.hidden_size}")
        if hd % 2:
            _fail("head_dim", hd, "must be even (RoPE rotates pairs)")
        if s.num_heads % s.num_kv_heads:
            _fail("num_kv_heads", s.num_kv_heads, f"must divide num_heads={s.num_heads}")
    if arch in GROUPED:
        if s.num_experts % s.n_group or s.num_experts // s.n_group < 2:
            _fail("n_group", s.n_group, f"must divide num_experts={s.num_experts} into groups "
                  "of >= 2 experts")
        if not 1 <= s.topk_group <= s.n_group:
            _fail("topk_group", s.topk_group, f"must be in [1, n_group={s.n_group}]")
        if s.top_k > s.topk_group * (s.num_experts // s.n_group):
            _fail("top_k", s.top_k, "must be <= topk_group * experts per group")
    if arch in SHARED and s.n_shared_experts < 1:
        _fail("n_shared_experts", s.n_shared_experts, f"{arch} always has a shared expert (>= 1)")
    if s.vocab_size < 256 + ctok.NUM_SPECIAL + 1:
        _fail("vocab_size", s.vocab_size, f"must be >= {256 + ctok.NUM_SPECIAL + 1} "
              f"(256 byte tokens + {ctok.NUM_SPECIAL} special tokens + 1 merge)")
    if s.routing_skew < 0:
        _fail("routing_skew", s.routing_skew, "must be >= 0")
    if s.seed < 0:
        _fail("seed", s.seed, "must be >= 0")


# --- topics -----------------------------------------------------------------------------------

def num_topics(num_experts: int, top_k: int) -> int:
    """Topic clusters: min(16, E // top_k), at least 1."""
    return max(1, min(MAX_TOPICS, num_experts // max(1, top_k)))


def topic_directions(seed: int, T: int, H: int) -> torch.Tensor:
    """Unit topic directions, float64 [T, H]."""
    d = randn(seed, "topic_directions", (T, H), 1.0)
    return d / d.norm(dim=1, keepdim=True)


def home_experts(seed: int, E: int, T: int, moe_layer: int) -> np.ndarray:
    """Home experts of every topic in one MoE layer (0-based among MoE layers), int64
    [T, E // T], disjoint rows; a seeded permutation per layer so hot sets differ by layer."""
    perm = np.random.default_rng([int(seed), 4242, int(moe_layer)]).permutation(E)
    m = E // T
    return perm[: T * m].reshape(T, m).astype(np.int64)


def layer_gain(skew: float, moe_layer: int, num_moe_layers: int) -> float:
    """Router alignment gain of a MoE layer: 0.3 .. 1.0 times ``skew`` with depth."""
    return float(skew) * (0.3 + 0.7 * moe_layer / max(1, num_moe_layers - 1))


# --- tensors ----------------------------------------------------------------------------------

def randn(seed: int, name: str, shape: tuple[int, ...], std: float) -> torch.Tensor:
    """float64 N(0, std^2) tensor, a pure function of (seed, name, shape)."""
    g = torch.Generator()
    g.manual_seed((int(seed) * 1_000_003 + zlib.crc32(name.encode())) % (1 << 62))
    return torch.randn(shape, generator=g, dtype=torch.float64) * std


def _embedding(s: CheckpointSpec, T: int) -> torch.Tensor:
    H, V = s.hidden_size, s.vocab_size
    dirs = topic_directions(s.seed, T, H)
    topic = torch.arange(V) % T
    return H ** 0.5 * (s.routing_skew * dirs[topic] + randn(s.seed, "embed", (V, H), H ** -0.5))


def _router(s: CheckpointSpec, key: str, T: int, moe_layer: int, num_moe: int) -> torch.Tensor:
    E, H = s.num_experts, s.hidden_size
    g = randn(s.seed, key, (E, H), H ** -0.5)
    dirs = topic_directions(s.seed, T, H)
    gain = layer_gain(s.routing_skew, moe_layer, num_moe)
    for t, homes in enumerate(home_experts(s.seed, E, T, moe_layer).tolist()):
        for j, e in enumerate(homes):
            g[e] += gain * (1.0 - 0.12 * j) * dirs[t]
    return g


OUT_PROJ = ("o_proj", "down_proj", "w2")


def _value(s: CheckpointSpec, key: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Seeded value of an ordinary tensor: norms 1 + N(0, 0.05^2); biases N(0, 0.02^2);
    output projections N(0, (0.25 / sqrt(fan_in))^2); other matrices N(0, 1 / fan_in)."""
    if "norm" in key:
        return 1.0 + randn(s.seed, key, shape, 0.05)
    if key.endswith((".bias", "_bias")):
        return randn(s.seed, key, shape, 0.02)
    if key.endswith(("experts.gate_up_proj", "experts.down_proj")):     # gpt_oss: x @ W
        std = shape[-2] ** -0.5 * (0.25 if key.endswith("down_proj") else 1.0)
        return randn(s.seed, key, shape, std)
    std = shape[-1] ** -0.5
    if key.rsplit(".", 2)[-2] in OUT_PROJ:
        std *= 0.25
    return randn(s.seed, key, shape, std)


def state_dict(arch: str, spec: CheckpointSpec) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint under its hub key, in ``spec.dtype`` (router bias fp32)."""
    s = resolve(arch, spec)
    T = num_topics(s.num_experts, s.top_k)
    num_moe = s.num_layers - s.first_k_dense
    dt = DTYPES[s.dtype]
    out: dict[str, torch.Tensor] = {}
    embed = _embedding(s, T)
    for key, shape in tensor_shapes(arch, s).items():
        if key == "model.embed_tokens.weight":
            v = embed
        elif key == "lm_head.weight":
            v = embed / s.hidden_size ** 0.5
        elif key.endswith((".mlp.gate.weight", ".block_sparse_moe.gate.weight",
                           ".mlp.router.weight")):
            layer = int(key.split(".")[2])
            v = _router(s, key, T, layer - s.first_k_dense, num_moe)
        elif key.endswith("e_score_correction_bias"):
            out[key] = randn(s.seed, key, shape, 0.02).to(torch.float32)
            continue
        else:
            v = _value(s, key, shape)
        assert tuple(v.shape) == tuple(shape), (key, v.shape, shape)
        out[key] = v.to(dt).contiguous()
    return out


def topics_info(arch: str, spec: CheckpointSpec, num_text_tokens: int) -> dict:
    """The ``xllm_eplb_topics.json`` payload (JSON-safe)."""
    s = resolve(arch, spec)
    T = num_topics(s.num_experts, s.top_k)
    num_moe = s.num_layers - s.first_k_dense
    return {"format": TOPICS_FORMAT, "num_topics": T, "token_topic": "token_id % num_topics",
            "text_token_ids": [0, int(num_text_tokens)], "routing_skew": s.routing_skew,
            "seed": s.seed, "first_moe_layer": s.first_k_dense,
            "home_experts": [home_experts(s.seed, s.num_experts, T, ml).tolist()
                             for ml in range(num_moe)],
            "layer_gain": [layer_gain(s.routing_skew, ml, num_moe) for ml in range(num_moe)]}


def read_topics(model_dir: str | os.PathLike) -> dict | None:
    """The folder's topics file, or None when it has none (a checkpoint not made here)."""
    p = Path(model_dir) / TOPICS_FILE
    if not p.is_file():
        return None
    try:
        info = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{p}: cannot read ({e})") from None
    if not isinstance(info, dict) or info.get("format") != TOPICS_FORMAT:
        raise CheckpointError(f"{p}: not a {TOPICS_FORMAT!r} file")
    return info


# --- writing ----------------------------------------------------------------------------------

def _write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _json_bytes(obj) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()


def prepare_folder(out: str | os.PathLike, force: bool) -> Path:
    """Create ``out`` (and parents); refuse a non-empty folder unless ``force``."""
    p = Path(out)
    if p.exists() and not p.is_dir():
        raise CheckpointError(f"--out={out}: exists and is not a folder")
    if p.is_dir() and any(p.iterdir()) and not force:
        raise CheckpointError(f"--out={out}: folder is not empty (use --force to overwrite)")
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"--out={out}: cannot create folder ({e.strerror})") from None
    if not os.access(p, os.W_OK):
        raise CheckpointError(f"--out={out}: folder is not writable")
    return p


QUANTS = ("fp8", "mxfp4")
SCALE_DTYPES = ("float32", "bfloat16", "float16")


def _quant_args(quant, block_size, scale_dtype) -> tuple[int, int]:
    """Check the quantization arguments; -> the block (rows, columns)."""
    if quant not in (None, *QUANTS):
        _fail("quant", quant, f"must be one of {', '.join(QUANTS)} (or none)")
    b = (block_size, block_size) if isinstance(block_size, int) else tuple(block_size)
    if len(b) != 2 or not all(isinstance(v, int) and v >= 1 for v in b):
        _fail("block_size", block_size, "must be an integer >= 1 or two of them")
    if scale_dtype not in SCALE_DTYPES:
        _fail("scale_dtype", scale_dtype, f"must be one of {', '.join(SCALE_DTYPES)}")
    return b


#: gpt-oss's hub ``quantization_config``
MXFP4_CONFIG = {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                           "model.embed_tokens", "lm_head"],
                "quant_method": "mxfp4"}


def _mxfp4_experts(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """gpt_oss's fused experts (``gate_up_proj`` [E, H, 2I], ``down_proj`` [E, I, H]) as
    MXFP4 ``*_blocks`` / ``*_scales`` of their transposes (gpt-oss's hub layout, one row per
    output column); the biases and every other tensor kept."""
    out = {}
    for k, v in sd.items():
        if k.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = mxfp4.quantize(v.transpose(1, 2).float())
            out[k + "_blocks"], out[k + "_scales"] = blocks, scales
        else:
            out[k] = v
    return out


def make_checkpoint(arch: str = "deepseek_v3", out: str | os.PathLike = ".", *,
                    force: bool = False, quant: str | None = None,
                    block_size: int | tuple[int, int] = 128, scale_dtype: str = "float32",
                    **sizes) -> Path:
    """Write a tiny checkpoint of family ``arch`` into ``out`` and return its path.

    ``sizes``: any :class:`CheckpointSpec` field (``seed=``, ``dtype=``, ``num_experts=`` ...).
    ``quant="fp8"``: every block-aligned decoder Linear as float8_e4m3fn + ``weight_scale_inv``
    (``scale_dtype``) per ``block_size`` block (:func:`fp8.quantize_state_dict`), the others
    named in ``quantization_config.modules_to_not_convert``. ``quant="mxfp4"`` (gpt_oss only):
    the routed experts as MXFP4 blocks and scales (:mod:`mxfp4`), as gpt-oss's hub files.
    ``config.json`` is written last, so its presence means the folder is complete. Raises
    CheckpointError for a bad size, an unknown family or a non-empty folder (unless ``force``).
    """
    unknown = sorted(set(sizes) - set(CheckpointSpec.__dataclass_fields__))
    if unknown:
        _fail(unknown[0], sizes[unknown[0]],
              f"unknown size (known: {', '.join(CheckpointSpec.__dataclass_fields__)})")
    block = _quant_args(quant, block_size, scale_dtype)
    s = resolve(arch, CheckpointSpec(**sizes))
    if (quant == "mxfp4") != (quant is not None and arch == "gpt_oss"):
        _fail("quant", quant, "gpt_oss takes mxfp4 (its hub format), the other families fp8")
    if quant == "mxfp4" and (s.hidden_size % mxfp4.BLOCK or s.moe_intermediate_size % mxfp4.BLOCK):
        _fail("quant", quant, f"mxfp4 needs hidden_size and moe_intermediate_size multiples of "
              f"{mxfp4.BLOCK}")
    p = prepare_folder(out, force)
    tok = ctok.train_tokenizer(s.vocab_size)
    ids = ctok.special_ids(tok)
    sd, config = state_dict(arch, s), hf_config(arch, s, ids)
    if quant == "fp8":
        sd, skipped = fp8.quantize_state_dict(sd, block, fp8.SCALE_TORCH[scale_dtype])
        config["quantization_config"] = fp8.quantization_config(block, skipped)
    if quant == "mxfp4":
        sd = _mxfp4_experts(sd)
        config["quantization_config"] = MXFP4_CONFIG
    _write_atomic(p / "model.safetensors", save(sd, metadata={"format": "pt"}))
    _write_atomic(p / "tokenizer.json", tok.to_str(pretty=True).encode())
    _write_atomic(p / "tokenizer_config.json", _json_bytes(ctok.tokenizer_config(s.max_position_embeddings)))
    _write_atomic(p / "generation_config.json", _json_bytes(generation_config(ids)))
    _write_atomic(p / TOPICS_FILE, _json_bytes(topics_info(arch, s, ctok.num_text_tokens(tok))))
    _write_atomic(p / "config.json", _json_bytes(config))
    return p


def spec_dict(arch: str, spec: CheckpointSpec) -> dict:
    """The resolved spec as a plain dict (for reports)."""
    return asdict(resolve(arch, spec))
