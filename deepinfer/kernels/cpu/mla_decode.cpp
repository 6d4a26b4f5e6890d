// MLA absorbed paged decode attention on CPU: the contract of deepinfer/kernels/mla_decode.py
// (mla_decode_reference) without scales or a DSA selection.
//
// For request r and head h: o[r, h] = softmax(scale * q[r, h] . k_p) @ k_p[:latent] over positions
// p < seq_lens[r], where k_p is row block_table[r, p / bs] * bs + p % bs of the pool. One pass over the
// context with an online softmax: each pool row is read once for a group of heads, where the torch path
// gathers the context into a copy and reads it twice (scores, then values). Padding rows are never read.
//
// Layout of the work: items are (request, group of up to GROUP heads), split across torch's intra-op
// threads. Positions go in tiles of up to TILE rows inside one block (contiguous in the pool): the tile's
// scores for every head of the group first (GROUP independent accumulator chains per dot, so the dot is
// not latency-bound), one rescale of the running sums per tile, then the tile's rows added to the sums.
// Arithmetic is float32 whatever the storage dtype; the output has q's dtype.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

constexpr int64_t GROUP = 4;  // heads sharing one read of each row
constexpr int64_t TILE = 16;  // positions scored before the running sums are touched
constexpr int64_t VEC = 8;    // floats per vector (one AVX2 register)
typedef float vecf __attribute__((vector_size(VEC * sizeof(float))));

inline vecf load(const float* p) {
  vecf v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}
inline void store(float* p, vecf v) { __builtin_memcpy(p, &v, sizeof(v)); }
inline float hsum(vecf v) {
  float s = 0.f;
  for (int i = 0; i < VEC; ++i) s += v[i];
  return s;
}

// s[h] = q[h] . k for the group's nh heads; q rows are `dim` floats apart.
inline void group_dots(const float* q, const float* k, int64_t dim, int64_t nh, float* s) {
  vecf a0 = {}, a1 = {}, a2 = {}, a3 = {};
  const int64_t whole = dim - dim % VEC;
  for (int64_t d = 0; d < whole; d += VEC) {
    const vecf kv = load(k + d);
    a0 += load(q + d) * kv;
    if (nh > 1) a1 += load(q + dim + d) * kv;
    if (nh > 2) a2 += load(q + 2 * dim + d) * kv;
    if (nh > 3) a3 += load(q + 3 * dim + d) * kv;
  }
  s[0] = hsum(a0), s[1] = hsum(a1), s[2] = hsum(a2), s[3] = hsum(a3);
  for (int64_t d = whole; d < dim; ++d)
    for (int64_t h = 0; h < nh; ++h) s[h] += q[h * dim + d] * k[d];
}

// acc[h] = acc[h] * c[h] + sum_t w[t][h] * rows[t][:latent]
inline void group_update(float* acc, const float* c, const float (*w)[GROUP], const float* const* rows, int64_t n,
                         int64_t latent, int64_t nh) {
  for (int64_t h = 0; h < nh; ++h) {
    float* a = acc + h * latent;
    const vecf ch = vecf{} + c[h];
    const int64_t whole = latent - latent % VEC;
    for (int64_t d = 0; d < whole; d += VEC) {
      vecf v = load(a + d) * ch;
      for (int64_t t = 0; t < n; ++t) v += (vecf{} + w[t][h]) * load(rows[t] + d);
      store(a + d, v);
    }
    for (int64_t d = whole; d < latent; ++d) {
      float v = a[d] * c[h];
      for (int64_t t = 0; t < n; ++t) v += w[t][h] * rows[t][d];
      a[d] = v;
    }
  }
}

struct Problem {
  int64_t heads, dim, latent, width, block_size;
  float scale;
};

template <typename T>
struct Rows {  // float views of pool rows (a converted copy for 16-bit pools)
  std::vector<float> buf;
  explicit Rows(int64_t dim) : buf(std::is_same<T, float>::value ? 0 : TILE * dim) {}
  const float* get(const T* row, int64_t t, int64_t dim) {
    if constexpr (std::is_same<T, float>::value) return row;
    float* out = buf.data() + t * dim;
    for (int64_t i = 0; i < dim; ++i) out[i] = static_cast<float>(row[i]);
    return out;
  }
};

