"""Deterministic weights of the small MoE decoder, identical on every rank.

Every tensor is drawn from its own ``torch.Generator`` seeded by ``(cfg.model.seed, name)`` in
float64 and then cast to ``cfg.model.dtype``, so a float32 and a float64 model share the same
values up to rounding and any rank can materialise any logical expert of any layer.

Parameter names (also the keys of the optional ``weights`` state dict; ``i`` = decoder layer,
``l`` = MoE-local layer = ``i - first_k_dense_replace``):

- ``embed`` [V, H] (tied LM head: logits = final_norm(h) @ embed^T / sqrt(H)), ``final_norm`` [H]
- ``layers.i.attn_norm`` [H], ``layers.i.wqkv`` [3H, H], ``layers.i.wo`` [H, H], ``layers.i.ffn_norm`` [H]
- dense layers: ``layers.i.mlp.w13`` [2*intermediate, H], ``layers.i.mlp.w2`` [H, intermediate]
- MoE layers: ``layers.i.gate`` [E, H], ``layers.i.gate_bias`` [E] (DeepSeek score-correction
  bias, used for selection only), ``layers.i.shared.w13`` [2*I*n_shared, H],
  ``layers.i.shared.w2`` [H, I*n_shared], ``layers.i.experts.w13`` [E, 2I, H],
  ``layers.i.experts.w2`` [E, H, I]  (I = moe_intermediate_size)

Routing skew without training (see :mod:`xllm_eplb.model.topics`): the embedding of a token is
sqrt(H) * (its topic direction + noise), so the residual stream stays dominated by it (branch
outputs are scaled by 0.25), and each MoE gate row is the noise plus the directions of the
topics the expert serves, with a gain that grows with depth.
"""

from __future__ import annotations

import functools
import zlib

import torch

from xllm_eplb.config import Config
from xllm_eplb.errors import InputFileError
from xllm_eplb.model import topics

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
          "float16": torch.float16, "auto": torch.float32}


def torch_dtype(cfg: Config) -> torch.dtype:
    """``cfg.model.dtype`` as a torch dtype (``auto`` unresolved: float32)."""
    return DTYPES[cfg.model.dtype]


def _gen(seed: int, name: str) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed((int(seed) * 1_000_003 + zlib.crc32(name.encode())) % (1 << 62))
    return g


def randn(seed: int, name: str, shape: tuple[int, ...], std: float) -> torch.Tensor:
    """float64 N(0, std^2) tensor, a pure function of (seed, name, shape)."""
    return torch.randn(shape, generator=_gen(seed, name), dtype=torch.float64) * std


def moe_decoder_layer(cfg: Config, moe_layer: int) -> int:
    return cfg.model.first_k_dense_replace + moe_layer


def _gate(cfg: Config, i: int) -> torch.Tensor:
    m = cfg.model
    ml = i - m.first_k_dense_replace
    g = randn(m.seed, f"layers.{i}.gate", (m.num_experts, m.hidden_size), m.hidden_size ** -0.5)
    dirs = topics.topic_directions(cfg)                      # [T, H], unit rows
    home = topics.home_experts(cfg, ml)                        # [T, m]
    gain = topics.layer_gain(cfg, ml)
    for t in range(home.shape[0]):
        for j, e in enumerate(home[t].tolist()):
            g[e] += gain * (1.0 - 0.12 * j) * dirs[t]
    return g


def _seeded(cfg: Config, name: str) -> torch.Tensor:
    """The seeded float64 value of one named non-expert parameter."""
    m = cfg.model
    H, V = m.hidden_size, m.vocab_size
    if name == "embed":
        dirs = topics.topic_directions(cfg)
        tok_topic = torch.as_tensor(topics.token_topics(cfg))
        noise = randn(m.seed, name, (V, H), H ** -0.5)
        return H ** 0.5 * (m.routing_skew * dirs[tok_topic] + noise)
    if name.endswith("norm"):
        return torch.ones(H, dtype=torch.float64)
    _, i_s, rest = name.split(".", 2)
    i = int(i_s)
    I_d, inter, ns = m.intermediate_size, m.moe_intermediate_size, m.n_shared_experts
    shapes = {"wqkv": ((3 * H, H), H ** -0.5), "wo": ((H, H), 0.25 * H ** -0.5),
              "mlp.w13": ((2 * I_d, H), H ** -0.5), "mlp.w2": ((H, I_d), 0.25 * I_d ** -0.5),
              "gate_bias": ((m.num_experts,), 0.02),
              "shared.w13": ((2 * inter * ns, H), H ** -0.5),
              "shared.w2": ((H, inter * ns), 0.25 * max(1, inter * ns) ** -0.5)}
    if rest == "gate":
        return _gate(cfg, i)
    shape, std = shapes[rest]
    return randn(m.seed, name, shape, std)


