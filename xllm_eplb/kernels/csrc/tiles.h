// Register-tiled dot-product GEMM over row pointers, shared by the SIMD variants.
// Included by isa_avx512.cpp and isa_avx2.cpp inside an anonymous namespace, after each has
// defined its vector traits `V` (see there); every function here is then compiled for that
// file's target only. NOTE: no code here may depend on m or n except which tile runs: a row's
// accumulation order (lanes over k, V::reduce, then the scalar tail) is the same in every
// tile shape, which is what makes the outputs batch-invariant.

template <typename T, int M, int N>
static void tile(const T* const* x, const T* w, int64_t ldw, int64_t k, float* out,
                 int64_t ldo) {
  typename V::acc_t acc[M][N];
  for (int r = 0; r < M; ++r)
    for (int c = 0; c < N; ++c) acc[r][c] = V::zero();
  const int64_t kv = k - k % V::template step<T>();
  for (int64_t p = 0; p < kv; p += V::template step<T>()) {
    using In = decltype(V::load(x[0]));
    In xv[M];
    for (int r = 0; r < M; ++r) xv[r] = V::load(x[r] + p);
    for (int c = 0; c < N; ++c) {
      // the next tile's weight rows (right after these, V::NR rows on): a tile's rows are
      // too short a stream for the hardware prefetcher to run ahead of
      __builtin_prefetch(w + (c + V::NR) * ldw + p, 0, 3);
      const auto wv = V::load(w + c * ldw + p);
      for (int r = 0; r < M; ++r) acc[r][c] = V::fma(acc[r][c], xv[r], wv);
    }
  }
  for (int r = 0; r < M; ++r)
    for (int c = 0; c < N; ++c) {
      float s = V::reduce(acc[r][c]);
      for (int64_t p = kv; p < k; ++p)
        s = __builtin_fmaf(to_f32(x[r][p]), to_f32(w[c * ldw + p]), s);
      out[r * ldo + c] = s;
    }
}

template <typename T>
using TileFn = void (*)(const T* const*, const T*, int64_t, int64_t, float*, int64_t);

template <typename T, int M>
static constexpr TileFn<T> tile_of(int n) {
  return n == 1 ? tile<T, M, 1> : n == 2 ? tile<T, M, 2> : n == 3 ? tile<T, M, 3> : tile<T, M, 4>;
}

template <typename T>
static void gemm(const T* const* x, int64_t m, const T* w, int64_t ldw, int64_t n, int64_t k,
                 float* out, int64_t ldo) {
  static_assert(V::NR == 4, "tile_of covers 4 columns");
  for (int64_t c = 0; c < n; c += V::NR) {
    const int nc = int(n - c < V::NR ? n - c : V::NR);
    for (int64_t r = 0; r < m; r += V::MR) {
      const int mr = int(m - r < V::MR ? m - r : V::MR);
      TileFn<T> f = mr == 1 ? tile_of<T, 1>(nc)
                  : mr == 2 ? tile_of<T, (V::MR >= 2 ? 2 : 1)>(nc)
                  : mr == 3 ? tile_of<T, (V::MR >= 3 ? 3 : 1)>(nc)
                            : tile_of<T, V::MR>(nc);
      f(x + r, w + c * ldw, ldw, k, out + r * ldo + c, ldo);
    }
  }
}

static void gemm_f32(const float* const* x, int64_t m, const float* w, int64_t ldw, int64_t n,
                     int64_t k, float* out, int64_t ldo) {
  gemm<float>(x, m, w, ldw, n, k, out, ldo);
}

static void gemm_bf16(const uint16_t* const* x, int64_t m, const uint16_t* w, int64_t ldw,
                      int64_t n, int64_t k, float* out, int64_t ldo) {
  gemm<uint16_t>(x, m, w, ldw, n, k, out, ldo);
}
