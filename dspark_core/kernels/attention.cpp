// Attention of each query row over exactly the keys it sees, each (row, head) computed as if alone, for the lean
// decoder's batch-invariant path (dspark_core/fast_decoder.py): out[r, h, i] = softmax(scale q k^T over the first
// lengths[r, i] keys) v. Every (row, head) runs the same sequence of operations whatever else is in the call
// (other rows, other sequences, padding, thread count), so a row of a verify pass or a prefill equals the
// one-row decode step at its position bit for bit. One call per layer replaces one SDPA call per row.
//
// q [n, h, Q, d], k / v [n, kvh, KV, d] (any strides, the last dimension contiguous), lengths int64 [n, Q]
// (0: a padded row, output zeros); d % 16 == 0; grouped-query heads (h % kvh == 0).
//
// The rows of a verify pass or a prefill see (nearly) the same keys: a task takes a block of up to 8 rows of one
// sequence and the query heads of one key head, and loads each block of keys / values once for all of them
// (from L1) instead of once per (row, head). On a 2-core AVX2 EPYC (scripts/kernel_ab.py): 0.81x at 8 rows,
// context 256, 0.70x at context 768 (docs/results/weights/README.md). With AVX512's 32 vector registers a row's
// heads also share each value load in the weighted sums (value_tile): 0.91-0.96x again on an AVX512 EPYC.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <vector>
#include <immintrin.h>

#include "parallel.h"
#include "vec_math.h"

