// AVX-512 micro-kernels: fp32 FMA over 16 lanes; bf16 either by AVX512-BF16 dot products of
// pairs (vdpbf16ps, 32 values a step) or, without that extension, widened to fp32.
#include <immintrin.h>

#include <cstdint>

#include "isa.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")

namespace {

#include "scalar.h"

struct Avx512Base {
  using acc_t = __m512;
  static constexpr int MR = 4, NR = 4;
  static __m512 zero() { return _mm512_setzero_ps(); }
  static float reduce(__m512 a) { return _mm512_reduce_add_ps(a); }
  static __m512 load(const float* p) { return _mm512_loadu_ps(p); }
  static __m512 fma(__m512 acc, __m512 a, __m512 b) { return _mm512_fmadd_ps(a, b, acc); }
};

namespace dp {  // bf16 pairs through vdpbf16ps
struct V : Avx512Base {
  using Avx512Base::fma;
  using Avx512Base::load;
  template <typename T>
  static constexpr int step() { return sizeof(T) == 4 ? 16 : 32; }
  static __m512i load(const uint16_t* p) { return _mm512_loadu_si512(p); }
  static __m512 fma(__m512 acc, __m512i a, __m512i b) {
    return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
  }
};
#include "tiles.h"
}  // namespace dp

namespace cvt {  // bf16 widened to fp32
struct V : Avx512Base {
  using Avx512Base::fma;
  using Avx512Base::load;
  template <typename T>
  static constexpr int step() { return 16; }
  static __m512 load(const uint16_t* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
};
#include "tiles.h"
}  // namespace cvt

// exp(x) for the activation: 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2], p of degree 6
// (relative error ~2e-7); scalef handles the range ends.
__m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.7f)), _mm512_set1_ps(-103.9f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504089f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

__m512 sigmoid_ps(__m512 x) {
  const __m512 one = _mm512_set1_ps(1.0f);
  return _mm512_div_ps(one, _mm512_add_ps(one, exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), x))));
}

__m512 act_ps(__m512 g, __m512 u, int kind, float alpha, float limit) {
  if (kind == 0) return _mm512_mul_ps(_mm512_mul_ps(g, sigmoid_ps(g)), u);
  const __m512 lim = _mm512_set1_ps(limit);
  g = _mm512_min_ps(g, lim);
  u = _mm512_max_ps(_mm512_min_ps(u, lim), _mm512_sub_ps(_mm512_setzero_ps(), lim));
  const __m512 glu = _mm512_mul_ps(g, sigmoid_ps(_mm512_mul_ps(g, _mm512_set1_ps(alpha))));
  return _mm512_mul_ps(_mm512_add_ps(u, _mm512_set1_ps(1.0f)), glu);
}

void act(const float* g, const float* u, float* h, int64_t n, int kind, float alpha,
         float limit) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(h + i, act_ps(_mm512_loadu_ps(g + i), _mm512_loadu_ps(u + i), kind,
                                   alpha, limit));
  if (i < n) {  // the tail through the same lanes: masked, so a value's result never depends on n
    const __mmask16 m = __mmask16((1u << (n - i)) - 1);
    _mm512_mask_storeu_ps(h + i, m, act_ps(_mm512_maskz_loadu_ps(m, g + i),
                                           _mm512_maskz_loadu_ps(m, u + i), kind, alpha, limit));
  }
}

}  // namespace

#pragma GCC pop_options

namespace xllm_eplb_kernels {

const IsaTable* isa_avx512() {
  static const IsaTable with_bf16{"avx512_bf16", dp::gemm_f32, dp::gemm_bf16, act};
  static const IsaTable without{"avx512", cvt::gemm_f32, cvt::gemm_bf16, act};
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw") ||
      !__builtin_cpu_supports("avx512vl") || !__builtin_cpu_supports("avx512dq"))
    return nullptr;
  return __builtin_cpu_supports("avx512bf16") ? &with_bf16 : &without;
}

}  // namespace xllm_eplb_kernels