def param_shapes(cfg: Config) -> dict[str, tuple[int, ...]]:
    """Every parameter name of the full (logical) model -> its shape."""
    m = cfg.model
    H, V, E = m.hidden_size, m.vocab_size, m.num_experts
    I_d, inter, ns = m.intermediate_size, m.moe_intermediate_size, m.n_shared_experts
    out: dict[str, tuple[int, ...]] = {"embed": (V, H), "final_norm": (H,)}
    for i in range(m.num_layers):
        p = f"layers.{i}."
        out.update({p + "attn_norm": (H,), p + "wqkv": (3 * H, H), p + "wo": (H, H),
                    p + "ffn_norm": (H,)})
        if i < m.first_k_dense_replace:
            out.update({p + "mlp.w13": (2 * I_d, H), p + "mlp.w2": (H, I_d)})
            continue
        out.update({p + "gate": (E, H), p + "gate_bias": (E,),
                    p + "experts.w13": (E, 2 * inter, H), p + "experts.w2": (E, H, inter)})
        if ns:
            out.update({p + "shared.w13": (2 * inter * ns, H), p + "shared.w2": (H, inter * ns)})
    return out


@functools.lru_cache(maxsize=4)
def _load_file(path: str, shapes_key: tuple) -> dict[str, torch.Tensor]:
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise InputFileError(f"weights: file {path!r} does not exist") from None
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the user's input
        why = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]  # one line
        if why.startswith("Weights only load failed"):   # torch's long multi-line message
            why = "not a pickle of tensors only: torch.load(weights_only=True) refused it"
        raise InputFileError(f"weights: cannot read {path!r} as a torch state dict "
                             f"saved with torch.save ({why})") from None
    if not isinstance(sd, dict):
        raise InputFileError(f"weights: {path!r} holds a {type(sd).__name__}, expected a state dict")
    shapes = dict(shapes_key)
    unknown = sorted(set(sd) - set(shapes))
    if unknown:
        raise InputFileError(f"weights: {path!r} has unknown key {unknown[0]!r} "
                             f"({len(unknown)} unknown); keys must match the model config")
    missing = sorted(set(shapes) - set(sd))
    if missing:
        raise InputFileError(f"weights: {path!r} lacks key {missing[0]!r} ({len(missing)} missing)")
    for k, shape in shapes.items():
        got = tuple(sd[k].shape)
        if got != shape:
            raise InputFileError(f"weights: {path!r} key {k!r} has shape {list(got)}, the config "
                                 f"needs {list(shape)}")
    return {k: v.to(torch.float64) for k, v in sd.items()}


def check_weight_file(cfg: Config) -> None:
    """Raise InputFileError now (before any process group) if ``cfg.model.weights`` is unusable."""
    if cfg.model.weights:
        _load_file(cfg.model.weights, tuple(sorted(param_shapes(cfg).items())))


def param(cfg: Config, name: str) -> torch.Tensor:
    """The value of one non-expert parameter in ``cfg.model.dtype`` (file or seeded)."""
    if cfg.model.weights:
        v = _load_file(cfg.model.weights, tuple(sorted(param_shapes(cfg).items())))[name]
    else:
        v = _seeded(cfg, name)
    return v.to(torch_dtype(cfg)).contiguous()


def expert_weights(cfg: Config, layer: int, e: int) -> dict[str, torch.Tensor]:
    """Weights of logical expert ``e`` of MoE layer ``layer`` (MoE-local, 0..L_moe-1):
    ``w13`` [2I, H] (gate rows then up rows) and ``w2`` [H, I], in ``cfg.model.dtype``.
    Identical on every rank (seeded by name, or read from the ``weights`` file)."""
    m = cfg.model
    if not (0 <= e < m.num_experts) or not (0 <= layer < cfg.num_moe_layers):
        raise ValueError(f"expert_weights: layer={layer} e={e} out of range "
                         f"[0,{cfg.num_moe_layers}) x [0,{m.num_experts})")
    i = moe_decoder_layer(cfg, layer)
    H, inter = m.hidden_size, m.moe_intermediate_size
    if m.weights:
        sd = _load_file(m.weights, tuple(sorted(param_shapes(cfg).items())))
        w13, w2 = sd[f"layers.{i}.experts.w13"][e], sd[f"layers.{i}.experts.w2"][e]
    else:
        w13 = randn(m.seed, f"layers.{i}.experts.{e}.w13", (2 * inter, H), H ** -0.5)
        w2 = randn(m.seed, f"layers.{i}.experts.{e}.w2", (H, inter), 0.25 * inter ** -0.5)
    dt = torch_dtype(cfg)
    return {"w13": w13.to(dt).contiguous(), "w2": w2.to(dt).contiguous()}


def full_state_dict(cfg: Config) -> dict[str, torch.Tensor]:
    """The whole logical model as a state dict (the format the ``weights`` option loads)."""
    out = {}
    for name in param_shapes(cfg):
        if ".experts." in name:
            continue
        out[name] = param(cfg, name)
    for ml in range(cfg.num_moe_layers):
        i = moe_decoder_layer(cfg, ml)
        ws = [expert_weights(cfg, ml, e) for e in range(cfg.model.num_experts)]
        out[f"layers.{i}.experts.w13"] = torch.stack([w["w13"] for w in ws])
        out[f"layers.{i}.experts.w2"] = torch.stack([w["w2"] for w in ws])
    return out