namespace {

using namespace dspark_kernels;

inline float dot(const float* a, const float* b, int64_t d) {
  f32x16 acc = mul(load(a), load(b));
  for (int64_t e = 16; e < d; e += 16) acc = fmadd(load(a + e), load(b + e), acc);
  return reduce_add(acc);
}

constexpr int kMaxChunks = 16;  // d <= 256
constexpr int64_t kRowBlock = 8;  // query rows of one sequence that share each key / value load
constexpr int64_t kValueTile = 32;  // keys whose values stay in L1 while every row and head reads them
#if defined(__AVX512F__)
constexpr int kAccVectors = 16;  // f32x16 accumulators the value sums may keep in registers (32 zmm)
#else
constexpr int kAccVectors = 4;  // an f32x16 is two ymm of 16: more than one head's accumulators would spill
#endif

// One tile of keys [j0, j1) of the weighted value sums of N (row, head) pairs that see all of them: each value
// vector is loaded once for the N; each pair's accumulator adds fmadd(p, v) in key order, as when alone.
template <int C, int N>
inline void value_tile(const float* v, int64_t vs, int64_t j0, int64_t j1, const float* const* s, float* const* ab) {
  f32x16 acc[N][C];
  for (int g = 0; g < N; ++g)
    for (int c = 0; c < C; ++c) acc[g][c] = load(ab[g] + 16 * c);
  for (int64_t j = j0; j < j1; ++j) {
    const float* vj = v + j * vs;
    f32x16 p[N];
    for (int g = 0; g < N; ++g) p[g] = set1(s[g][j]);
    for (int c = 0; c < C; ++c) {
      const f32x16 vv = load(vj + 16 * c);
      for (int g = 0; g < N; ++g) acc[g][c] = fmadd(p[g], vv, acc[g][c]);
    }
  }
  for (int g = 0; g < N; ++g)
    for (int c = 0; c < C; ++c) store(ab[g] + 16 * c, acc[g][c]);
}

// software prefetches of rows [j0, j1) of a [*, stride] float matrix, d floats a row
constexpr int64_t kKeysAhead = 32;
template <int Hint>
inline void prefetch_rows(const float* base, int64_t stride, int64_t j0, int64_t j1, int64_t d) {
  for (int64_t j = j0; j < j1; ++j)
    for (int64_t e = 0; e < d; e += 16) {
      const char* p = reinterpret_cast<const char*>(base + j * stride + e);
      if constexpr (Hint == _MM_HINT_T0) _mm_prefetch(p, _MM_HINT_T0); else _mm_prefetch(p, _MM_HINT_T1);
    }
}

// the heads of one row that share each value load (C > 0): as many as fit kAccVectors accumulators, 1 to 4
constexpr int kMaxHeadsPerLoad = 4;
template <int C>
constexpr int kHeadsPerLoad = std::max(1, std::min(kMaxHeadsPerLoad, kAccVectors / C));

// value_tile for n <= kHeadsPerLoad<C> pairs, n known only at run time
template <int C>
inline void value_heads(const float* v, int64_t vs, int64_t j0, int64_t j1, const float* const* s, float* const* ab,
                        int n) {
  if constexpr (kHeadsPerLoad<C> >= 4) if (n == 4) return value_tile<C, 4>(v, vs, j0, j1, s, ab);
  if constexpr (kHeadsPerLoad<C> >= 3) if (n == 3) return value_tile<C, 3>(v, vs, j0, j1, s, ab);
  if constexpr (kHeadsPerLoad<C> >= 2) if (n == 2) return value_tile<C, 2>(v, vs, j0, j1, s, ab);
  value_tile<C, 1>(v, vs, j0, j1, s, ab);
}

// Rows [0, R) of one sequence (query row i at q + i qr, head g at + g qh), the G query heads that share one key /
// value head. Each (row, head) runs exactly the operations of a one-row call, in the same order: its key scores
// (`dot`'s sequence and reduce_add tree; sixteen keys at once through reduce_add16, which keeps each lane's tree),
// its softmax, and its weighted sum of the values in key order. Only the loop nesting differs: a block of keys is
// loaded once for every row and head that reads it, instead of once per (row, head).
template <int C>
void rows_group(const float* q, int64_t qr, int64_t qh, const float* k, int64_t ks, const float* v, int64_t vs,
                const int64_t* len, int64_t R, int64_t G, int64_t d, float scale, float* out, int64_t orow,
                int64_t ohead, std::vector<float>& buf) {
  const int64_t chunks = C > 0 ? C : d / 16;
  int64_t maxlen = 0;
  for (int64_t i = 0; i < R; ++i) maxlen = std::max(maxlen, len[i]);
  const int64_t padded = (maxlen + 15) / 16 * 16;
  const int64_t scores = R * G * padded, accs = R * G * chunks * 16;
  if (static_cast<int64_t>(buf.size()) < scores + accs + R * G) buf.resize(scores + accs + R * G);
  float* sbuf = buf.data();
  float* abuf = sbuf + scores;
  float* inv = abuf + accs;
  const f32x16 sv = set1(scale);
  // scores: blocks of 16 keys, each scored for every (row, head) that sees all sixteen. The task's keys and values
  // are not in cache (a step streams every layer's weights between two reads of a layer's cache): each block asks
  // for the keys kKeysAhead further on and for its own values, which the weighted sums read after the softmax
  prefetch_rows<_MM_HINT_T0>(k, ks, 0, std::min(kKeysAhead, maxlen), d);
  prefetch_rows<_MM_HINT_T1>(v, vs, maxlen / 16 * 16, maxlen, d);  // the values of the keys past the last block
  for (int64_t j = 0; j + 16 <= maxlen; j += 16) {
    prefetch_rows<_MM_HINT_T0>(k, ks, j + kKeysAhead, std::min(j + kKeysAhead + 16, maxlen), d);
    prefetch_rows<_MM_HINT_T1>(v, vs, j, j + 16, d);
    for (int64_t i = 0; i < R; ++i) {
      if (j + 16 > len[i]) continue;
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = q + i * qr + g * qh;
        f32x16 qv[kMaxChunks];
        for (int64_t c = 0; c < chunks; ++c) qv[c] = load(qg + 16 * c);
        f32x16 a[16];
        for (int l = 0; l < 16; ++l) {
          const float* kj = k + (j + l) * ks;
          f32x16 acc = mul(qv[0], load(kj));
          for (int64_t c = 1; c < chunks; ++c) acc = fmadd(qv[c], load(kj + 16 * c), acc);
          a[kReduce16Slot[l]] = acc;
        }
        store(sbuf + (i * G + g) * padded + j, mul(reduce_add16(a), sv));
      }
    }
  }
  // the keys past each row's last full block of 16, one at a time; then each (row, head)'s softmax
  for (int64_t i = 0; i < R; ++i) {
    const int64_t n = len[i];
    for (int64_t g = 0; g < G; ++g) {
      float* s = sbuf + (i * G + g) * padded;
      const float* qg = q + i * qr + g * qh;
      for (int64_t j = n / 16 * 16; j < n; ++j) s[j] = dot(qg, k + j * ks, d) * scale;
      if (n <= 0) continue;
      const int64_t np = (n + 15) / 16 * 16;
      float m = -INFINITY;
      for (int64_t j = 0; j < n; ++j) m = s[j] > m ? s[j] : m;
      for (int64_t j = n; j < np; ++j) s[j] = -INFINITY;
      const f32x16 mv = set1(m);
      f32x16 sum = zero();
      for (int64_t j = 0; j < np; j += 16) {
        const f32x16 p = dspark_kernels::exp(sub(load(s + j), mv));
        store(s + j, p);
        sum = add(sum, p);
      }
      inv[i * G + g] = 1.0f / reduce_add(sum);
    }
  }
  // the weighted sums: each (row, head)'s accumulators in registers over a tile of keys, in key order
  for (int64_t e = 0; e < accs; e += 16) store(abuf + e, zero());
  for (int64_t j0 = 0; j0 < maxlen; j0 += kValueTile) {
    for (int64_t i = 0; i < R; ++i) {
      const int64_t j1 = std::min(j0 + kValueTile, len[i]);
      if (j1 <= j0) continue;
      if constexpr (C > 0) {
        for (int64_t g0 = 0; g0 < G; g0 += kHeadsPerLoad<C>) {
          const int n = static_cast<int>(std::min<int64_t>(kHeadsPerLoad<C>, G - g0));
          const float* s[kMaxHeadsPerLoad];
          float* ab[kMaxHeadsPerLoad];
          for (int g = 0; g < n; ++g) {
            s[g] = sbuf + (i * G + g0 + g) * padded;
            ab[g] = abuf + (i * G + g0 + g) * chunks * 16;
          }
          value_heads<C>(v, vs, j0, j1, s, ab, n);
        }
        continue;
      }
      for (int64_t g = 0; g < G; ++g) {
        const float* s = sbuf + (i * G + g) * padded;
        float* ab = abuf + (i * G + g) * chunks * 16;
        f32x16 acc[kMaxChunks];
        for (int64_t c = 0; c < chunks; ++c) acc[c] = load(ab + 16 * c);
        for (int64_t j = j0; j < j1; ++j) {
          const float* vj = v + j * vs;
          const f32x16 p = set1(s[j]);
          for (int64_t c = 0; c < chunks; ++c) acc[c] = fmadd(p, load(vj + 16 * c), acc[c]);
        }
        for (int64_t c = 0; c < chunks; ++c) store(ab + 16 * c, acc[c]);
      }
    }
  }
  for (int64_t i = 0; i < R; ++i)
    for (int64_t g = 0; g < G; ++g) {
      float* o = out + i * orow + g * ohead;
      if (len[i] <= 0) {
        for (int64_t e = 0; e < d; ++e) o[e] = 0.0f;
        continue;
      }
      const f32x16 iv = set1(inv[i * G + g]);
      const float* ab = abuf + (i * G + g) * chunks * 16;
      for (int64_t c = 0; c < chunks; ++c) store(o + 16 * c, mul(load(ab + 16 * c), iv));
    }
}

