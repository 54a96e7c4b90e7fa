"""The routed experts' FFN variant: plain SwiGLU, or gpt_oss's biases and clamped SwiGLU.

Experts keep the one storage layout (``w13`` [2I, H] gate rows then up rows, ``w2`` [H, I]);
a variant adds per-slot biases ``b13`` [2I] (gate, then up) and ``b2`` [H] to the expert
store (they move with the expert like its weights) and replaces the activation:

- plain (every family but gpt_oss): ``silu(g) * u``;
- clamped (gpt_oss, transformers' ``GptOssExperts``): ``g = min(g, limit)``,
  ``u = clamp(u, -limit, limit)``, ``(u + 1) * g * sigmoid(alpha * g)``, with
  ``[g, u] = x @ w13^T + b13`` and the output ``a @ w2^T + b2``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class ExpertAct:
    """``bias``: the experts have ``b13`` / ``b2``; ``limit`` > 0: clamped SwiGLU."""

    bias: bool = False
    limit: float = 0.0
    alpha: float = 1.0

    def glu(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """The activation of gate ``g`` and up ``u`` [..., I] -> [..., I]."""
        if not self.limit:
            return F.silu(g) * u
        g = g.clamp(max=self.limit)
        u = u.clamp(min=-self.limit, max=self.limit)
        return (u + 1) * (g * torch.sigmoid(g * self.alpha))


PLAIN = ExpertAct()


def from_spec(spec) -> ExpertAct:
    """The variant a :class:`~xllm_eplb.model.spec.ModelSpec` asks for (PLAIN for most)."""
    if not spec.expert_bias and not spec.swiglu_limit:
        return PLAIN
    return ExpertAct(bias=spec.expert_bias, limit=spec.swiglu_limit, alpha=spec.swiglu_alpha)
