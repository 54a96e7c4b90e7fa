// torch ops of the fused CPU MoE kernel (namespace `xllm_eplb`):
//   fused_experts(x [N, H], slots [N] int64, w13 [S, 2I, H], w2 [S, H, I], b13? [S, 2I],
//                 b2? [S, H], act, alpha, limit, isa) -> [N, H]
//       row n through slot slots[n]: act(x w13_gate^T + b, x w13_up^T + b) w2^T + b2,
//       unweighted (the routing weights are applied by the caller, after the combine).
//   linear(x [N, K], w [O, K], b? [O], isa) -> [N, O]
//   isas() -> the instruction-set variants this CPU runs, best first.
// Weights are read in the layout the expert store keeps them (rows contiguous along the
// reduction dim), so a slot needs no re-pack after an EPLB move. fp32 and bf16 (fp32
// accumulation); bf16 intermediates are rounded to bf16 as torch's bf16 path does.
// Rows are grouped per slot by a counting sort; work items (slot, rows, columns) are pulled
// from one counter by torch's intra-op threads (at::parallel_for). Every output element's
// arithmetic is fixed (isa.h), so results do not depend on the batch, the rows sharing a slot,
// the work split or the thread count.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <string>
#include <vector>

#include "isa.h"

namespace xllm_eplb_kernels {
namespace {

constexpr int64_t RB = 64;  // rows per work item
constexpr int64_t JB = 32;  // gate/up columns per work item (each: JB gate + JB up rows)
constexpr int64_t CB = 64;  // down-projection output columns per work item

std::vector<const IsaTable*> available() {
  std::vector<const IsaTable*> v;
  for (auto f : {isa_avx512, isa_avx2, isa_generic})
    if (const IsaTable* t = f()) v.push_back(t);
  return v;
}

const IsaTable* pick(c10::string_view name) {
  static const std::vector<const IsaTable*> avail = available();
  if (name.empty()) return avail.front();
  for (const IsaTable* t : avail)
    if (name == t->name) return t;
  std::string have;
  for (const IsaTable* t : avail) have += std::string(have.empty() ? "" : ", ") + t->name;
  TORCH_CHECK(false, "isa='", std::string(name), "' is not available on this CPU; available: ",
              have);
}

inline float to_f32(float v) { return v; }
inline float to_f32(uint16_t v) {
  const uint32_t b = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}
inline void store(float v, float* p) { *p = v; }
inline void store(float v, uint16_t* p) {  // round to nearest even, as c10::BFloat16
  uint32_t b;
  std::memcpy(&b, &v, 4);
  if ((b & 0x7fffffffu) > 0x7f800000u) {
    *p = uint16_t((b >> 16) | 0x40);
    return;
  }
  b += 0x7fffu + ((b >> 16) & 1u);
  *p = uint16_t(b >> 16);
}

template <typename T>
void gemm(const IsaTable* t, const T* const* x, int64_t m, const T* w, int64_t ldw, int64_t n,
          int64_t k, float* out, int64_t ldo) {
  if constexpr (sizeof(T) == 4)
    t->gemm_f32(x, m, w, ldw, n, k, out, ldo);
  else
    t->gemm_bf16(x, m, w, ldw, n, k, out, ldo);
}

// Runs f(i, scratch) for i < n on torch's intra-op threads, each pulling the next item from a
// counter; ``scratch`` is the thread's own buffer, reused across its items (grown as needed).
template <typename F>
void run_items(int64_t n, const F& f) {
  std::atomic<int64_t> next{0};
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  at::parallel_for(0, nt, 1, [&](int64_t, int64_t) {
    std::vector<float> scratch;
    for (int64_t i; (i = next.fetch_add(1)) < n;) f(i, scratch);
  });
}

// ``count`` floats of ``buf`` (grown, never shrunk).
inline float* room(std::vector<float>& buf, int64_t count) {
  if (int64_t(buf.size()) < count) buf.resize(size_t(count));
  return buf.data();
}

struct Item {
  int64_t slot, r0, r1, c0, c1;  // sorted rows [r0, r1) of one slot, columns [c0, c1)
};

// Work items over the slots' row groups, the slots with the most rows first.
std::vector<Item> items(const std::vector<int64_t>& first, int64_t cols, int64_t cb) {
  std::vector<int64_t> slots;
  for (int64_t s = 0; s + 1 < int64_t(first.size()); ++s)
    if (first[s + 1] > first[s]) slots.push_back(s);
  std::stable_sort(slots.begin(), slots.end(), [&](int64_t a, int64_t b) {
    return first[a + 1] - first[a] > first[b + 1] - first[b];
  });
  std::vector<Item> v;
  for (int64_t s : slots)
    for (int64_t r = first[s]; r < first[s + 1]; r += RB)
      for (int64_t c = 0; c < cols; c += cb)
        v.push_back({s, r, std::min(r + RB, first[s + 1]), c, std::min(c + cb, cols)});
  return v;
}

void check_weights(const at::Tensor& w, const at::Tensor& x, const char* name, int64_t rank) {
  TORCH_CHECK(w.dim() == rank, name, " must have ", rank, " dims, got ", w.sizes());
  TORCH_CHECK(w.scalar_type() == x.scalar_type(), name, " dtype ", w.scalar_type(),
              " differs from x's ", x.scalar_type());
  TORCH_CHECK(w.is_contiguous(), name, " must be contiguous (the kernel reads it in place)");
  TORCH_CHECK(w.device().is_cpu(), name, " must be on the CPU");
}

void check_x(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu(), "x must be on the CPU");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [N, K] matrix, got ",
              x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "dtype ", x.scalar_type(), " is not supported (float32 or bfloat16)");
}

