"""``ModelSpec``: the architecture of a Hugging Face MoE checkpoint, read from its config.json.

One typed record for the supported families (``deepseek_v3``, ``deepseek_v2``, ``glm4_moe``,
``gpt_oss``, ``qwen3_moe``, ``qwen2_moe``, ``mixtral``, ``olmoe``; docs/checkpoints.md's family
table says what each reads and refuses). Both spellings of the config found on disk are accepted: RoPE as
``rope_parameters{rope_theta, rope_type, ...}`` (transformers 5.x) or ``rope_theta`` +
``rope_scaling{type|rope_type, ...}`` (hub / 4.x), and the expert count as ``num_experts``,
``num_local_experts`` or ``n_routed_experts``. Hub-only DeepSeek fields (``scoring_func``,
``topk_method``, ``moe_layer_freq``, ``ep_size``) are ignored, as transformers ignores them.

Every bad value raises :class:`InputFileError` naming config.json, the field and the rule.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from xllm_eplb.errors import InputFileError
from xllm_eplb.model import mxfp4
from xllm_eplb.model.fp8 import Fp8Format, parse_quant

FAMILIES = ("deepseek_v2", "deepseek_v3", "glm4_moe", "gpt_oss", "mixtral", "olmoe",
            "qwen2_moe", "qwen3_moe")
LAYER_TYPES = ("full_attention", "sliding_attention")
TOPK_METHODS = ("greedy", "group_limited_greedy")
DEEPSEEK_STYLE = ("deepseek_v3", "deepseek_v2", "glm4_moe")   # n_routed_experts, groups
DTYPES = ("float32", "float64", "bfloat16", "float16")


@dataclass(frozen=True)
class MLASpec:
    """DeepSeek multi-head latent attention dims (``q_lora_rank`` None = plain ``q_proj``)."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool


@dataclass(frozen=True)
class ModelSpec:
    """Architecture of one checkpoint. ``moe_layers``: decoder layer indices with routed
    experts (ascending); the others run a dense SwiGLU MLP of width ``intermediate_size``.
    ``rope_scaling``: None or a dict with ``rope_type`` and its parameters."""

    family: str
    hidden_size: int
    num_layers: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rope_scaling: dict | None
    tie_word_embeddings: bool
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    intermediate_size: int
    moe_layers: tuple[int, ...]
    scoring: str                       # softmax | sigmoid
    norm_topk_prob: bool
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    shared_intermediate_size: int = 0  # 0 = no shared expert
    shared_expert_gate: bool = False   # qwen2_moe: sigmoid(gate(x)) * shared(x)
    attn_bias: bool = False            # bias on q/k/v (and o for qwen3 / deepseek)
    o_bias: bool = False
    qk_norm: bool = False              # qwen3 / glm4_moe: RMSNorm of q and k before RoPE
    qk_norm_per_head: bool = True      # olmoe: False, one norm over the whole q (k) projection
    clip_qkv: float | None = None      # olmoe: q, k, v clamped to [-clip, clip] after the norms
    rotary_dim: int = 0                # glm4_moe partial RoPE: the first dims rotated; 0 = all
    topk_method: str = "greedy"        # softmax routers; deepseek_v2: group_limited_greedy too
    sinks: bool = False                # gpt_oss: a learned logit per head joins each softmax
    sliding_window: int = 0            # gpt_oss: keys within this many positions (0 = all) ...
    sliding_layers: tuple[int, ...] = ()   # ... in these decoder layers
    router_bias: bool = False          # gpt_oss: the router Linear has a bias
    expert_bias: bool = False          # gpt_oss: expert biases b13 [2I] (gate, up), b2 [H]
    swiglu_limit: float = 0.0          # gpt_oss clamped SwiGLU (0 = plain SwiGLU) ...
    swiglu_alpha: float = 1.0          # ... (up + 1) * g * sigmoid(alpha g), g <= limit
    mxfp4: bool = False                # gpt_oss: MXFP4 experts (quant_method mxfp4, model/mxfp4)
    norm_weight_first: bool = False    # gpt_oss: RMSNorm scales in fp32 before the cast back
    mla: MLASpec | None = None
    dtype: str = "float32"
    quant: Fp8Format | None = None     # config.json quantization_config (FP8 block scales)
    extra: dict = field(default_factory=dict)

    @property
    def first_dense(self) -> int:
        """Dense (non-MoE) decoder layers: what ``cfg.model.first_k_dense_replace`` reports."""
        return self.num_layers - len(self.moe_layers)


