// Vector math shared by our CPU kernels: 16 float32 lanes as one AVX512 register, or as two AVX2 registers on
// CPUs without AVX512 (built with -mavx2 -mfma -mf16c; dspark_core/kernels/__init__.py picks the ISA). Every
// lane gets the same operation sequence in both builds (the same multiplies, fused multiply-adds and
// roundings), so elementwise results agree bit for bit between them; only horizontal sums may round in
// another order. Within one build every kernel stays batch-invariant, which is what losslessness rests on.
#pragma once
#include <immintrin.h>
#include <cmath>
#include <cstdint>

namespace dspark_kernels {

#if defined(__AVX512F__)
using f32x16 = __m512;
inline f32x16 load(const float* p) { return _mm512_loadu_ps(p); }
inline void store(float* p, f32x16 v) { _mm512_storeu_ps(p, v); }
inline f32x16 zero() { return _mm512_setzero_ps(); }
inline f32x16 set1(float x) { return _mm512_set1_ps(x); }
inline f32x16 add(f32x16 a, f32x16 b) { return _mm512_add_ps(a, b); }
inline f32x16 sub(f32x16 a, f32x16 b) { return _mm512_sub_ps(a, b); }
inline f32x16 mul(f32x16 a, f32x16 b) { return _mm512_mul_ps(a, b); }
inline f32x16 div(f32x16 a, f32x16 b) { return _mm512_div_ps(a, b); }
inline f32x16 fmadd(f32x16 a, f32x16 b, f32x16 c) { return _mm512_fmadd_ps(a, b, c); }  // a b + c, one rounding
inline float reduce_add(f32x16 v) { return _mm512_reduce_add_ps(v); }
// Sixteen reduce_adds at once: lane L of the result is reduce_add(a[s]) bit for bit (the same pairwise tree:
// lanes i + i+8, then + 4, + 2, + 1), for the input slot s = kReduce16Slot[L]; ~3 operations a sum instead of ~8.
constexpr int kReduce16Slot[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};
inline f32x16 reduce_add16(const f32x16* a) {
  __m512 t1[8], t2[4], t3[2];
  for (int i = 0; i < 8; ++i)  // halves: (a[2i] lanes i + i+8 | a[2i+1] lanes i + i+8)
    t1[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                          _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // quarters: four inputs' 4 partial sums, one 128-bit lane each
    t2[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t1[2 * i], t1[2 * i + 1], 0x88),
                          _mm512_shuffle_f32x4(t1[2 * i], t1[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // pairs within each 128-bit lane
    t3[i] = _mm512_add_ps(_mm512_shuffle_ps(t2[2 * i], t2[2 * i + 1], 0x44),
                          _mm512_shuffle_ps(t2[2 * i], t2[2 * i + 1], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_ps(t3[0], t3[1], 0x88), _mm512_shuffle_ps(t3[0], t3[1], 0xDD));
}
inline f32x16 load_half(const void* p) {  // 16 fp16 values
  return _mm512_cvtph_ps(_mm256_loadu_si256(static_cast<const __m256i*>(p)));
}

// exp on the whole float range: 2^n p(r), r = x - n ln2 in [-ln2/2, ln2/2], degree-6 polynomial (rel. error <
// 2e-7 there); x < -87.3 gives 0, x > 88.7 gives inf.
inline f32x16 exp(f32x16 x) {
  const __mmask16 under = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3f), _CMP_LT_OQ);
  const __mmask16 over = _mm512_cmp_ps_mask(x, _mm512_set1_ps(88.7f), _CMP_GT_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.7f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  __m512 y = _mm512_scalef_ps(p, n);
  y = _mm512_mask_mov_ps(y, over, _mm512_set1_ps(INFINITY));
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~under), y);
}

#else  // AVX2 + FMA + F16C: lanes 0-7 in lo, 8-15 in hi

struct f32x16 {
  __m256 lo, hi;
};
inline f32x16 load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void store(float* p, f32x16 v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}
inline f32x16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline f32x16 set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline f32x16 add(f32x16 a, f32x16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline f32x16 sub(f32x16 a, f32x16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline f32x16 mul(f32x16 a, f32x16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline f32x16 div(f32x16 a, f32x16 b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline f32x16 fmadd(f32x16 a, f32x16 b, f32x16 c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline float reduce_add(f32x16 v) { return hsum8(_mm256_add_ps(v.lo, v.hi)); }
// reduce_add16 as in the AVX512 build: lane L is reduce_add(a[kReduce16Slot[L]]) bit for bit (hsum8's tree).
constexpr int kReduce16Slot[16] = {0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15};
inline f32x16 reduce_add16(const f32x16* a) {
  __m256 t1[16], t2[8], t3[4], out[2];
  for (int i = 0; i < 16; ++i) t1[i] = _mm256_add_ps(a[i].lo, a[i].hi);
  for (int i = 0; i < 8; ++i)
    t2[i] = _mm256_add_ps(_mm256_permute2f128_ps(t1[2 * i], t1[2 * i + 1], 0x20),
                          _mm256_permute2f128_ps(t1[2 * i], t1[2 * i + 1], 0x31));
  for (int i = 0; i < 4; ++i)
    t3[i] = _mm256_add_ps(_mm256_shuffle_ps(t2[2 * i], t2[2 * i + 1], 0x44),
                          _mm256_shuffle_ps(t2[2 * i], t2[2 * i + 1], 0xEE));
  for (int i = 0; i < 2; ++i)
    out[i] = _mm256_add_ps(_mm256_shuffle_ps(t3[2 * i], t3[2 * i + 1], 0x88),
                           _mm256_shuffle_ps(t3[2 * i], t3[2 * i + 1], 0xDD));
  return {out[0], out[1]};
}
inline f32x16 load_half(const void* p) {
  const __m128i* h = static_cast<const __m128i*>(p);
  return {_mm256_cvtph_ps(_mm_loadu_si128(h)), _mm256_cvtph_ps(_mm_loadu_si128(h + 1))};
}

// The AVX512 exp lane for lane: the same clamp, rounding, reduction and polynomial; 2^n as two exact power-of-two
// factors (n in [-126, 128], where one factor alone would overflow), which rounds once like scalef.
inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.3f), hi = _mm256_set1_ps(88.7f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ), over = _mm256_cmp_ps(x, hi, _CMP_GT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720.0f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_cvtps_epi32(n);
  const __m256i e1 = _mm256_srai_epi32(e, 1), e2 = _mm256_sub_epi32(e, e1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 f1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e1, bias), 23));
  const __m256 f2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e2, bias), 23));
  __m256 y = _mm256_mul_ps(_mm256_mul_ps(p, f1), f2);
  y = _mm256_blendv_ps(y, _mm256_set1_ps(INFINITY), over);
  return _mm256_andnot_ps(under, y);
}
inline f32x16 exp(f32x16 x) { return {exp8(x.lo), exp8(x.hi)}; }

#endif

}  // namespace dspark_kernels
