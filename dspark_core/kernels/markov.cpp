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
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

torch::Tensor q8_mm(const torch::Tensor& x, const torch::Tensor& packed, int64_t n);

namespace {

// slot k's Markov bias W2 W1[prev_b] for every row (and prev_b recorded as the slot's previous token)
torch::Tensor slot_bias(const std::vector<int64_t>& prev, const float* w1p, int64_t Vt, int64_t r, torch::Tensor& emb,
                        const torch::Tensor& w2, int64_t n, int64_t* pp, int64_t gamma, int64_t k) {
  float* ep = emb.data_ptr<float>();
  for (size_t b = 0; b < prev.size(); ++b) {
    TORCH_CHECK(prev[b] >= 0 && prev[b] < Vt, "token id ", prev[b], " outside the Markov table [0, ", Vt, ")");
    std::memcpy(ep + b * r, w1p + prev[b] * r, sizeof(float) * r);
    pp[b * gamma + k] = prev[b];
  }
  return q8_mm(emb, w2, n);
}

// the arguments both loops share, checked once: the sizes, and whether id_map maps columns to target ids
struct Shape {
  int64_t B, gamma, V, Vt, r;
  bool mapped;
};

Shape check_common(const torch::Tensor& base, const torch::Tensor& w1, int64_t n, const torch::Tensor& anchors,
                   const torch::Tensor& id_map) {
  TORCH_CHECK(base.dim() == 3 && base.scalar_type() == torch::kFloat32 && base.is_contiguous(),
              "base must be a contiguous float32 [B, gamma, V] tensor");
  TORCH_CHECK(w1.dim() == 2 && w1.scalar_type() == torch::kFloat32 && w1.is_contiguous(),
              "w1 must be a contiguous float32 [Vt, r] tensor");
  Shape s{base.size(0), base.size(1), base.size(2), w1.size(0), w1.size(1), id_map.numel() > 0};
  TORCH_CHECK(n == s.V, "w2 has ", n, " outputs, the logits ", s.V);
  TORCH_CHECK(anchors.dim() == 1 && anchors.size(0) == s.B && anchors.scalar_type() == torch::kInt64,
              "anchors must be int64 [", s.B, "]");
  TORCH_CHECK(!s.mapped || (id_map.dim() == 1 && id_map.size(0) == s.V && id_map.scalar_type() == torch::kInt64 &&
                            id_map.is_contiguous()),
              "id_map must be int64 [", s.V, "] or empty");
  return s;
}

}  // namespace

