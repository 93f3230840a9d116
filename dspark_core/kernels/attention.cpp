// Attention of each query row over exactly the keys it sees, one (row, head) at a time, for the lean decoder's
// batch-invariant path (dspark_core/fast_decoder.py): out[r, h, i] = softmax(scale q k^T over the first
// lengths[r, i] keys) v. Every (row, head) runs the same sequence of operations whatever else is in the call
// (other rows, other sequences, padding, thread count), so a row of a verify pass or a prefill equals the
// one-row decode step at its position bit for bit. One call per layer replaces one SDPA call per row.
//
// q [n, h, Q, d], k / v [n, kvh, KV, d] (any strides, the last dimension contiguous), lengths int64 [n, Q]
// (0: a padded row, output zeros); d % 16 == 0; grouped-query heads (h % kvh == 0).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <utility>
#include <vector>

#include "vec_math.h"

namespace {

using namespace dspark_kernels;

inline float dot(const float* a, const float* b, int64_t d) {
  f32x16 acc = mul(load(a), load(b));
  for (int64_t e = 16; e < d; e += 16) acc = fmadd(load(a + e), load(b + e), acc);
  return reduce_add(acc);
}

// The G heads of one row that share a key / value head (grouped-query attention), each head exactly as it would
// be alone: C = d / 16 when the head size is a common one (the loops unroll and q, the key dots and the output
// accumulators stay in registers), 0 for any other d (runtime loops, G = 1). Every variant gives the same bits:
// every key's score is `dot`'s sequence of operations and its reduce_add tree (sixteen keys reduce at once in
// reduce_add16, which sums each lane by that same tree), and each head's softmax and weighted sum of the values
// run in key order. The heads share only the loads (and the out-of-order core overlaps their chains).
template <int C, int G>
void one_group(const float* q, int64_t qs, const float* k, int64_t ks, const float* v, int64_t vs, int64_t len,
               int64_t d, float scale, float* out, int64_t os, std::vector<float>& buf) {
  const int64_t chunks = C > 0 ? C : d / 16;
  if (len <= 0) {
    for (int g = 0; g < G; ++g)
      for (int64_t e = 0; e < d; ++e) out[g * os + e] = 0.0f;
    return;
  }
  const int64_t padded = (len + 15) / 16 * 16;
  if (static_cast<int64_t>(buf.size()) < G * padded) buf.resize(G * padded);
  constexpr int kMaxChunks = 16;  // d <= 256
  const f32x16 sv = set1(scale);
  float inv[G];
  for (int g = 0; g < G; ++g) {
    float* s = buf.data() + g * padded;
    const float* qg = q + g * qs;
    f32x16 qv[kMaxChunks];
    for (int64_t c = 0; c < chunks; ++c) qv[c] = load(qg + 16 * c);
    int64_t j = 0;
    for (; j + 16 <= len; j += 16) {
      f32x16 a[16];
      for (int l = 0; l < 16; ++l) {
        const float* kj = k + (j + l) * ks;
        f32x16 acc = mul(qv[0], load(kj));
        for (int64_t c = 1; c < chunks; ++c) acc = fmadd(qv[c], load(kj + 16 * c), acc);
        a[kReduce16Slot[l]] = acc;
      }
      store(s + j, mul(reduce_add16(a), sv));
    }
    for (; j < len; ++j) s[j] = dot(qg, k + j * ks, d) * scale;
    float m = -INFINITY;
    for (j = 0; j < len; ++j) m = s[j] > m ? s[j] : m;
    for (j = len; j < padded; ++j) s[j] = -INFINITY;
    const f32x16 mv = set1(m);
    f32x16 sum = zero();
    for (j = 0; j < padded; j += 16) {
      const f32x16 p = dspark_kernels::exp(sub(load(s + j), mv));
      store(s + j, p);
      sum = add(sum, p);
    }
    inv[g] = 1.0f / reduce_add(sum);
  }
  f32x16 acc[G][kMaxChunks];
  for (int g = 0; g < G; ++g)
    for (int64_t c = 0; c < chunks; ++c) acc[g][c] = zero();
  for (int64_t j = 0; j < len; ++j) {
    const float* vj = v + j * vs;
    f32x16 p[G];
    for (int g = 0; g < G; ++g) p[g] = set1(buf[g * padded + j]);
    for (int64_t c = 0; c < chunks; ++c) {
      const f32x16 vv = load(vj + 16 * c);
      for (int g = 0; g < G; ++g) acc[g][c] = fmadd(p[g], vv, acc[g][c]);
    }
  }
  for (int g = 0; g < G; ++g) {
    const f32x16 iv = set1(inv[g]);
    for (int64_t c = 0; c < chunks; ++c) store(out + g * os + 16 * c, mul(acc[g][c], iv));
  }
}

using GroupFn = void (*)(const float*, int64_t, const float*, int64_t, const float*, int64_t, int64_t, int64_t, float,
                         float*, int64_t, std::vector<float>&);

// (kernel, heads per call) for head size d and `group` query heads per key head
std::pair<GroupFn, int64_t> group_fn(int64_t d, int64_t group) {
  if (d == 64) {
    if (group % 4 == 0) return {one_group<4, 4>, 4};
    if (group % 3 == 0) return {one_group<4, 3>, 3};
    if (group % 2 == 0) return {one_group<4, 2>, 2};
    return {one_group<4, 1>, 1};
  }
  if (d == 128) {
    if (group % 2 == 0) return {one_group<8, 2>, 2};
    return {one_group<8, 1>, 1};
  }
  return {one_group<0, 1>, 1};
}

}  // namespace

// rows_major: the output as [n * Q, h * d] (row r * Q + i holds its heads side by side, the layout the output
// projection reads) instead of [n, h, Q, d].
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
  for (int64_t i = 0; i < n * Q; ++i) TORCH_CHECK(len[i] >= 0 && len[i] <= KV, "length ", len[i], " out of range");
  auto out = rows_major ? torch::empty({n * Q, h * d}, torch::kFloat32) : torch::empty({n, h, Q, d}, torch::kFloat32);
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t group = h / kvh;
  const std::pair<GroupFn, int64_t> chosen = group_fn(d, group);
  const GroupFn fn = chosen.first;
  const int64_t G = chosen.second;
  const int64_t calls = h / G;  // (row, G heads of one key head) per call
  at::parallel_for(0, n * calls * Q, 8, [&](int64_t t0, int64_t t1) {
    std::vector<float> buf;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t r = t / (calls * Q), hh = (t / Q) % calls * G, i = t % Q, g = hh / group;
      fn(qp + r * q.stride(0) + hh * q.stride(1) + i * q.stride(2), q.stride(1), kp + r * k.stride(0) + g * k.stride(1),
         k.stride(2), vp + r * v.stride(0) + g * v.stride(1), v.stride(2), len[r * Q + i], d,
         static_cast<float>(scale), op + (rows_major ? ((r * Q + i) * h + hh) * d : ((r * h + hh) * Q + i) * d),
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
