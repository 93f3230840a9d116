// The DSpark drafter's sequential part for greedy rows with the vanilla Markov head, in one call instead of
// gamma rounds of ~12 small PyTorch ops (a batch-1 SmolLM2 round spent ~1 ms there, a fifth of the drafter):
//
//   prev_0 = anchor;  for k < gamma:  e_k = W1[prev_k];  l_k = base_k + W2 e_k;  prev_{k+1} = map[argmax l_k]
//
// with W2 in our Q8_0-style blocks (q8_mm, the same call the Python path makes, so every value is bitwise what
// that path computes: q8_mm is batch-invariant, the add is one float add per element, and the argmax takes the
// first maximum, NaN counting as the largest, as torch.argmax does).
//
// base [B, gamma, V] float32 contiguous; w1 [Vt, r] float32 contiguous (indexed by target ids); w2 the packed
// [V, r] weight, n = V; anchors int64 [B]; id_map int64 [V] (the target id of each column) or empty (column i
// is id i). Returns logits [B, gamma, V], tokens int64 [B, gamma] (target ids), prev int64 [B, gamma] (the
// previous token each slot's bias read).
#include <torch/extension.h>
#include <cmath>
#include <cstring>
#include <vector>

torch::Tensor q8_mm(const torch::Tensor& x, const torch::Tensor& packed, int64_t n);

std::vector<torch::Tensor> markov_greedy(const torch::Tensor& base, const torch::Tensor& w1, const torch::Tensor& w2,
                                         int64_t n, const torch::Tensor& anchors, const torch::Tensor& id_map) {
  TORCH_CHECK(base.dim() == 3 && base.scalar_type() == torch::kFloat32 && base.is_contiguous(),
              "base must be a contiguous float32 [B, gamma, V] tensor");
  TORCH_CHECK(w1.dim() == 2 && w1.scalar_type() == torch::kFloat32 && w1.is_contiguous(),
              "w1 must be a contiguous float32 [Vt, r] tensor");
  const int64_t B = base.size(0), gamma = base.size(1), V = base.size(2), Vt = w1.size(0), r = w1.size(1);
  TORCH_CHECK(n == V, "w2 has ", n, " outputs, the logits ", V);
  TORCH_CHECK(anchors.dim() == 1 && anchors.size(0) == B && anchors.scalar_type() == torch::kInt64,
              "anchors must be int64 [", B, "]");
  const bool mapped = id_map.numel() > 0;
  TORCH_CHECK(!mapped || (id_map.dim() == 1 && id_map.size(0) == V && id_map.scalar_type() == torch::kInt64 &&
                          id_map.is_contiguous()),
              "id_map must be int64 [", V, "] or empty");
  auto logits = torch::empty({B, gamma, V}, torch::kFloat32);
  auto tokens = torch::empty({B, gamma}, torch::kInt64);
  auto prevs = torch::empty({B, gamma}, torch::kInt64);
  auto emb = torch::empty({B, r}, torch::kFloat32);
  const float *bp = base.data_ptr<float>(), *w1p = w1.data_ptr<float>();
  const int64_t* ap = anchors.data_ptr<int64_t>();
  const int64_t* mp = mapped ? id_map.data_ptr<int64_t>() : nullptr;
  float *lp = logits.data_ptr<float>(), *ep = emb.data_ptr<float>();
  int64_t *tp = tokens.data_ptr<int64_t>(), *pp = prevs.data_ptr<int64_t>();
  std::vector<int64_t> prev(ap, ap + B);
  for (int64_t k = 0; k < gamma; ++k) {
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(prev[b] >= 0 && prev[b] < Vt, "token id ", prev[b], " outside the Markov table [0, ", Vt, ")");
      std::memcpy(ep + b * r, w1p + prev[b] * r, sizeof(float) * r);
      pp[b * gamma + k] = prev[b];
    }
    const torch::Tensor bias = q8_mm(emb, w2, n);  // [B, V]
    const float* biasp = bias.data_ptr<float>();
    for (int64_t b = 0; b < B; ++b) {
      const float* src = bp + (b * gamma + k) * V;
      const float* add = biasp + b * V;
      float* dst = lp + (b * gamma + k) * V;
      int64_t best = 0;
      float top = -INFINITY;
      bool nan = false;
      for (int64_t v = 0; v < V; ++v) {
        const float x = src[v] + add[v];
        dst[v] = x;
        if (nan) continue;
        if (std::isnan(x)) {
          best = v;
          nan = true;
        } else if (v == 0 || x > top) {
          top = x;
          best = v;
        }
      }
      const int64_t tok = mapped ? mp[best] : best;
      tp[b * gamma + k] = tok;
      prev[b] = tok;
    }
  }
  return {logits, tokens, prevs};
}

TORCH_LIBRARY_FRAGMENT(dspark_cpu, m) {
  m.def("markov_greedy(Tensor base, Tensor w1, Tensor w2, int n, Tensor anchors, Tensor id_map) -> Tensor[]",
        markov_greedy);
}
