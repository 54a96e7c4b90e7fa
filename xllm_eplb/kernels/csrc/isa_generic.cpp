// Portable micro-kernels (any CPU): one sequential dot product per output, in k order.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "isa.h"

namespace xllm_eplb_kernels {

namespace {

inline float bf16_to_f32(uint16_t v) {
  const uint32_t b = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

template <typename T, typename Cvt>
void gemm(const T* const* x, int64_t m, const T* w, int64_t ldw, int64_t n, int64_t k,
          float* out, int64_t ldo, Cvt cvt) {
  for (int64_t r = 0; r < m; ++r)
    for (int64_t c = 0; c < n; ++c) {
      float s = 0.0f;
      for (int64_t p = 0; p < k; ++p) s += cvt(x[r][p]) * cvt(w[c * ldw + p]);
      out[r * ldo + c] = s;
    }
}

void gemm_f32(const float* const* x, int64_t m, const float* w, int64_t ldw, int64_t n,
              int64_t k, float* out, int64_t ldo) {
  gemm(x, m, w, ldw, n, k, out, ldo, [](float v) { return v; });
}

void gemm_bf16(const uint16_t* const* x, int64_t m, const uint16_t* w, int64_t ldw, int64_t n,
               int64_t k, float* out, int64_t ldo) {
  gemm(x, m, w, ldw, n, k, out, ldo, bf16_to_f32);
}

}  // namespace

void act_scalar(const float* g, const float* u, float* h, int64_t n, int kind, float alpha,
                float limit) {
  for (int64_t i = 0; i < n; ++i) {
    if (kind == 0) {
      h[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
    } else {
      const float gg = std::fmin(g[i], limit);
      const float uu = std::fmax(std::fmin(u[i], limit), -limit);
      h[i] = (uu + 1.0f) * (gg / (1.0f + std::exp(-alpha * gg)));
    }
  }
}

const IsaTable* isa_generic() {
  static const IsaTable table{"generic", gemm_f32, gemm_bf16, act_scalar};
  return &table;
}

}  // namespace xllm_eplb_kernels
