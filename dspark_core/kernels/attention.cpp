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
#include <immintrin.h>
#include <cmath>
#include <vector>

#include "vec_math.h"

namespace {

inline float dot(const float* a, const float* b, int64_t d) {
  __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(a), _mm512_loadu_ps(b));
  for (int64_t e = 16; e < d; e += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + e), _mm512_loadu_ps(b + e), acc);
  return _mm512_reduce_add_ps(acc);
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
  float m = -INFINITY;
  for (int64_t j = 0; j < len; ++j) {
    s[j] = dot(q, k + j * ks, d) * scale;
    m = s[j] > m ? s[j] : m;
  }
  for (int64_t j = len; j < padded; ++j) s[j] = -INFINITY;
  const __m512 mv = _mm512_set1_ps(m);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < padded; j += 16) {
    __m512 p = dspark_kernels::exp_ps(_mm512_sub_ps(_mm512_loadu_ps(s + j), mv));
    _mm512_storeu_ps(s + j, p);
    sum = _mm512_add_ps(sum, p);
  }
  const float inv = 1.0f / _mm512_reduce_add_ps(sum);
  constexpr int kMaxChunks = 16;  // d <= 256
  __m512 acc[kMaxChunks];
  const int64_t chunks = d / 16;
  for (int64_t c = 0; c < chunks; ++c) acc[c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < len; ++j) {
    const __m512 p = _mm512_set1_ps(s[j]);
    const float* vj = v + j * vs;
    for (int64_t c = 0; c < chunks; ++c) acc[c] = _mm512_fmadd_ps(p, _mm512_loadu_ps(vj + 16 * c), acc[c]);
  }
  const __m512 iv = _mm512_set1_ps(inv);
  for (int64_t c = 0; c < chunks; ++c) _mm512_storeu_ps(out + 16 * c, _mm512_mul_ps(acc[c], iv));
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
