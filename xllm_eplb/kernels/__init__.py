"""Kernels: the fused CPU MoE expert op and a batch-invariant linear, in C++ (``csrc/``).

One call per MoE layer runs every active slot's gate/up GEMM, the activation, and the down
GEMM over the slots' weights in place (the expert store's layout: no pack step, so an EPLB move
copies the same bytes it always did). Dense layers can use :func:`linear`, the same
micro-kernels. ISA variants: ``avx512_bf16`` (AVX-512 + vdpbf16ps), ``avx512``, ``avx2``,
``generic``; the best one this CPU runs is taken unless ``isa=`` names another.

Numerics: fp32 and bf16 (fp32 accumulation; bf16 intermediates rounded to bf16). Every output
element is one fixed sequence of operations whatever the batch, the rows that share its slot,
the work split and the thread count (``csrc/isa.h``): outputs are batch-invariant.

The library is built by ``make install`` (:mod:`xllm_eplb.kernels.build`); :func:`load` finds
the build of the current sources and otherwise reports why not (:func:`unavailable_reason`), and
the model then runs its torch path (``--moe_kernel=torch`` is that path on purpose, the
reference the float64 parity tests use).
"""

from __future__ import annotations

import torch

from xllm_eplb.kernels import build

#: activations of the experts' gate/up pair: SwiGLU (every family so far) and gpt-oss's clamped
#: SwiGLU (``alpha``, ``limit``)
ACTIVATIONS = {"silu": 0, "swiglu_clamp": 1}
#: dtypes the kernels compute in (float64 models use the torch path)
DTYPES = (torch.float32, torch.bfloat16)

_state: dict[str, object] = {}


def load() -> bool:
    """Load the built library once per process; True when its ops are there."""
    if "ok" not in _state:
        try:
            path = build.library_path()
            if not path.exists():
                raise FileNotFoundError(f"not built for these sources ({path.parent.name}): run "
                                        f"`make install` or `python -m xllm_eplb.kernels`")
            torch.ops.load_library(str(path))
            _state["isas"] = list(torch.ops.xllm_eplb.isas())
            _state["ok"] = True
        except Exception as e:  # noqa: BLE001 - a missing or broken build means the torch path
            _state["ok"], _state["why"] = False, f"{type(e).__name__}: {e}"
    return bool(_state["ok"])


def unavailable_reason() -> str:
    """Why :func:`load` failed ('' when it did not)."""
    load()
    return str(_state.get("why", ""))


def isas() -> list[str]:
    """The variants this CPU runs, best first ([] without the library)."""
    return list(_state.get("isas", [])) if load() else []


def supports(dtype: torch.dtype, device: torch.device | str) -> str:
    """'' when the kernels run this dtype on this device, else the reason they do not."""
    if torch.device(device).type != "cpu":
        return f"device {torch.device(device).type} (the kernels are CPU kernels)"
    if dtype not in DTYPES:
        return f"dtype {str(dtype).replace('torch.', '')} (float32 and bfloat16 only)"
    return "" if load() else unavailable_reason()


def fused_experts(x: torch.Tensor, slots: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  b13: torch.Tensor | None = None, b2: torch.Tensor | None = None, *,
                  act: str = "silu", alpha: float = 1.702, limit: float = 7.0,
                  isa: str = "") -> torch.Tensor:
    """Row n of ``x`` [N, H] through slot ``slots[n]`` (int64 [N], in [0, S)) of ``w13``
    [S, 2I, H] (gate rows, then up rows) and ``w2`` [S, H, I], optional biases ``b13`` [S, 2I]
    and ``b2`` [S, H] -> unweighted expert outputs [N, H] in x's dtype."""
    if act not in ACTIVATIONS:
        raise ValueError(f"act={act!r} is not one of {sorted(ACTIVATIONS)}")
    return torch.ops.xllm_eplb.fused_experts(x.contiguous(), slots.contiguous(), w13, w2, b13,
                                             b2, ACTIVATIONS[act], alpha, limit, isa)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, *,
           isa: str = "") -> torch.Tensor:
    """``x`` [..., K] @ ``w`` [O, K]^T + ``b`` [O] -> [..., O], batch-invariant."""
    lead = x.shape[:-1]
    y = torch.ops.xllm_eplb.linear(x.reshape(-1, x.shape[-1]).contiguous(), w, b, isa)
    return y.reshape(*lead, w.shape[0])