std::vector<torch::Tensor> markov_greedy(const torch::Tensor& base, const torch::Tensor& w1, const torch::Tensor& w2,
                                         int64_t n, const torch::Tensor& anchors, const torch::Tensor& id_map) {
  const auto [B, gamma, V, Vt, r, mapped] = check_common(base, w1, n, anchors, id_map);
  auto logits = torch::empty({B, gamma, V}, torch::kFloat32);
  auto tokens = torch::empty({B, gamma}, torch::kInt64);
  auto prevs = torch::empty({B, gamma}, torch::kInt64);
  auto emb = torch::empty({B, r}, torch::kFloat32);
  const float *bp = base.data_ptr<float>(), *w1p = w1.data_ptr<float>();
  const int64_t* ap = anchors.data_ptr<int64_t>();
  const int64_t* mp = mapped ? id_map.data_ptr<int64_t>() : nullptr;
  float* lp = logits.data_ptr<float>();
  int64_t *tp = tokens.data_ptr<int64_t>(), *pp = prevs.data_ptr<int64_t>();
  std::vector<int64_t> prev(ap, ap + B);
  for (int64_t k = 0; k < gamma; ++k) {
    const torch::Tensor bias = slot_bias(prev, w1p, Vt, r, emb, w2, n, pp, gamma, k);  // [B, V]
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

namespace {

// a sort key per logit column: smaller = chosen first (larger value, NaN largest; ties to the lower column)
inline uint64_t column_key(float x, uint32_t column) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  const uint32_t ascending = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);  // float order as unsigned
  return (static_cast<uint64_t>(~ascending) << 32) | column;
}

// The K-th smallest of `keys` (1 <= K <= keys.size()) by one radix pass: a histogram of the keys' top 12 bits
// (sign, exponent and 3 mantissa bits of the logit) finds the bucket that holds it, and only that bucket's keys
// are partially sorted. The same key std::nth_element over all of them finds (keys are unique), at a fraction of
// the cost: a SmolLM2 DSpark round at T = 1 spent ~0.3 ms in nth_element over 8,192 logits x 7 slots.
constexpr int kBucketBits = 12;
constexpr int64_t kBuckets = int64_t{1} << kBucketBits;

uint64_t kth_smallest(const std::vector<uint64_t>& keys, int64_t K, std::vector<int32_t>& hist,
                      std::vector<uint64_t>& scratch) {
  std::fill(hist.begin(), hist.end(), 0);
  for (const uint64_t key : keys) ++hist[key >> (64 - kBucketBits)];
  int64_t bucket = 0, before = 0;
  while (before + hist[bucket] < K) before += hist[bucket++];
  int64_t m = 0;
  for (const uint64_t key : keys)
    if (static_cast<int64_t>(key >> (64 - kBucketBits)) == bucket) scratch[m++] = key;
  const int64_t need = K - before;  // 1 <= need <= m
  std::nth_element(scratch.begin(), scratch.begin() + (need - 1), scratch.begin() + m);
  return scratch[need - 1];
}

}  // namespace

