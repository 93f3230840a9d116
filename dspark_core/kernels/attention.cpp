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
#include <vector>

#include "vec_math.h"

namespace {

using namespace dspark_kernels;

inline float dot(const float* a, const float* b, int64_t d) {
  f32x16 acc = mul(load(a), load(b));
  for (int64_t e = 16; e < d; e += 16) acc = fmadd(load(a + e), load(b + e), acc);
  return reduce_add(acc);
}

void one_row(const float* q, const float* k, int64_t ks, const float* v, int64_t vs, int64_t len, int64_t d,
             float scale, float* out, std::vector<float>& buf) {
  if (len <= 0) {
    for (int64_t e = 0; e < d; ++e) out[e] = 0.0f;
    return;
  }
  const int64_t padded = (len + 15) / 16 * 16;
  if (static_cast<int64_t>(buf.size()) < padded) buf.resize(padded);
  float* s = buf.data();
  // four keys at a time (independent chains for the out-of-order core), each key's dot exactly `dot`'s sequence
  int64_t j = 0;
  for (; j + 4 <= len; j += 4) {
    const float *k0 = k + j * ks, *k1 = k0 + ks, *k2 = k1 + ks, *k3 = k2 + ks;
    f32x16 q0 = load(q);
    f32x16 a0 = mul(q0, load(k0)), a1 = mul(q0, load(k1)), a2 = mul(q0, load(k2)), a3 = mul(q0, load(k3));
    for (int64_t e = 16; e < d; e += 16) {
      const f32x16 qe = load(q + e);
      a0 = fmadd(qe, load(k0 + e), a0);
      a1 = fmadd(qe, load(k1 + e), a1);
      a2 = fmadd(qe, load(k2 + e), a2);
      a3 = fmadd(qe, load(k3 + e), a3);
    }
    s[j] = reduce_add(a0) * scale;
    s[j + 1] = reduce_add(a1) * scale;
    s[j + 2] = reduce_add(a2) * scale;
    s[j + 3] = reduce_add(a3) * scale;
  }
  for (; j < len; ++j) s[j] = dot(q, k + j * ks, d) * scale;
  float m = -INFINITY;
  for (j = 0; j < len; ++j) m = s[j] > m ? s[j] : m;
  for (int64_t j = len; j < padded; ++j) s[j] = -INFINITY;
  const f32x16 mv = set1(m);
  f32x16 sum = zero();
  for (int64_t j = 0; j < padded; j += 16) {
    const f32x16 p = dspark_kernels::exp(sub(load(s + j), mv));
    store(s + j, p);
    sum = add(sum, p);
  }
  const float inv = 1.0f / reduce_add(sum);
  constexpr int kMaxChunks = 16;  // d <= 256
  f32x16 acc[kMaxChunks];
  const int64_t chunks = d / 16;
  for (int64_t c = 0; c < chunks; ++c) acc[c] = zero();
  for (int64_t j = 0; j < len; ++j) {
    const f32x16 p = set1(s[j]);
    const float* vj = v + j * vs;
    for (int64_t c = 0; c < chunks; ++c) acc[c] = fmadd(p, load(vj + 16 * c), acc[c]);
  }
  const f32x16 iv = set1(inv);
  for (int64_t c = 0; c < chunks; ++c) store(out + 16 * c, mul(acc[c], iv));
}

}  // namespace

torch::Tensor row_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                            const torch::Tensor& lengths, double scale) {
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
  auto out = torch::empty({n, h, Q, d}, torch::kFloat32);
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t group = h / kvh;
  at::parallel_for(0, n * h * Q, 8, [&](int64_t t0, int64_t t1) {
    std::vector<float> buf;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t r = t / (h * Q), hh = (t / Q) % h, i = t % Q, g = hh / group;
      one_row(qp + r * q.stride(0) + hh * q.stride(1) + i * q.stride(2), kp + r * k.stride(0) + g * k.stride(1),
              k.stride(2), vp + r * v.stride(0) + g * v.stride(1), v.stride(2), len[r * Q + i], d,
              static_cast<float>(scale), op + ((r * h + hh) * Q + i) * d, buf);
    }
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(dspark_cpu, m) {
  m.def("row_attention(Tensor q, Tensor k, Tensor v, Tensor lengths, float scale) -> Tensor", row_attention);
}