template <typename T>
void add_bias(float* v, int64_t rows, int64_t cols, int64_t ld, const T* b) {
  if (!b) return;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) v[r * ld + c] += to_f32(b[c]);
}

template <typename T>
const T* ptr_or_null(const c10::optional<at::Tensor>& t) {
  return t.has_value() ? reinterpret_cast<const T*>(t->data_ptr()) : nullptr;
}

template <typename T>
void experts(const IsaTable* t, const at::Tensor& x, const std::vector<int64_t>& order,
             const std::vector<int64_t>& first, const at::Tensor& w13, const at::Tensor& w2,
             const c10::optional<at::Tensor>& b13, const c10::optional<at::Tensor>& b2, int act,
             float alpha, float limit, at::Tensor& out) {
  const int64_t N = x.size(0), H = x.size(1), I = w13.size(1) / 2;
  const T* xp = reinterpret_cast<const T*>(x.data_ptr());
  const T* w13p = reinterpret_cast<const T*>(w13.data_ptr());
  const T* w2p = reinterpret_cast<const T*>(w2.data_ptr());
  const T *b13p = ptr_or_null<T>(b13), *b2p = ptr_or_null<T>(b2);
  T* op = reinterpret_cast<T*>(out.data_ptr());
  std::vector<T> h(size_t(N * I));                       // sorted row i: act of its gate/up
  std::vector<const T*> xr(N), hr(N);
  for (int64_t i = 0; i < N; ++i) {
    xr[i] = xp + order[i] * H;
    hr[i] = h.data() + i * I;
  }
  const std::vector<Item> up = items(first, I, JB);
  run_items(int64_t(up.size()), [&](int64_t k, std::vector<float>& buf) {
    const Item& it = up[k];
    const int64_t m = it.r1 - it.r0, n = it.c1 - it.c0;
    float* g = room(buf, 3 * m * n);
    float *u = g + m * n, *a = u + m * n;
    const T* we = w13p + it.slot * 2 * I * H;
    gemm(t, xr.data() + it.r0, m, we + it.c0 * H, H, n, H, g, n);
    gemm(t, xr.data() + it.r0, m, we + (I + it.c0) * H, H, n, H, u, n);
    if (b13p) {
      add_bias(g, m, n, n, b13p + it.slot * 2 * I + it.c0);
      add_bias(u, m, n, n, b13p + it.slot * 2 * I + I + it.c0);
    }
    t->act(g, u, a, m * n, act, alpha, limit);
    for (int64_t r = 0; r < m; ++r)
      for (int64_t c = 0; c < n; ++c) store(a[r * n + c], &h[(it.r0 + r) * I + it.c0 + c]);
  });
  const std::vector<Item> down = items(first, H, CB);
  run_items(int64_t(down.size()), [&](int64_t k, std::vector<float>& buf) {
    const Item& it = down[k];
    const int64_t m = it.r1 - it.r0, n = it.c1 - it.c0;
    float* y = room(buf, m * n);
    gemm(t, hr.data() + it.r0, m, w2p + (it.slot * H + it.c0) * I, I, n, I, y, n);
    if (b2p) add_bias(y, m, n, n, b2p + it.slot * H + it.c0);
    for (int64_t r = 0; r < m; ++r)
      for (int64_t c = 0; c < n; ++c) store(y[r * n + c], op + order[it.r0 + r] * H + it.c0 + c);
  });
}

