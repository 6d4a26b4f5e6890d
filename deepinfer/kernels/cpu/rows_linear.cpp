// x @ w^T for a few rows of x on CPU: the LM head of a decode step ([M, K] x [N, K], M small, N the vocabulary).
//
// BLAS's path for this shape (a GEMV with a short K against a tall, row-major w) reads w at about half the
// speed a plain streaming pass does, and twice as slowly again when w is not in cache, which is the usual case
// for a head read once per step (measured, docs/performance.md). Here every row of w is read once, in storage
// order, for all M rows of x: out[m, n] = sum_k x[m, k] * w[n, k].
//
// Work: w's rows are cut into ROWS equal segments, read side by side: group j is row j of every segment, and
// each row of x is dotted with the group's ROWS rows at once (ROWS independent accumulator chains). Reading
// ROWS distant sequential streams rather than one keeps more cache misses in flight (one stream measured at
// about 60% of BLAS's transposed-layout speed on a cold w). Groups are split across torch's intra-op threads.
// x is converted to float32 once; arithmetic is float32 whatever the storage dtype; the output has x's dtype.
// Each output element is one dot in a fixed order: it does not depend on M, on the thread count or on the
// other rows.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

namespace {

constexpr int64_t ROWS = 4;     // rows of w per accumulator group
constexpr int64_t VEC = 8;      // floats per vector (one AVX2 register)
constexpr int64_t GRAIN = 256;  // rows of w per task at the least (a task under ~16 KB is not worth a thread)
typedef float vecf __attribute__((vector_size(VEC * sizeof(float))));

inline vecf load(const float* p) {
  vecf v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}
inline float hsum(vecf v) {
  float s = 0.f;
  for (int i = 0; i < VEC; ++i) s += v[i];
  return s;
}

template <typename T>
struct WRows {  // float views of w's rows (a converted copy for 16-bit storage)
  std::vector<float> buf;
  WRows(int64_t k) : buf(std::is_same<T, float>::value ? 0 : ROWS * k) {}
  const float* get(const T* row, int64_t r, int64_t k) {
    if constexpr (std::is_same<T, float>::value) return row;
    float* out = buf.data() + r * k;
    for (int64_t i = 0; i < k; ++i) out[i] = static_cast<float>(row[i]);
    return out;
  }
};

// s[r] = x . w[r] for r < ROWS (rows past n repeat the last one; only n are stored by the caller).
inline void dots(const float* x, const float* const* w, int64_t k, float* s) {
  vecf a0 = {}, a1 = {}, a2 = {}, a3 = {};
  const int64_t whole = k - k % VEC;
  for (int64_t d = 0; d < whole; d += VEC) {
    const vecf xv = load(x + d);
    a0 += xv * load(w[0] + d), a1 += xv * load(w[1] + d), a2 += xv * load(w[2] + d), a3 += xv * load(w[3] + d);
  }
  s[0] = hsum(a0), s[1] = hsum(a1), s[2] = hsum(a2), s[3] = hsum(a3);
  for (int64_t d = whole; d < k; ++d)
    for (int64_t r = 0; r < ROWS; ++r) s[r] += x[d] * w[r][d];
}

template <typename T>
void run(const float* x, const T* w, T* out, int64_t m, int64_t n, int64_t k) {
  const int64_t seg = (n + ROWS - 1) / ROWS;  // group j reads rows j, seg + j, 2 seg + j, 3 seg + j
  at::parallel_for(0, seg, GRAIN / ROWS, [&](int64_t begin, int64_t end) {
    WRows<T> rows(k);
    const float* w4[ROWS];
    int64_t at[ROWS];
    float s[ROWS];
    for (int64_t j = begin; j < end; ++j) {
      for (int64_t r = 0; r < ROWS; ++r) {
        at[r] = std::min(r * seg + j, n - 1);  // past n: a repeat of the last row, never stored
        w4[r] = rows.get(w + at[r] * k, r, k);
      }
      for (int64_t i = 0; i < m; ++i) {
        dots(x + i * k, w4, k, s);
        for (int64_t r = 0; r < ROWS; ++r)
          if (r * seg + j < n) out[i * n + at[r]] = static_cast<T>(s[r]);
      }
    }
  });
}

at::Tensor rows_linear(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "rows_linear: x [M, K] and w [N, K]");
  TORCH_CHECK(x.size(1) == w.size(1), "rows_linear: x and w widths differ");
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "rows_linear: x and w dtypes differ");
  auto wc = w.contiguous();
  auto xf = x.to(at::kFloat).contiguous();
  auto out = at::empty({x.size(0), w.size(0)}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rows_linear", [&] {
    run<scalar_t>(xf.data_ptr<float>(), wc.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), x.size(0), w.size(0),
                  x.size(1));
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(deepinfer_cpu, m) { m.def("rows_linear(Tensor x, Tensor w) -> Tensor"); }

TORCH_LIBRARY_IMPL(deepinfer_cpu, CPU, m) { m.impl("rows_linear", &rows_linear); }