class _Cfg:
    """Typed access to config.json with errors naming the file and the field."""

    def __init__(self, path: Path, d: dict):
        self.path, self.d = path, d

    def err(self, name: str, value, rule: str) -> InputFileError:
        return InputFileError(f"{self.path}: field {name!r}={value!r} {rule}")

    def has(self, name: str) -> bool:
        return self.d.get(name) is not None

    def int(self, name: str, default=None, *, lo: int = 1, names: tuple = ()) -> int:
        for n in (name, *names):
            if self.d.get(n) is not None:
                name = n
                break
        v = self.d.get(name)
        v = default if v is None else v
        if v is None:
            raise InputFileError(f"{self.path}: missing field {name!r} (an integer >= {lo})")
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise self.err(name, v, f"must be an integer >= {lo}")
        return v

    def float(self, name: str, default=None) -> float:
        v = self.d.get(name, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise self.err(name, v, "must be a positive number")
        return float(v)

    def bool(self, name: str, default: bool) -> bool:
        v = self.d.get(name, default)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise self.err(name, v, "must be true or false")
        return v


def read_config_json(folder: Path) -> dict:
    path = folder / "config.json"
    if not folder.is_dir():
        raise InputFileError(f"--model={folder}: not a folder (a Hugging Face checkpoint folder "
                             f"with config.json and *.safetensors)")
    if not path.is_file():
        raise InputFileError(f"{path}: missing (a checkpoint folder needs config.json)")
    try:
        d = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputFileError(f"{path}: cannot read as JSON ({exc})") from None
    if not isinstance(d, dict):
        raise InputFileError(f"{path}: holds a {type(d).__name__}, expected a JSON object")
    return d


def _rope(c: _Cfg) -> tuple[float, dict | None]:
    """(theta, scaling or None) from either spelling."""
    rp = c.d.get("rope_parameters")
    if isinstance(rp, dict):
        theta = rp.get("rope_theta", c.d.get("rope_theta", 10000.0))
        scaling = dict(rp)
    else:
        theta = c.d.get("rope_theta", 10000.0)
        scaling = dict(c.d.get("rope_scaling") or {})
    kind = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    scaling.pop("rope_theta", None)
    if kind not in ("default", "yarn"):
        raise c.err("rope_type", kind, "is not supported (default or yarn)")
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise c.err("rope_theta", theta, "must be a positive number")
    return float(theta), (dict(scaling, rope_type="yarn") if kind == "yarn" else None)


def _dtype(c: _Cfg) -> str:
    v = c.d.get("dtype") or c.d.get("torch_dtype") or "float32"
    return v if v in DTYPES else "float32"


def _sparse_layers(c: _Cfg, n_layers: int) -> tuple[int, ...]:
    """qwen2_moe / qwen3_moe: layer i is MoE iff i not in mlp_only_layers and
    (i + 1) % decoder_sparse_step == 0."""
    step = c.int("decoder_sparse_step", 1)
    only = c.d.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) for i in only):
        raise c.err("mlp_only_layers", only, "must be a list of layer indices")
    return tuple(i for i in range(n_layers) if i not in only and (i + 1) % step == 0)