// The same loop for a batch with sampled rows (temperatures[b] > 0; 0 = greedy). Each sampled slot is drawn
// from the softmax, at the row's temperature, of its `support` largest logits (the whole vocabulary when
// support == V), by inverse CDF with uniforms[b, k] over the support in column order, as the Python path's
// TokenChooser does for the whole vocabulary (no coupling, no processing here). The support (target ids) and
// its probabilities come back for verification, which reads them in any order; the token drawn always has
// q > 0 (the point stays below the total, so it lands where the running sum steps up). Greedy rows take the
// argmax; their support (temperature 1) is unused. Not bitwise the Python path (another softmax, and a top-k
// support in column rather than value order), but every draft is drawn from exactly the q it reports, which
// is all losslessness asks.
std::vector<torch::Tensor> markov_sample(const torch::Tensor& base, const torch::Tensor& w1, const torch::Tensor& w2,
                                         int64_t n, const torch::Tensor& anchors, const torch::Tensor& id_map,
                                         const torch::Tensor& temperatures, const torch::Tensor& uniforms,
                                         int64_t support) {
  const auto [B, gamma, V, Vt, r, mapped] = check_common(base, w1, n, anchors, id_map);
  TORCH_CHECK(V < (int64_t{1} << 31), "too many logit columns: ", V);
  TORCH_CHECK(temperatures.dim() == 1 && temperatures.size(0) == B && temperatures.scalar_type() == torch::kFloat32 &&
                  temperatures.is_contiguous(), "temperatures must be float32 [", B, "]");
  TORCH_CHECK(uniforms.dim() == 2 && uniforms.size(0) == B && uniforms.size(1) == gamma &&
                  uniforms.scalar_type() == torch::kFloat32 && uniforms.is_contiguous(),
              "uniforms must be float32 [", B, ", ", gamma, "]");
  TORCH_CHECK(support >= 1 && support <= V, "support must be in [1, ", V, "], got ", support);
  const int64_t K = support;
  auto logits = torch::empty({B, gamma, V}, torch::kFloat32);
  auto tokens = torch::empty({B, gamma}, torch::kInt64);
  auto prevs = torch::empty({B, gamma}, torch::kInt64);
  auto sup_ids = torch::empty({B, gamma, K}, torch::kInt64);
  auto sup_probs = torch::empty({B, gamma, K}, torch::kFloat32);
  auto emb = torch::empty({B, r}, torch::kFloat32);
  const float *bp = base.data_ptr<float>(), *w1p = w1.data_ptr<float>(), *tmp = temperatures.data_ptr<float>(),
              *up = uniforms.data_ptr<float>();
  const int64_t* ap = anchors.data_ptr<int64_t>();
  const int64_t* mp = mapped ? id_map.data_ptr<int64_t>() : nullptr;
  float *lp = logits.data_ptr<float>(), *qp = sup_probs.data_ptr<float>();
  int64_t *tp = tokens.data_ptr<int64_t>(), *pp = prevs.data_ptr<int64_t>(), *sp = sup_ids.data_ptr<int64_t>();
  std::vector<int64_t> prev(ap, ap + B);
  std::vector<uint64_t> keys(V), scratch(V);
  std::vector<int32_t> hist(kBuckets);
  std::vector<int32_t> cols(K);
  std::vector<float> cdf(K);
  for (int64_t k = 0; k < gamma; ++k) {
    const torch::Tensor bias = slot_bias(prev, w1p, Vt, r, emb, w2, n, pp, gamma, k);  // [B, V]
    const float* biasp = bias.data_ptr<float>();
    for (int64_t b = 0; b < B; ++b) {
      const int64_t row = b * gamma + k;
      const float* src = bp + row * V;
      const float* add = biasp + b * V;
      float* l = lp + row * V;
      uint64_t first = ~uint64_t{0};
      for (int64_t v = 0; v < V; ++v) {
        l[v] = src[v] + add[v];
        keys[v] = column_key(l[v], static_cast<uint32_t>(v));
        first = std::min(first, keys[v]);
      }
      const int64_t argmax = static_cast<int64_t>(first & 0xffffffffu);
      // the support in column order: every column, or those whose key is within the K smallest (keys are
      // unique, so exactly K)
      int64_t m = 0;
      if (K == V) {
        for (int64_t v = 0; v < V; ++v) cols[m++] = static_cast<int32_t>(v);
      } else {
        const uint64_t cut = kth_smallest(keys, K, hist, scratch);
        for (int64_t v = 0; v < V; ++v)
          if (keys[v] <= cut) cols[m++] = static_cast<int32_t>(v);
      }
      const float t = tmp[b] > 0.0f ? tmp[b] : 1.0f;
      float* q = qp + row * K;
      int64_t* ids = sp + row * K;
      const float top = l[argmax] / t;
      float total = 0.0f;
      for (int64_t i = 0; i < K; ++i) {
        const float e = std::exp(l[cols[i]] / t - top);
        q[i] = e;
        total += e;
      }
      const float inv = 1.0f / total;
      float running = 0.0f;
      for (int64_t i = 0; i < K; ++i) {
        q[i] *= inv;
        running += q[i];
        cdf[i] = running;
        ids[i] = mapped ? mp[cols[i]] : cols[i];
      }
      int64_t col = argmax;  // greedy: torch.argmax's choice (the first maximum, NaN largest)
      if (tmp[b] > 0.0f) {
        const float mass = cdf[K - 1];
        const float point = std::min(up[row] * mass, std::nextafter(mass, 0.0f));
        const int64_t idx = std::upper_bound(cdf.begin(), cdf.end(), point) - cdf.begin();
        col = cols[std::min(idx, K - 1)];
      }
      const int64_t tok = mapped ? mp[col] : col;
      tp[row] = tok;
      prev[b] = tok;
    }
  }
  return {logits, tokens, prevs, sup_ids, sup_probs};
}

TORCH_LIBRARY_FRAGMENT(dspark_cpu, m) {
  m.def("markov_sample(Tensor base, Tensor w1, Tensor w2, int n, Tensor anchors, Tensor id_map, Tensor temperatures, "
        "Tensor uniforms, int support) -> Tensor[]", markov_sample);
  m.def("markov_greedy(Tensor base, Tensor w1, Tensor w2, int n, Tensor anchors, Tensor id_map) -> Tensor[]",
        markov_greedy);
}