using GroupFn = void (*)(const float*, int64_t, int64_t, const float*, int64_t, const float*, int64_t, const int64_t*,
                         int64_t, int64_t, int64_t, float, float*, int64_t, int64_t, std::vector<float>&);

GroupFn group_fn(int64_t d) {
  if (d == 64) return rows_group<4>;
  if (d == 128) return rows_group<8>;
  return rows_group<0>;
}

}  // namespace

torch::Tensor attention_impl(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                             const torch::Tensor& lengths, double scale, bool rows_major) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "q, k, v must be [n, heads, rows, d]");
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && k.scalar_type() == torch::kFloat32 &&
              v.scalar_type() == torch::kFloat32, "q, k, v must be float32");
  const int64_t n = q.size(0), h = q.size(1), Q = q.size(2), d = q.size(3), kvh = k.size(1), KV = k.size(2);
  TORCH_CHECK(d % 16 == 0 && d <= 256, "head dim must be a multiple of 16, at most 256, got ", d);
  TORCH_CHECK(k.size(0) == n && v.size(0) == n && v.size(1) == kvh && v.size(2) == KV && k.size(3) == d &&
              v.size(3) == d && kvh > 0 && h % kvh == 0, "k, v do not match q");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "the last dimension must be contiguous");
  TORCH_CHECK(lengths.scalar_type() == torch::kLong && lengths.dim() == 2 && lengths.size(0) == n &&
              lengths.size(1) == Q && lengths.is_contiguous(), "lengths must be int64 [n, rows]");
  const int64_t* len = lengths.data_ptr<int64_t>();
  int64_t keys = 0;  // keys scored in all, for the work of the call below
  for (int64_t i = 0; i < n * Q; ++i) {
    TORCH_CHECK(len[i] >= 0 && len[i] <= KV, "length ", len[i], " out of range");
    keys += len[i];
  }
  auto out = rows_major ? torch::empty({n * Q, h * d}, torch::kFloat32) : torch::empty({n, h, Q, d}, torch::kFloat32);
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // the multiply-adds of the call (scores and weighted sums over each row's keys): split between threads only from
  // parallel.h's threshold on
  const bool split = dspark_kernels::splits(2 * keys * h * d);
  // smaller row blocks where there would be too few tasks to keep every thread busy (results do not depend on it)
  int64_t rb = kRowBlock;
  const int64_t threads = split ? at::get_num_threads() : 1;
  while (threads > 1 && rb > 1 && n * kvh * ((Q + rb - 1) / rb) < 2 * threads) rb /= 2;
  const int64_t group = h / kvh, blocks = (Q + rb - 1) / rb;
  const GroupFn fn = group_fn(d);
  // one task: a sequence's key / value head, the query heads that share it, and a block of up to 8 query rows
  const int64_t tasks = n * kvh * blocks;
  at::parallel_for(0, tasks, dspark_kernels::grain_for(tasks, split, 1), [&](int64_t t0, int64_t t1) {
    std::vector<float> buf;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t r = t / (kvh * blocks), g = t / blocks % kvh, i0 = t % blocks * rb;
      const int64_t R = std::min(rb, Q - i0), hh = g * group;
      float* o = op + (rows_major ? ((r * Q + i0) * h + hh) * d : ((r * h + hh) * Q + i0) * d);
      fn(qp + r * q.stride(0) + hh * q.stride(1) + i0 * q.stride(2), q.stride(2), q.stride(1),
         kp + r * k.stride(0) + g * k.stride(1), k.stride(2), vp + r * v.stride(0) + g * v.stride(1), v.stride(2),
         len + r * Q + i0, R, group, d, static_cast<float>(scale), o, rows_major ? h * d : d,
         rows_major ? d : Q * d, buf);
    }
  });
  return out;
}

torch::Tensor row_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                            const torch::Tensor& lengths, double scale) {
  return attention_impl(q, k, v, lengths, scale, false);
}

torch::Tensor row_attention_rows(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                 const torch::Tensor& lengths, double scale) {
  return attention_impl(q, k, v, lengths, scale, true);
}

TORCH_LIBRARY_FRAGMENT(dspark_cpu, m) {
  m.def("row_attention(Tensor q, Tensor k, Tensor v, Tensor lengths, float scale) -> Tensor", row_attention);
  m.def("row_attention_rows(Tensor q, Tensor k, Tensor v, Tensor lengths, float scale) -> Tensor", row_attention_rows);
}
