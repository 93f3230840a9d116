// The lean decoder's elementwise steps between matmuls, one call each instead of 4-12 small PyTorch ops (a
// SmolLM2 decode step made ~1,000 of them). Used on the batch-invariant path with our other kernels: every row
// is computed by the same operations whatever the batch, and the RoPE product is bitwise the PyTorch formula it
// replaces (x cos + roll(x) signed_sin, no fused multiply-add).
#include <torch/extension.h>
#include <cmath>
#include <cstring>
#include <vector>

#include "vec_math.h"

namespace {

using namespace dspark_kernels;

void check_rows(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), name,
              " must be a contiguous float32 [rows, features] tensor");
  TORCH_CHECK(x.size(1) % 16 == 0, name, ": features must be a multiple of 16, got ", x.size(1));
}

}  // namespace

// HF's RMSNorm in float32: x * rsqrt(mean(x^2) + eps) * w, one row at a time.
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  check_rows(x, "x");
  const int64_t rows = x.size(0), h = x.size(1);
  TORCH_CHECK(w.numel() == h && w.scalar_type() == torch::kFloat32 && w.is_contiguous(), "w must be float32 [", h, "]");
  auto out = torch::empty_like(x);
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = xp + r * h;
    f32x16 acc = zero();
    for (int64_t e = 0; e < h; e += 16) {
      const f32x16 v = load(xr + e);
      acc = fmadd(v, v, acc);
    }
    const float scale = 1.0f / std::sqrt(reduce_add(acc) / static_cast<float>(h) + static_cast<float>(eps));
    const f32x16 s = set1(scale);
    for (int64_t e = 0; e < h; e += 16) store(op + r * h + e, mul(mul(load(xr + e), s), load(wp + e)));
  }
  return out;
}

// SwiGLU's gate: silu(g) * u for gu = [g | u] [rows, 2 I] -> [rows, I].
torch::Tensor silu_mul(const torch::Tensor& gu) {
  check_rows(gu, "gate_up");
  const int64_t rows = gu.size(0), inter = gu.size(1) / 2;
  TORCH_CHECK(inter % 16 == 0, "the intermediate size must be a multiple of 16, got ", inter);
  auto out = torch::empty({rows, inter}, torch::kFloat32);
  const float* gp = gu.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const f32x16 one = set1(1.0f);
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gp + r * 2 * inter;
    for (int64_t e = 0; e < inter; e += 16) {
      const f32x16 gv = load(g + e), uv = load(g + inter + e);
      const f32x16 sig = div(one, add(one, dspark_kernels::exp(sub(zero(), gv))));
      store(op + r * inter + e, mul(mul(gv, sig), uv));
    }
  }
  return out;
}

// The fused q/k/v projection's output [n * q, (h + 2 kvh) d] -> RoPE'd queries [n, h, q, d], RoPE'd keys
// [n, kvh, q, d] and values [n, kvh, q, d], contiguous. cos / signed_sin [n, q, d] (signed_sin: the first half
// negated), RoPE as x cos + roll(x, d / 2) signed_sin.
std::vector<torch::Tensor> rope_split(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& ssin,
                                      int64_t n, int64_t h, int64_t kvh) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == torch::kFloat32 && qkv.is_contiguous(), "qkv must be contiguous float32");
  const int64_t q = n > 0 ? qkv.size(0) / n : 0, heads = h + 2 * kvh, d = heads > 0 ? qkv.size(1) / heads : 0;
  TORCH_CHECK(n > 0 && q * n == qkv.size(0) && d * heads == qkv.size(1) && d % 2 == 0, "qkv [", qkv.size(0), ", ",
              qkv.size(1), "] does not split into ", n, " sequences of ", h, " + 2 x ", kvh, " heads of even size");
  TORCH_CHECK(cos.is_contiguous() && ssin.is_contiguous() && cos.numel() == n * q * d && ssin.numel() == n * q * d &&
              cos.scalar_type() == torch::kFloat32 && ssin.scalar_type() == torch::kFloat32, "cos / sin must be float32 [n, q, d]");
  auto qs = torch::empty({n, h, q, d}, torch::kFloat32);
  auto ks = torch::empty({n, kvh, q, d}, torch::kFloat32);
  auto vs = torch::empty({n, kvh, q, d}, torch::kFloat32);
  const float *src = qkv.data_ptr<float>(), *cp = cos.data_ptr<float>(), *sp = ssin.data_ptr<float>();
  float *qp = qs.data_ptr<float>(), *kp = ks.data_ptr<float>(), *vp = vs.data_ptr<float>();
  const int64_t half = d / 2;
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t i = 0; i < q; ++i) {
      const float* row = src + (r * q + i) * heads * d;
      const float* c = cp + (r * q + i) * d;
      const float* s = sp + (r * q + i) * d;
      for (int64_t hh = 0; hh < h + kvh; ++hh) {
        const float* x = row + hh * d;
        float* out = hh < h ? qp + ((r * h + hh) * q + i) * d : kp + ((r * kvh + hh - h) * q + i) * d;
        if (half % 16 == 0) {
          for (int64_t e = 0; e < d; e += 16) {
            const int64_t rolled = e < half ? e + half : e - half;  // roll by d / 2: out[e] uses x[e - d/2 mod d]
            const f32x16 a = mul(load(x + e), load(c + e));
            const f32x16 b = mul(load(x + rolled), load(s + e));
            store(out + e, add(a, b));
          }
        } else {  // the same products and sum, one lane at a time (small heads)
          for (int64_t e = 0; e < d; ++e) {
            const float a = x[e] * c[e], b = x[e < half ? e + half : e - half] * s[e];
            out[e] = a + b;
          }
        }
      }
      for (int64_t hh = 0; hh < kvh; ++hh)
        std::memcpy(vp + ((r * kvh + hh) * q + i) * d, row + (h + kvh + hh) * d, d * sizeof(float));
    }
  }
  return {qs, ks, vs};
}

