// AVX2 + FMA micro-kernels (8 lanes; bf16 widened to fp32); the activation is the scalar one.
#include <immintrin.h>

#include <cstdint>

#include "isa.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma")

namespace {

#include "scalar.h"

struct V {
  using acc_t = __m256;
  static constexpr int MR = 2, NR = 4;
  template <typename T>
  static constexpr int step() { return 8; }
  static __m256 zero() { return _mm256_setzero_ps(); }
  static float reduce(__m256 a) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
  }
  static __m256 load(const float* p) { return _mm256_loadu_ps(p); }
  static __m256 load(const uint16_t* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static __m256 fma(__m256 acc, __m256 a, __m256 b) { return _mm256_fmadd_ps(a, b, acc); }
};

#include "tiles.h"

}  // namespace

#pragma GCC pop_options

namespace xllm_eplb_kernels {

void act_scalar(const float* g, const float* u, float* h, int64_t n, int kind, float alpha,
                float limit);

const IsaTable* isa_avx2() {
  static const IsaTable table{"avx2", gemm_f32, gemm_bf16, act_scalar};
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) return nullptr;
  return &table;
}

}  // namespace xllm_eplb_kernels
