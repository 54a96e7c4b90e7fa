"""Routers: top-k logical experts per token, from the checkpoint's gate or from a load trace.

``routing_mode=model`` (default): the family's router (:class:`FamilyRouter`).

``routing_mode=trace`` (benchmarks only, clearly not a model): each layer's top-k is sampled
without replacement from the layer's expert-load distribution of a recorded trace (an SGLang
``logical_count`` dump, a ``.npy`` [layers, E] or [steps, layers, E], or a ``.npz`` with
``loads``). Sampling is Gumbel-top-k with uniforms hashed from (seed, layer, req_id, position,
token id), so it is deterministic per token and independent of the batch a token shares.
Weights are 1/k. Trace layers map to model layers by relative depth; if the trace has more
experts than the model, the first E columns are used (their relative skew is kept).
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch

from xllm_eplb.config import Config
from xllm_eplb.errors import InputFileError
from xllm_eplb.model.dense import linear

_M64 = (1 << 64) - 1


def _splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def hashed_uniform(keys: np.ndarray, n: int) -> np.ndarray:
    """Deterministic uniforms in (0, 1): keys uint64 [T] -> float64 [T, n]."""
    k = _splitmix64(keys.astype(np.uint64))
    cols = _splitmix64(k[:, None] ^ _splitmix64(np.arange(n, dtype=np.uint64))[None, :])
    return ((cols >> np.uint64(11)).astype(np.float64) + 0.5) / float(1 << 53)


def load_trace(path: str) -> np.ndarray:
    """Per-layer load of the MoE layers of a trace, float64 [layers, E] (all-zero rows dropped)."""
    if not os.path.exists(path):
        raise InputFileError(f"routing_trace: file {path!r} does not exist")
    try:
        if path.endswith(".json"):
            with open(path) as f:
                arr = np.asarray(json.load(f)["logical_count"], dtype=np.float64)
        elif path.endswith(".npz"):
            arr = np.asarray(np.load(path)["loads"], dtype=np.float64)
        elif path.endswith(".npy"):
            arr = np.asarray(np.load(path), dtype=np.float64)
        else:
            raise InputFileError(f"routing_trace: {path!r} must end in .json, .npy or .npz")
    except InputFileError:
        raise
    except Exception as exc:  # noqa: BLE001 - malformed user file
        raise InputFileError(f"routing_trace: cannot read {path!r}: {exc}") from None
    if arr.ndim == 3:
        arr = arr.sum(axis=0)
    if arr.ndim != 2:
        raise InputFileError(f"routing_trace: {path!r} has shape {arr.shape}, expected "
                             f"[layers, experts] or [steps, layers, experts]")
    arr = arr[arr.sum(axis=1) > 0]
    if arr.shape[0] == 0 or (arr < 0).any():
        raise InputFileError(f"routing_trace: {path!r} has no non-negative non-zero layer")
    return arr


def trace_probs(trace: np.ndarray, num_layers: int, num_experts: int) -> np.ndarray:
    """Map a trace [Lt, Et] onto the model: float64 [num_layers, num_experts] rows summing to 1."""
    Lt, Et = trace.shape
    rows = [trace[round(ml * (Lt - 1) / max(1, num_layers - 1))] for ml in range(num_layers)]
    t = np.stack(rows)
    if Et >= num_experts:
        t = t[:, :num_experts]
    else:
        t = np.tile(t, (1, -(-num_experts // Et)))[:, :num_experts]
    t = t + 1e-9 * t.sum(axis=1, keepdims=True) + 1e-12
    return t / t.sum(axis=1, keepdims=True)


class Router:
    """Trace-driven top-k of one MoE layer, shared by every family's router:
    ``_trace(xn [T, H], keys int64 [T, 3]) -> (topk_ids int64 [T, k], topk_weights [T, k] in
    x's dtype)``; keys = (req_id, position, token id)."""

    def __init__(self, cfg: Config, moe_layer: int, gate: torch.Tensor, bias: torch.Tensor | None,
                 probs: np.ndarray | None = None):
        self.k = cfg.model.num_experts_per_tok
        self.num_experts = cfg.model.num_experts
        self.mode = cfg.model.routing_mode
        self.gate, self.bias = gate, bias
        self.seed = int(cfg.model.seed) * 131 + moe_layer
        self.log_probs = None if probs is None else np.log(probs)

    def next_choice(self, xn: torch.Tensor, keys: torch.Tensor, ids: torch.Tensor
                    ) -> torch.Tensor:
        """Each token's next choice after its top-k ``ids`` [T, k]: int64 [T], the expert the
        router ranks k+1-th (capacity fallback, ``eplb/capacity.fallback``)."""
        if self.mode == "trace":
            return self._trace_scores(xn, keys, self.k + 1)[0][:, self.k]
        score = self._choice_scores(xn).float().scatter(1, ids, float("-inf"))
        return torch.argmax(score, dim=-1)

    def _trace(self, xn: torch.Tensor, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._trace_scores(xn, keys, self.k)

    def _trace_scores(self, xn: torch.Tensor, keys: torch.Tensor, n: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        T = xn.shape[0]
        kk = keys.cpu().numpy().astype(np.uint64)
        with np.errstate(over="ignore"):
            h = _splitmix64(np.full(T, self.seed, dtype=np.uint64))
            for c in range(kk.shape[1]):
                h = _splitmix64(h ^ kk[:, c])
        u = hashed_uniform(h, self.num_experts)
        score = self.log_probs[None, :] - np.log(-np.log(u))
        ids = np.argsort(-score, axis=1, kind="stable")[:, :n]
        w = torch.full((T, n), 1.0 / self.k, dtype=xn.dtype, device=xn.device)
        return torch.as_tensor(ids, dtype=torch.int64, device=xn.device), w


class FamilyRouter(Router):
    """Router of a checkpoint's MoE layer (``routing_mode=model``), as its family computes it:

    - softmax (mixtral, qwen2_moe, qwen3_moe, olmoe, gpt_oss): fp32 softmax of ``x @ gate^T``
      (+ the router bias, gpt_oss) -> top-k -> renormalised if ``norm_topk_prob`` (mixtral,
      gpt_oss: always; gpt_oss's softmax over its top-k logits is the same);
    - softmax (deepseek_v2), all fp32: ``topk_method=group_limited_greedy`` first keeps the
      ``topk_group`` groups of highest max probability (the others' probabilities set to 0),
      then top-k; never renormalised; times ``routed_scaling_factor``;
    - sigmoid (deepseek_v3, glm4_moe), all fp32 (fp64 for a float64 model): ``s = sigmoid(x @ gate^T)``; ``c = s + bias``; group
      score = sum of the top-2 ``c`` per group, keep ``topk_group`` groups (others -inf); top-k
      of ``c``; weights = the unbiased ``s`` of the chosen experts, divided by (sum + 1e-20) if
      ``norm_topk_prob``, times ``routed_scaling_factor``.

    "fp32" is at least fp32: a float64 model (tests) routes in float64, so its sharded and
    single-process paths agree to float64 rounding. Trace mode is inherited unchanged. Weights
    come back in x's dtype.
    """

    def __init__(self, cfg: Config, spec, moe_layer: int, gate: torch.Tensor,
                 bias: torch.Tensor | None, probs: np.ndarray | None = None):
        super().__init__(cfg, moe_layer, gate, bias, probs)
        self.spec = spec

    def __call__(self, xn: torch.Tensor, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.mode == "trace":
            return self._trace(xn, keys)
        s = self.spec
        if s.scoring == "sigmoid":
            return self._grouped_sigmoid(xn)
        w, ids = torch.topk(self._softmax_choice(xn), self.k, dim=-1)
        if s.norm_topk_prob:
            w = w / w.sum(dim=-1, keepdim=True)
        if s.routed_scaling_factor != 1.0:
            w = w * s.routed_scaling_factor
        return ids, w.to(xn.dtype)

    def _softmax_choice(self, xn: torch.Tensor) -> torch.Tensor:
        """Softmax probabilities [T, E] (at least fp32); an fp32 router (its gate kept fp32,
        deepseek_v2) projects in fp32 too. Group-limited: the groups not kept are 0."""
        s, E = self.spec, self.num_experts
        rdt = torch.promote_types(xn.dtype, torch.float32)
        if s.router_bias:                    # gpt_oss: a router Linear with a bias
            logits = linear(xn, self.gate, self.bias).to(rdt)
        elif self.gate.dtype == xn.dtype:
            logits = linear(xn, self.gate).to(rdt)
        else:
            logits = linear(xn.to(rdt), self.gate.to(rdt))
        probs = torch.softmax(logits, dim=-1)
        if s.topk_method == "group_limited_greedy" and s.topk_group < s.n_group:
            g = probs.view(-1, s.n_group, E // s.n_group).max(dim=-1).values
            keep = torch.zeros_like(g).scatter_(1, torch.topk(g, s.topk_group, dim=-1)[1], 1.0)
            mask = keep.bool().unsqueeze(-1).expand(-1, s.n_group, E // s.n_group).reshape(-1, E)
            probs = probs.masked_fill(~mask, 0.0)
        return probs

    def _choice_scores(self, xn: torch.Tensor) -> torch.Tensor:
        if self.spec.scoring == "sigmoid":
            return self._grouped_choice(xn)[1]
        return self._softmax_choice(xn)

    def _grouped_choice(self, xn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(sigmoid scores [T, E], selection scores [T, E]: + bias, groups not kept -inf)."""
        s, E = self.spec, self.num_experts
        rdt = torch.promote_types(xn.dtype, torch.float32)
        scores = linear(xn.to(rdt), self.gate.to(rdt)).sigmoid()
        choice = scores + self.bias.to(rdt)
        if s.n_group > 1 and s.topk_group < s.n_group:
            g = choice.view(-1, s.n_group, E // s.n_group).topk(2, dim=-1)[0].sum(dim=-1)
            keep = torch.zeros_like(g).scatter_(1, torch.topk(g, s.topk_group, dim=-1)[1], 1.0)
            mask = keep.bool().unsqueeze(-1).expand(-1, s.n_group, E // s.n_group).reshape(-1, E)
            choice = choice.masked_fill(~mask, float("-inf"))
        return scores, choice

    def _grouped_sigmoid(self, xn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.spec
        scores, choice = self._grouped_choice(xn)
        ids = torch.topk(choice, self.k, dim=-1)[1]
        w = scores.gather(1, ids)
        if s.norm_topk_prob:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, (w * s.routed_scaling_factor).to(xn.dtype)