// One sequence's new keys and values written into its slot of a layer's cache store, and the views attention
// reads: store [slots, kvh, capacity, d] (contiguous), k_new / v_new [1, kvh, count, d] (last dimension
// contiguous) -> store[slot : slot + 1, :, :kv_len] for keys and values. The batch-1 step's cache update in one
// call (as PyTorch indexing it cost ~60 us a layer, a tenth of a SmolLM2 step).
std::vector<torch::Tensor> kv_append(torch::Tensor k_store, torch::Tensor v_store, const torch::Tensor& k_new,
                                     const torch::Tensor& v_new, int64_t slot, int64_t offset, int64_t kv_len) {
  for (const torch::Tensor* t : {&k_store, &v_store})
    TORCH_CHECK(t->dim() == 4 && t->scalar_type() == torch::kFloat32 && t->is_contiguous(),
                "the cache stores must be contiguous float32 [slots, heads, capacity, d]");
  TORCH_CHECK(v_store.sizes() == k_store.sizes(), "the key and value stores differ in shape");
  const int64_t slots = k_store.size(0), kvh = k_store.size(1), cap = k_store.size(2), d = k_store.size(3);
  for (const torch::Tensor* t : {&k_new, &v_new})
    TORCH_CHECK(t->dim() == 4 && t->scalar_type() == torch::kFloat32 && t->size(0) == 1 && t->size(1) == kvh &&
                t->size(3) == d && t->stride(3) == 1, "new keys / values must be float32 [1, ", kvh, ", count, ", d, "]");
  const int64_t count = k_new.size(2);
  TORCH_CHECK(v_new.size(2) == count, "new keys and values differ in count");
  TORCH_CHECK(slot >= 0 && slot < slots, "slot ", slot, " out of range [0, ", slots, ")");
  TORCH_CHECK(offset >= 0 && offset + count <= cap && kv_len >= offset + count && kv_len <= cap, "offset ", offset,
              " + ", count, " new, view ", kv_len, ": out of the capacity ", cap);
  float* stores[2] = {k_store.data_ptr<float>(), v_store.data_ptr<float>()};
  const torch::Tensor* news[2] = {&k_new, &v_new};
  for (int w = 0; w < 2; ++w) {
    const float* src = news[w]->data_ptr<float>();
    const int64_t hs = news[w]->stride(1), rs = news[w]->stride(2);
    for (int64_t hh = 0; hh < kvh; ++hh)
      for (int64_t i = 0; i < count; ++i)
        std::memcpy(stores[w] + ((slot * kvh + hh) * cap + offset + i) * d, src + hh * hs + i * rs, d * sizeof(float));
  }
  const std::vector<int64_t> view = {1, kvh, kv_len, d};
  const int64_t at = slot * kvh * cap * d;  // + the stores' own offsets (0 for a fresh store)
  return {k_store.as_strided(view, k_store.strides(), k_store.storage_offset() + at),
          v_store.as_strided(view, v_store.strides(), v_store.storage_offset() + at)};
}

TORCH_LIBRARY_FRAGMENT(dspark_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor", rms_norm);
  m.def("silu_mul(Tensor gate_up) -> Tensor", silu_mul);
  m.def("rope_split(Tensor qkv, Tensor cos, Tensor signed_sin, int n, int h, int kvh) -> Tensor[]", rope_split);
  m.def("kv_append(Tensor(a!) k_store, Tensor(b!) v_store, Tensor k_new, Tensor v_new, int slot, int offset, "
        "int kv_len) -> Tensor[]", kv_append);
}