at::Tensor fused_experts(const at::Tensor& x, const at::Tensor& slots, const at::Tensor& w13,
                         const at::Tensor& w2, const c10::optional<at::Tensor>& b13,
                         const c10::optional<at::Tensor>& b2, int64_t act, double alpha,
                         double limit, c10::string_view isa) {
  const IsaTable* t = pick(isa);
  check_x(x);
  check_weights(w13, x, "w13", 3);
  check_weights(w2, x, "w2", 3);
  const int64_t N = x.size(0), H = x.size(1), S = w13.size(0), I = w13.size(1) / 2;
  TORCH_CHECK(w13.size(1) == 2 * I && w13.size(2) == H, "w13 must be [S, 2I, H=", H, "], got ",
              w13.sizes());
  TORCH_CHECK(w2.size(0) == S && w2.size(1) == H && w2.size(2) == I, "w2 must be [S=", S,
              ", H=", H, ", I=", I, "], got ", w2.sizes());
  TORCH_CHECK(act == 0 || act == 1, "act=", act, " is not 0 (silu) or 1 (clamped swiglu)");
  if (b13) check_weights(*b13, x, "b13", 2);
  if (b2) check_weights(*b2, x, "b2", 2);
  TORCH_CHECK(!b13 || (b13->size(0) == S && b13->size(1) == 2 * I), "b13 must be [S, 2I]");
  TORCH_CHECK(!b2 || (b2->size(0) == S && b2->size(1) == H), "b2 must be [S, H]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == N &&
                  slots.is_contiguous(),
              "slots must be a contiguous int64 [N=", N, "] tensor");
  at::Tensor out = at::empty({N, H}, x.options());
  if (N == 0) return out;
  const int64_t* sp = slots.data_ptr<int64_t>();
  std::vector<int64_t> first(S + 1, 0), order(N);
  for (int64_t n = 0; n < N; ++n) {
    TORCH_CHECK(sp[n] >= 0 && sp[n] < S, "slots[", n, "]=", sp[n], " is outside [0, ", S, ")");
    ++first[sp[n] + 1];
  }
  for (int64_t s = 0; s < S; ++s) first[s + 1] += first[s];
  std::vector<int64_t> fill(first.begin(), first.end() - 1);
  for (int64_t n = 0; n < N; ++n) order[fill[sp[n]]++] = n;
  if (x.scalar_type() == at::kFloat)
    experts<float>(t, x, order, first, w13, w2, b13, b2, int(act), float(alpha), float(limit),
                   out);
  else
    experts<uint16_t>(t, x, order, first, w13, w2, b13, b2, int(act), float(alpha),
                      float(limit), out);
  return out;
}

template <typename T>
void linear_impl(const IsaTable* t, const at::Tensor& x, const at::Tensor& w, const T* b,
                 at::Tensor& out) {
  const int64_t N = x.size(0), K = x.size(1), O = w.size(0);
  const T* xp = reinterpret_cast<const T*>(x.data_ptr());
  const T* wp = reinterpret_cast<const T*>(w.data_ptr());
  T* op = reinterpret_cast<T*>(out.data_ptr());
  std::vector<const T*> xr(N);
  for (int64_t i = 0; i < N; ++i) xr[i] = xp + i * K;
  const int64_t nt = at::get_num_threads();
  const int64_t cb = std::clamp<int64_t>((O / (8 * nt) + 3) / 4 * 4, 16, 128);
  const std::vector<Item> its = items({0, N}, O, cb);
  run_items(int64_t(its.size()), [&](int64_t k, std::vector<float>& buf) {
    const Item& it = its[k];
    const int64_t m = it.r1 - it.r0, n = it.c1 - it.c0;
    float* y = room(buf, m * n);
    gemm(t, xr.data() + it.r0, m, wp + it.c0 * K, K, n, K, y, n);
    if (b) add_bias(y, m, n, n, b + it.c0);
    for (int64_t r = 0; r < m; ++r)
      for (int64_t c = 0; c < n; ++c) store(y[r * n + c], op + (it.r0 + r) * O + it.c0 + c);
  });
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& b,
                  c10::string_view isa) {
  const IsaTable* t = pick(isa);
  check_x(x);
  check_weights(w, x, "w", 2);
  TORCH_CHECK(w.size(1) == x.size(1), "w must be [O, K=", x.size(1), "], got ", w.sizes());
  if (b) check_weights(*b, x, "b", 1);
  TORCH_CHECK(!b || b->size(0) == w.size(0), "b must be [O=", w.size(0), "]");
  at::Tensor out = at::empty({x.size(0), w.size(0)}, x.options());
  if (x.size(0) == 0) return out;
  if (x.scalar_type() == at::kFloat)
    linear_impl<float>(t, x, w, ptr_or_null<float>(b), out);
  else
    linear_impl<uint16_t>(t, x, w, ptr_or_null<uint16_t>(b), out);
  return out;
}

}  // namespace

std::vector<std::string> isas() {
  std::vector<std::string> v;
  for (const IsaTable* t : available()) v.emplace_back(t->name);
  return v;
}

}  // namespace xllm_eplb_kernels

TORCH_LIBRARY(xllm_eplb, m) {
  m.def("fused_experts(Tensor x, Tensor slots, Tensor w13, Tensor w2, Tensor? b13, Tensor? b2, "
        "int act, float alpha, float limit, str isa) -> Tensor");
  m.def("linear(Tensor x, Tensor w, Tensor? b, str isa) -> Tensor");
  m.def("isas() -> str[]", &xllm_eplb_kernels::isas);
}

TORCH_LIBRARY_IMPL(xllm_eplb, CPU, m) {
  m.impl("fused_experts", xllm_eplb_kernels::fused_experts);
  m.impl("linear", xllm_eplb_kernels::linear);
}