// Heads [h0, h0 + nh) of one request over its first `len` positions.
template <typename T>
void attend_group(const T* q, const T* pool, const int64_t* table, int64_t len, T* out, const Problem& P,
                  int64_t h0, int64_t nh, float* qf, float* acc, Rows<T>& rows) {
  const int64_t D = P.dim, L = P.latent;
  for (int64_t i = 0; i < nh * D; ++i) qf[i] = static_cast<float>(q[h0 * D + i]);
  float best[GROUP], total[GROUP], s[GROUP], c[GROUP], w[TILE][GROUP];
  const float* tile[TILE];
  std::fill(best, best + GROUP, -std::numeric_limits<float>::infinity());
  std::fill(total, total + GROUP, 0.f);
  std::fill(acc, acc + nh * L, 0.f);
  for (int64_t p = 0; p < len;) {
    const int64_t in_block = p % P.block_size, n = std::min({TILE, len - p, P.block_size - in_block});
    const T* base = pool + (table[p / P.block_size] * P.block_size + in_block) * D;
    float tile_max[GROUP];
    std::fill(tile_max, tile_max + GROUP, -std::numeric_limits<float>::infinity());
    for (int64_t t = 0; t < n; ++t) {
      tile[t] = rows.get(base + t * D, t, D);
      group_dots(qf, tile[t], D, nh, s);
      for (int64_t h = 0; h < nh; ++h) w[t][h] = s[h] * P.scale, tile_max[h] = std::max(tile_max[h], w[t][h]);
    }
    for (int64_t h = 0; h < nh; ++h) {  // new running max: what was summed so far is rescaled once
      const float m = std::max(best[h], tile_max[h]);
      c[h] = std::exp(best[h] - m);
      best[h] = m;
      float sum = 0.f;
      for (int64_t t = 0; t < n; ++t) sum += (w[t][h] = std::exp(w[t][h] - m));
      total[h] = total[h] * c[h] + sum;
    }
    group_update(acc, c, w, tile, n, L, nh);
    p += n;
  }
  for (int64_t h = 0; h < nh; ++h) {
    const float inv = total[h] > 0.f ? 1.f / total[h] : 0.f;  // nothing attended: zeros
    T* o = out + (h0 + h) * L;
    for (int64_t i = 0; i < L; ++i) o[i] = static_cast<T>(acc[h * L + i] * inv);
  }
}

template <typename T>
void run(const at::Tensor& q, const at::Tensor& pool, const at::Tensor& table, const at::Tensor& lens,
         at::Tensor& out, const Problem& P) {
  const int64_t rows = q.size(0), groups = (P.heads + GROUP - 1) / GROUP;
  const T* qp = q.data_ptr<T>();
  const T* kp = pool.data_ptr<T>();
  const int64_t* tp = table.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows * groups, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(GROUP * P.dim), acc(GROUP * P.latent);
    Rows<T> buf(P.dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / groups, h0 = (item % groups) * GROUP, nh = std::min(GROUP, P.heads - h0);
      const int64_t len = std::min(std::max<int64_t>(lp[r], 0), P.width * P.block_size);
      attend_group<T>(qp + r * P.heads * P.dim, kp, tp + r * P.width, len, op + r * P.heads * P.latent, P, h0, nh,
                      qf.data(), acc.data(), buf);
    }
  });
}

at::Tensor mla_decode(const at::Tensor& q, const at::Tensor& pool, const at::Tensor& table,
                      const at::Tensor& lens, int64_t block_size, int64_t latent, double scale) {
  TORCH_CHECK(q.dim() == 3 && pool.dim() == 2 && table.dim() == 2 && lens.dim() == 1, "mla_decode: bad ranks");
  TORCH_CHECK(q.size(2) == pool.size(1) && latent <= q.size(2), "mla_decode: q and pool widths differ");
  TORCH_CHECK(q.scalar_type() == pool.scalar_type(), "mla_decode: q and pool dtypes differ");
  TORCH_CHECK(table.scalar_type() == at::kLong && lens.scalar_type() == at::kLong, "mla_decode: int64 indices");
  TORCH_CHECK(table.size(0) == q.size(0) && lens.size(0) == q.size(0), "mla_decode: one table row per query");
  TORCH_CHECK(pool.stride(1) == 1 && pool.stride(0) == pool.size(1), "mla_decode: the pool must be contiguous");
  auto qc = q.contiguous(), tc = table.contiguous(), lc = lens.contiguous();
  auto out = at::empty({q.size(0), q.size(1), latent}, q.options());
  Problem P{q.size(1), q.size(2), latent, table.size(1), block_size, static_cast<float>(scale)};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "mla_decode", [&] {
    run<scalar_t>(qc, pool, tc, lc, out, P);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(deepinfer_cpu, m) {
  m.def("mla_decode(Tensor q, Tensor pool, Tensor block_table, Tensor seq_lens, int block_size, int latent, "
        "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(deepinfer_cpu, CPU, m) { m.impl("mla_decode", &mla_decode); }
