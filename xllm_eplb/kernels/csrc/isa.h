// The interface between the ISA-independent driver (ops.cpp) and one compiled variant of the
// micro-kernels (isa_avx512.cpp, isa_avx2.cpp, isa_generic.cpp). Plain C types only: the
// variants are compiled under their own `#pragma GCC target` and must not share inline code
// (templates, torch headers) with the rest of the library.
#pragma once
#include <cstdint>

namespace xllm_eplb_kernels {

// out[r * ldo + c] = sum_k x[r][k] * w[c * ldw + k] for r < m, c < n (float accumulation).
// Each (r, c) is computed by the same sequence of operations whatever m, n and the other rows
// are: lanes over k in a fixed order, one fixed horizontal reduction, then the scalar tail.
// NOTE: this is the batch-invariance rule; a variant must never let m or n change a row's order.
typedef void (*GemmF32)(const float* const* x, int64_t m, const float* w, int64_t ldw,
                        int64_t n, int64_t k, float* out, int64_t ldo);
typedef void (*GemmBF16)(const uint16_t* const* x, int64_t m, const uint16_t* w, int64_t ldw,
                         int64_t n, int64_t k, float* out, int64_t ldo);
// h[i] = act(g[i], u[i]) for i < n; kind 0: silu(g) * u; kind 1: gpt-oss's clamped SwiGLU
// (g = min(g, limit), u = clamp(u, -limit, limit), h = (u + 1) * g * sigmoid(alpha * g)).
typedef void (*ActF32)(const float* g, const float* u, float* h, int64_t n, int kind,
                       float alpha, float limit);

struct IsaTable {
  const char* name;
  GemmF32 gemm_f32;
  GemmBF16 gemm_bf16;
  ActF32 act;
};

// Each returns its table, or nullptr when this CPU lacks the instructions it was built for.
const IsaTable* isa_avx512();
const IsaTable* isa_avx2();
const IsaTable* isa_generic();

}  // namespace xllm_eplb_kernels
