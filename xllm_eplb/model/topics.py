"""Topic clusters: how the workload's token mix drives which experts are hot.

Untrained weights route uniformly, so the seeded model builds skew in on purpose:

- every token id ``v`` belongs to topic ``v % num_topics`` (byte tokens 0..255 included);
- each topic ``t`` has a unit direction ``dir[t]`` [H]; a token's embedding is
  ``routing_skew * dir[topic] + noise`` (noise ~ N(0, 1/H) per entry);
- in MoE layer ``l`` topic ``t`` has ``m = E // num_topics`` *home experts* (a per-layer seeded
  permutation, so hot sets differ by layer); their gate rows get ``gain_l * dir[t]`` added with a
  gain that grows with depth (deeper layers are more skewed, as in DeepSeek's real loads).

A request whose prompt is drawn from topic t therefore sends most of its tokens to t's home
experts; shifting the topic mix of the workload moves the hot set. ``routing_skew=0`` gives
near-uniform routing.
"""

from __future__ import annotations

import numpy as np
import torch

from xllm_eplb.config import Config

MAX_TOPICS = 16
NUM_BYTES = 256


def num_topics(cfg: Config) -> int:
    """Number of topic clusters: min(16, E // top_k), at least 1."""
    m = cfg.model
    return max(1, min(MAX_TOPICS, m.num_experts // max(1, m.num_experts_per_tok)))


def token_topics(cfg: Config) -> np.ndarray:
    """Topic of every token id, int64 [V]."""
    return np.arange(cfg.model.vocab_size, dtype=np.int64) % num_topics(cfg)


def topic_token_ids(cfg: Config, topic: int, n: int, rng: np.random.Generator) -> list[int]:
    """``n`` byte-level token ids (0..255) of topic ``topic``, drawn with ``rng``."""
    T = num_topics(cfg)
    if not 0 <= topic < T:
        raise ValueError(f"topic={topic} outside [0, {T})")
    pool = np.arange(topic, NUM_BYTES, T)
    return [int(x) for x in rng.choice(pool, size=n)]


def topic_directions(cfg: Config) -> torch.Tensor:
    """Unit topic directions, float64 [T, H] (seeded, identical on every rank)."""
    g = torch.Generator()
    g.manual_seed(int(cfg.model.seed) * 7919 + 17)
    d = torch.randn((num_topics(cfg), cfg.model.hidden_size), generator=g, dtype=torch.float64)
    return d / d.norm(dim=1, keepdim=True)


def home_experts(cfg: Config, moe_layer: int) -> np.ndarray:
    """Home experts of every topic in one MoE layer, int64 [T, E // T] (disjoint)."""
    T, E = num_topics(cfg), cfg.model.num_experts
    rng = np.random.default_rng([int(cfg.model.seed), 4242, int(moe_layer)])
    perm = rng.permutation(E)
    m = E // T
    return perm[: T * m].reshape(T, m).astype(np.int64)


def layer_gain(cfg: Config, moe_layer: int) -> float:
    """Gate alignment gain of a MoE layer: grows linearly with depth (0.3 .. 1.0 at skew 1)."""
    L = max(1, cfg.num_moe_layers)
    frac = moe_layer / max(1, L - 1)
    return float(cfg.model.routing_skew) * (0.3 + 0.7 * frac)