def parse_spec(folder: str | Path) -> ModelSpec:
    """Read and validate ``folder/config.json`` -> :class:`ModelSpec`."""
    folder = Path(folder)
    d = read_config_json(folder)
    c = _Cfg(folder / "config.json", d)
    fam = d.get("model_type")
    if fam not in FAMILIES:
        raise c.err("model_type", fam, f"is not supported; supported model_types: "
                    f"{', '.join(FAMILIES)}")
    H, L = c.int("hidden_size"), c.int("num_hidden_layers")
    heads = c.int("num_attention_heads")
    theta, scaling = _rope(c)
    E = c.int("n_routed_experts", names=("num_experts", "num_local_experts")) \
        if fam in DEEPSEEK_STYLE else c.int("num_experts", names=("num_local_experts",
                                                                   "n_routed_experts"))
    common = dict(family=fam, hidden_size=H, num_layers=L, vocab_size=c.int("vocab_size"),
                  max_position_embeddings=c.int("max_position_embeddings", 2048),
                  rms_norm_eps=c.float("rms_norm_eps", 1e-6), num_heads=heads,
                  rope_theta=theta, rope_scaling=scaling,
                  tie_word_embeddings=c.bool("tie_word_embeddings", False), num_experts=E,
                  top_k=c.int("num_experts_per_tok"), dtype=_dtype(c),
                  quant=parse_quant(_without_mxfp4(d, fam), folder / "config.json"))
    if common["top_k"] > E:
        raise c.err("num_experts_per_tok", common["top_k"], f"must be <= the {E} experts")
    if fam in ("deepseek_v3", "deepseek_v2"):
        return _deepseek(c, common)
    kv = c.int("num_key_value_heads", heads)
    if heads % kv:
        raise c.err("num_key_value_heads", kv, f"must divide num_attention_heads={heads}")
    hd = c.int("head_dim", H // heads if H % heads == 0 else None)
    if fam == "glm4_moe":
        return _glm4_moe(c, common, kv, hd)
    if fam == "olmoe":
        return _olmoe(c, common, kv, hd)
    if fam == "gpt_oss":
        return _gpt_oss(c, common, kv, hd)
    if fam == "mixtral":
        return ModelSpec(**common, num_kv_heads=kv, head_dim=hd,
                         moe_intermediate_size=c.int("intermediate_size"),
                         intermediate_size=c.int("intermediate_size"),
                         moe_layers=tuple(range(L)), scoring="softmax", norm_topk_prob=True)
    qwen = dict(num_kv_heads=kv, head_dim=hd, moe_intermediate_size=c.int("moe_intermediate_size"),
                intermediate_size=c.int("intermediate_size"), moe_layers=_sparse_layers(c, L),
                scoring="softmax", norm_topk_prob=c.bool("norm_topk_prob", False))
    if fam == "qwen2_moe":
        return ModelSpec(**common, **qwen, attn_bias=c.bool("qkv_bias", True),
                         shared_intermediate_size=c.int("shared_expert_intermediate_size", 0,
                                                        lo=0),
                         shared_expert_gate=True)
    bias = c.bool("attention_bias", False)
    return ModelSpec(**common, **qwen, attn_bias=bias, o_bias=bias, qk_norm=True)


def _groups(c: _Cfg, E: int, top2: bool) -> tuple[int, int]:
    """(n_group, topk_group), checked; ``top2``: the group score sums the top 2 (sigmoid)."""
    ng, tg = c.int("n_group", 1), c.int("topk_group", 1)
    if E % ng:
        raise c.err("n_group", ng, f"must divide the {E} routed experts")
    if tg > ng:
        raise c.err("topk_group", tg, f"must be <= n_group={ng}")
    if top2 and E // ng < 2 and ng > 1:
        raise c.err("n_group", ng, "leaves fewer than 2 experts per group (group score = top-2)")
    return ng, tg


def _topk_method(c: _Cfg, E: int, k: int) -> tuple[str, int, int]:
    """deepseek_v2's softmax routing: (topk_method, n_group, topk_group)."""
    m = c.d.get("topk_method") or "greedy"
    if m not in TOPK_METHODS:
        raise c.err("topk_method", m, f"is not supported ({' or '.join(TOPK_METHODS)})")
    if m == "greedy":
        return m, 1, 1
    ng, tg = _groups(c, E, top2=False)
    if k > tg * (E // ng):
        raise c.err("num_experts_per_tok", k, f"must be <= topk_group={tg} x {E // ng} experts "
                    f"per group (group_limited_greedy)")
    return m, ng, tg


def _deepseek(c: _Cfg, common: dict) -> ModelSpec:
    """deepseek_v3 (sigmoid + correction bias, top-2-sum groups) and deepseek_v2 (softmax,
    ``topk_method`` greedy or group_limited_greedy by group max, no renormalisation): MLA,
    ``first_k_dense_replace`` dense layers, ``n_shared_experts`` ungated shared experts."""
    L, E = common["num_layers"], common["num_experts"]
    v2 = common["family"] == "deepseek_v2"
    if v2:
        if c.bool("mlp_bias", False):
            raise c.err("mlp_bias", True, "is not supported (deepseek_v2 MLPs without biases)")
        method, ng, tg = _topk_method(c, E, common["top_k"])
    else:
        method, (ng, tg) = "greedy", _groups(c, E, top2=True)
    first = c.int("first_k_dense_replace", 0, lo=0)
    inter = c.int("moe_intermediate_size")
    q_lora = c.d.get("q_lora_rank")
    mla = MLASpec(q_lora_rank=None if q_lora is None else c.int("q_lora_rank"),
                  kv_lora_rank=c.int("kv_lora_rank"), qk_nope_head_dim=c.int("qk_nope_head_dim"),
                  qk_rope_head_dim=c.int("qk_rope_head_dim"), v_head_dim=c.int("v_head_dim"),
                  rope_interleave=True if v2 else c.bool("rope_interleave", True))
    if mla.qk_rope_head_dim % 2:
        raise c.err("qk_rope_head_dim", mla.qk_rope_head_dim, "must be even")
    bias = c.bool("attention_bias", False)
    return ModelSpec(**common, num_kv_heads=common["num_heads"],
                     head_dim=mla.qk_nope_head_dim + mla.qk_rope_head_dim,
                     moe_intermediate_size=inter, intermediate_size=c.int("intermediate_size"),
                     moe_layers=tuple(range(min(first, L), L)),
                     scoring="softmax" if v2 else "sigmoid", topk_method=method,
                     norm_topk_prob=False if v2 else c.bool("norm_topk_prob", True),
                     routed_scaling_factor=c.float("routed_scaling_factor", 1.0),
                     n_group=ng, topk_group=tg,
                     shared_intermediate_size=inter * c.int("n_shared_experts", 0, lo=0),
                     attn_bias=bias, o_bias=bias, mla=mla)


def _partial_rotary(c: _Cfg, hd: int) -> int:
    """glm4_moe: rotated dims of a head, ``int(head_dim * partial_rotary_factor)`` (the factor
    from ``rope_parameters`` or the top level; transformers' default 0.5), even."""
    rp = c.d.get("rope_parameters") if isinstance(c.d.get("rope_parameters"), dict) else {}
    f = rp.get("partial_rotary_factor", c.d.get("partial_rotary_factor", 0.5))
    if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1:
        raise c.err("partial_rotary_factor", f, "must be a number in (0, 1]")
    rd = int(hd * f)
    if rd < 2 or rd % 2:
        raise c.err("partial_rotary_factor", f, f"must rotate an even number >= 2 of the "
                    f"head_dim={hd} dims (got {rd})")
    return rd


def _glm4_moe(c: _Cfg, common: dict, kv: int, hd: int) -> ModelSpec:
    """GLM-4.5 / 4.6 / 4.7: DeepSeek-V3's router (sigmoid + score-correction bias, top-2-sum
    groups), ungated shared experts, ``first_k_dense_replace`` dense layers; GQA with biases
    on q/k/v (``attention_bias``, none on o), partial RoPE, optional per-head q/k norms."""
    L, E = common["num_layers"], common["num_experts"]
    ng, tg = _groups(c, E, top2=True)
    if common["top_k"] > tg * (E // ng):
        raise c.err("num_experts_per_tok", common["top_k"], f"must be <= topk_group={tg} x "
                    f"{E // ng} experts per group")
    first = c.int("first_k_dense_replace", 1, lo=0)
    inter = c.int("moe_intermediate_size")
    return ModelSpec(**common, num_kv_heads=kv, head_dim=hd, moe_intermediate_size=inter,
                     intermediate_size=c.int("intermediate_size"),
                     moe_layers=tuple(range(min(first, L), L)), scoring="sigmoid",
                     norm_topk_prob=c.bool("norm_topk_prob", True),
                     routed_scaling_factor=c.float("routed_scaling_factor", 1.0),
                     n_group=ng, topk_group=tg,
                     shared_intermediate_size=inter * c.int("n_shared_experts", 1, lo=0),
                     attn_bias=c.bool("attention_bias", False),
                     qk_norm=c.bool("use_qk_norm", False), rotary_dim=_partial_rotary(c, hd))


def _olmoe(c: _Cfg, common: dict, kv: int, hd: int) -> ModelSpec:
    """OLMoE: every layer MoE (experts of width ``intermediate_size``), softmax routing without
    renormalisation by default; q/k RMSNorms over the whole projection, optional ``clip_qkv``."""
    H, heads = common["hidden_size"], common["num_heads"]
    if hd * heads != H:
        raise c.err("head_dim", hd, f"must be hidden_size / num_attention_heads = {H}/{heads} "
                    f"(olmoe's q_norm spans hidden_size)")
    clip = c.d.get("clip_qkv")
    clip = None if clip is None else c.float("clip_qkv")
    bias = c.bool("attention_bias", False)
    inter = c.int("intermediate_size")
    return ModelSpec(**common, num_kv_heads=kv, head_dim=hd, moe_intermediate_size=inter,
                     intermediate_size=inter, moe_layers=tuple(range(common["num_layers"])),
                     scoring="softmax", norm_topk_prob=c.bool("norm_topk_prob", False),
                     attn_bias=bias, o_bias=bias, qk_norm=True, qk_norm_per_head=False,
                     clip_qkv=clip)


def _is_mxfp4(d: dict, fam) -> bool:
    q = d.get("quantization_config")
    return fam == "gpt_oss" and isinstance(q, dict) and q.get("quant_method") == mxfp4.METHOD


def _without_mxfp4(d: dict, fam) -> dict:
    """config.json without gpt_oss's MXFP4 ``quantization_config`` (read by the gpt_oss
    parser; any other quantization goes to :func:`fp8.parse_quant`)."""
    return {k: v for k, v in d.items() if k != "quantization_config"} if _is_mxfp4(d, fam) \
        else d


def _layer_types(c: _Cfg, L: int) -> tuple[int, ...]:
    """gpt_oss: the decoder layers of ``layer_types`` that attend in a sliding window
    (transformers' default: the even ones)."""
    lt = c.d.get("layer_types")
    if lt is None:
        lt = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(L)]
    if not isinstance(lt, list) or len(lt) != L or any(t not in LAYER_TYPES for t in lt):
        raise c.err("layer_types", lt, f"must list {L} of {' / '.join(LAYER_TYPES)}")
    return tuple(i for i, t in enumerate(lt) if t == "sliding_attention")


def _gpt_oss(c: _Cfg, common: dict, kv: int, hd: int) -> ModelSpec:
    """gpt-oss: GQA with biases and a learned sink logit per head, alternating sliding-window
    and full attention, YaRN RoPE; every layer MoE: a router with a bias, top-k of the logits
    then a softmax over those k (the renormalised top-k of the full softmax); experts with biases and a clamped SwiGLU."""
    inter = c.int("intermediate_size")
    mx = _is_mxfp4(c.d, "gpt_oss")
    for name, v in (("hidden_size", common["hidden_size"]), ("intermediate_size", inter)):
        if mx and v % mxfp4.BLOCK:
            raise c.err(name, v, f"must be a multiple of {mxfp4.BLOCK} (MXFP4 experts: one "
                        f"scale per {mxfp4.BLOCK} values)")
    sliding = _layer_types(c, common["num_layers"])
    window = c.int("sliding_window", 128) if sliding else 0
    return ModelSpec(**common, num_kv_heads=kv, head_dim=hd, moe_intermediate_size=inter,
                     intermediate_size=inter, moe_layers=tuple(range(common["num_layers"])),
                     scoring="softmax", norm_topk_prob=True,   # = softmax of the top-k logits
                     attn_bias=c.bool("attention_bias", True),
                     o_bias=c.bool("attention_bias", True), sinks=True, sliding_window=window,
                     sliding_layers=sliding, router_bias=True, expert_bias=True,
                     swiglu_limit=c.float("swiglu_limit", 7.0),
                     swiglu_alpha=c.float("swiglu_alpha", 1.702), mxfp4=mx,
                     norm_weight_first=True)
