// Integer dot-product matmuls for GGUF-style block-quantized weights on x86 CPUs with AVX512-VNNI, or AVX2.
//
// y[m, n] = sum_k x[m, k] w[n, k] with w stored in blocks of 32 inputs (Q4: 4-bit codes with a scale d and an
// offset o per block, w = d q + o; Q8: 8-bit signed codes with a scale d, w = d q). Activations are quantized
// the way llama.cpp does it for these formats: per row and per block of 32, symmetric int8 with scale
// s = max|x| / 127 (round to nearest even). A block's contribution is then an exact integer dot product
// (vpdpbusd) scaled in float32:
//     Q4: y += (d s) * sum q xq  +  o * (s sum xq)         Q8: y += (d s) * sum q xq
// Each row's result is computed by the same sequence of operations whatever the number of rows, the row's
// position in the batch, the row-block size or the number of threads (rows are blocked only to share the
// weight loads, columns are split between threads): a row's output is bitwise batch-invariant.
//
// Weight layout (prepared in Python, dspark_core/kernels/__init__.py): uint8 [N/16, K/32, bytes], columns in tiles
// of 16, blocks of 32 inputs, each block's codes then its per-column constants:
//   Q4 (320 bytes): 4 x 64 code bytes, byte 4c + j of vector v holding column c's codes k = 8v + j (low nibble)
//       and k = 8v + 4 + j (high nibble), so one vpdpbusd covers 16 columns x 4 inputs; fp16 d [16]; fp16 o [16].
//   Q8 (576 bytes): 8 x 64 code bytes (int8), byte 4c + j of vector v holding column c's code k = 4v + j;
//       fp16 d [16]; int16 sum of the block's codes [16].
// The AVX2 build (no AVX512) reads the same layout as two halves of 8 columns (bytes 0-31 and 32-63 of each
// vector) and forms the same integer sums with vpmaddubsw / vpmaddwd, exactly (no int16 saturation: Q4 pairs
// are <= 2 x 15 x 127 and eight of them sum below 2^15; Q8 multiplies |w| <= 128 by x sign(w), |x| <= 127), then
// the same float32 operations lane for lane, so both builds give the same outputs bit for bit.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "parallel.h"
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#include <sys/syscall.h>
#include <unistd.h>
#define DSPARK_AMX 1
#endif

namespace {

constexpr int64_t kBlock = 32;
#if defined(__AVX512F__)
constexpr int kRows = 8;  // rows sharing one load (and unpacking) of a weight block: 8 codes + 8 sums fit 32 zmm
#else
constexpr int kRows = 4;  // rows sharing one load of a weight block (16 ymm: 8 codes + 4 sums + temporaries)
#endif

#if defined(__AVX512F__)
constexpr bool kQ8Offset = true;  // Q8 activations as uint8 (xq + 128): vpdpbusd's unsigned operand
#else
constexpr bool kQ8Offset = false;  // the AVX2 Q8 product takes signed activations (sign trick)
#endif

// Quantize rows of x [M, K] per block of 32: xq int8, and per block s and s * sum(xq).
// offset: store q + 128 as uint8 bits (the unsigned operand of vpdpbusd, for signed weights)
void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* xq, float* s, float* ssum, bool offset) {
  const int64_t G = K / kBlock;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < G; ++g) {
      const float* xb = x + m * K + g * kBlock;
      int8_t* qb = xq + m * K + g * kBlock;
#if defined(__AVX512F__)
      __m512 a0 = _mm512_loadu_ps(xb), a1 = _mm512_loadu_ps(xb + 16);
      float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a0), _mm512_abs_ps(a1)));
      float scale = amax / 127.0f;
      float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(a0, _mm512_set1_ps(inv)));  // round to nearest even
      __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(a1, _mm512_set1_ps(inv)));
      __m128i b0 = _mm512_cvtsepi32_epi8(q0), b1 = _mm512_cvtsepi32_epi8(q1);
      if (offset) {
        b0 = _mm_xor_si128(b0, _mm_set1_epi8(static_cast<char>(0x80)));
        b1 = _mm_xor_si128(b1, _mm_set1_epi8(static_cast<char>(0x80)));
      }
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qb), b0);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + 16), b1);
      int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
#else
      const __m256 sign = _mm256_set1_ps(-0.0f);
      __m256 a[4];
      __m256 mx = _mm256_setzero_ps();
      for (int i = 0; i < 4; ++i) {
        a[i] = _mm256_loadu_ps(xb + 8 * i);
        mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, a[i]));
      }
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
      const float amax = _mm_cvtss_f32(m4);
      float scale = amax / 127.0f;
      float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      __m256i q[4];
      for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(a[i], _mm256_set1_ps(inv)));
      // saturating packs interleave the 128-bit lanes; one permute puts the 32 bytes back in order
      __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
      b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      if (offset) b = _mm256_xor_si256(b, _mm256_set1_epi8(static_cast<char>(0x80)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb), b);
      __m256i t = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
      __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
      t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4E));
      t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xB1));
      int32_t sum = _mm_cvtsi128_si32(t4);
#endif
      s[m * G + g] = scale;
      ssum[m * G + g] = scale * static_cast<float>(sum);
    }
  }
}

// One matrix is one sequential stream: tile by tile (16 columns), block by block, each block's codes followed by
// its 16 fp16 scales and 16 fp16 offsets (Q4) or code sums (Q8). Single-thread decoding streams every weight
// from DRAM once per step, so the layout is what the hardware prefetchers like, helped by explicit prefetches.
constexpr int64_t kQ4Bytes = 256 + 64, kQ8Bytes = 512 + 64, kAhead = 8;

inline void prefetch(const uint8_t* p, int64_t bytes) {
  for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(reinterpret_cast<const char*>(p + i), _MM_HINT_T0);
}

// Prefetch the next tile (`bytes` from `next`) into L2, spread over this tile's `count` block iterations (every
// row pass and half): the weights of a step stream from DRAM while the core computes, also during the passes
// that re-read this tile from L1 (AVX2, 2-core EPYC, scripts/kernel_ab.py: one forward's projections 0.95-0.98x).
inline void prefetch_next(const uint8_t* next, int64_t bytes, int64_t i, int64_t count) {
  const int64_t lo = (i * bytes / count) & ~int64_t(63), hi = (i + 1) * bytes / count;
  for (int64_t off = lo; off < hi; off += 64) _mm_prefetch(reinterpret_cast<const char*>(next + off), _MM_HINT_T1);
}

// The index of block g in rows m0..'s pass over half h of a tile, and how many such iterations a tile takes.
inline int64_t pass_block(int64_t m0, int h, int64_t g, int64_t G) { return (2 * (m0 / kRows) + h) * G + g; }
inline int64_t pass_blocks(int64_t M, int64_t G) { return 2 * ((M + kRows - 1) / kRows) * G; }

#if defined(__AVX512F__)

inline __m512 load_half16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

inline __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// One block's float32 step for one row, shared by the vpdpbusd and the tile paths (whose outputs are bitwise equal
// because both run exactly these operations): Q4 acc += (d s) isum + o (s sum xq); Q8 acc += (d s) isum.
inline __m512 q4_step(__m512 acc, __m512i isum, __m512 dv, __m512 ov, float s, float ssum) {
  const __m512 ds = _mm512_mul_ps(dv, _mm512_set1_ps(s));
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), ds, acc);
  return _mm512_fmadd_ps(ov, _mm512_set1_ps(ssum), acc);
}

inline __m512 q8_step(__m512 acc, __m512i isum, __m512 dv, float s) {
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(dv, _mm512_set1_ps(s)), acc);
}

// Q4: rows [m0, m0 + R) x one tile of 16 columns.
template <int R>
inline void q4_tile(const uint8_t* tile, const int8_t* xq, const float* s, const float* ssum, int64_t K, int64_t G,
                    int64_t m0, float* y, int64_t N, int64_t n0, int64_t /*M*/) {
  const __m512i mask = _mm512_set1_epi8(0x0F);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* cb = tile + g * kQ4Bytes;
    prefetch(cb + kAhead * kQ4Bytes, kQ4Bytes);
    __m512i w[8];
    for (int v = 0; v < 4; ++v) {
      __m512i packed = _mm512_loadu_si512(cb + 64 * v);
      w[2 * v] = _mm512_and_si512(packed, mask);
      w[2 * v + 1] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), mask);
    }
    const __m512 dv = load_half16(reinterpret_cast<const at::Half*>(cb + 256));
    const __m512 ov = load_half16(reinterpret_cast<const at::Half*>(cb + 288));
    for (int r = 0; r < R; ++r) {
      const int64_t m = m0 + r;
      const int8_t* xb = xq + m * K + g * kBlock;
      __m512i isum = _mm512_setzero_si512();
      // vector 2v covers inputs 8v..8v+3 of the block, vector 2v+1 inputs 8v+4..8v+7
      for (int v = 0; v < 8; ++v) isum = _mm512_dpbusd_epi32(isum, w[v], bcast4(xb + 4 * v));
      acc[r] = q4_step(acc[r], isum, dv, ov, s[m * G + g], ssum[m * G + g]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + (m0 + r) * N + n0, acc[r]);
}

// Q8: activations offset to uint8 (xq + 128); 128 * (sum of the block's codes) per column undoes the offset.
template <int R>
inline void q8_tile(const uint8_t* tile, const int8_t* xu, const float* s, int64_t K, int64_t G, int64_t m0,
                    float* y, int64_t N, int64_t n0, int64_t /*M*/) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* cb = tile + g * kQ8Bytes;
    prefetch(cb + kAhead * kQ8Bytes, kQ8Bytes);
    __m512i w[8];
    for (int v = 0; v < 8; ++v) w[v] = _mm512_loadu_si512(cb + 64 * v);
    const __m512 dv = load_half16(reinterpret_cast<const at::Half*>(cb + 512));
    const __m512i corr = _mm512_slli_epi32(
        _mm512_cvtepi16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(cb + 544))), 7);
    for (int r = 0; r < R; ++r) {
      const int64_t m = m0 + r;
      const int8_t* xb = xu + m * K + g * kBlock;
      __m512i isum = _mm512_setzero_si512();
      for (int v = 0; v < 8; ++v) isum = _mm512_dpbusd_epi32(isum, bcast4(xb + 4 * v), w[v]);
      acc[r] = q8_step(acc[r], _mm512_sub_epi32(isum, corr), dv, s[m * G + g]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + (m0 + r) * N + n0, acc[r]);
}


#if defined(DSPARK_AMX)
// AMX (Intel's tile unit): one block's integer sums for up to 16 rows x one tile of 16 columns in one instruction
// (TDPBSUD for Q4: signed activations x unsigned codes; TDPBUSD for Q8: the offset activations x signed codes), the
// same exact int32 sums as the vpdpbusd chains above, then the same float32 operations per row in the same order,
// so a row's output is bitwise what the VNNI kernels give (and batch-invariant as theirs). The B tile's layout (8
// rows of 16 columns x 4 inputs) is the packed layout itself: Q8 loads it in place, Q4 unpacks the nibbles into it.
constexpr int kAmxRows = 16;

struct TileConfig {
  uint8_t palette, start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Linux grants a process the tile state on request (once); false where the kernel or the CPU refuses.
bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
}

inline void amx_configure(int rows) {
  TileConfig c;
  std::memset(&c, 0, sizeof c);
  c.palette = 1;
  for (int i = 0; i < 2; ++i) {
    c.rows[i] = static_cast<uint8_t>(rows);  // C: rows x 16 int32
    c.colsb[i] = 64;
    c.rows[2 + i] = static_cast<uint8_t>(rows);  // A: rows x one block's 32 bytes
    c.colsb[2 + i] = kBlock;
    c.rows[4 + i] = 8;  // B: 8 x (16 columns x 4 inputs)
    c.colsb[4 + i] = 64;
  }
  _tile_loadconfig(&c);
}

// The float32 part of one block for rows [m0, m0 + R), from the tile's stored sums.
template <int R>
inline void q4_epilogue(__m512* acc, const int32_t* sums, const uint8_t* cb, const float* s, const float* ssum,
                        int64_t G, int64_t m0, int64_t g) {
  const __m512 dv = load_half16(reinterpret_cast<const at::Half*>(cb + 256));
  const __m512 ov = load_half16(reinterpret_cast<const at::Half*>(cb + 288));
  for (int r = 0; r < R; ++r) {
    const int64_t m = m0 + r;
    acc[r] = q4_step(acc[r], _mm512_load_si512(sums + 16 * r), dv, ov, s[m * G + g], ssum[m * G + g]);
  }
}

template <int R>
inline void q8_epilogue(__m512* acc, const int32_t* sums, const uint8_t* cb, const float* s, int64_t G, int64_t m0,
                        int64_t g) {
  const __m512 dv = load_half16(reinterpret_cast<const at::Half*>(cb + 512));
  const __m512i corr = _mm512_slli_epi32(
      _mm512_cvtepi16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(cb + 544))), 7);
  for (int r = 0; r < R; ++r) {
    const int64_t m = m0 + r;
    acc[r] = q8_step(acc[r], _mm512_sub_epi32(_mm512_load_si512(sums + 16 * r), corr), dv, s[m * G + g]);
  }
}

inline void unpack_q4(const uint8_t* cb, uint8_t* wb) {
  const __m512i mask = _mm512_set1_epi8(0x0F);
  for (int v = 0; v < 4; ++v) {  // vector 2v: inputs 8v..8v+3, 2v+1: 8v+4..8v+7 (B's rows in order)
    __m512i packed = _mm512_loadu_si512(cb + 64 * v);
    _mm512_store_si512(wb + 128 * v, _mm512_and_si512(packed, mask));
    _mm512_store_si512(wb + 128 * v + 64, _mm512_and_si512(_mm512_srli_epi16(packed, 4), mask));
  }
}

// rows [m0, m0 + R) of y for one tile; xq holds the configured rows from m0 (zero padding past M). Two blocks in
// flight (tiles 0/2/4 and 1/3/5), so that one block's tile latency overlaps the other's.
template <int R>
inline void q4_tile_amx(const uint8_t* tile, const int8_t* xq, const float* s, const float* ssum, int64_t K, int64_t G,
                        int64_t m0, float* y, int64_t N, int64_t n0) {
  alignas(64) uint8_t wb[2][512];
  alignas(64) int32_t sums[2][kAmxRows * 16];
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const int8_t* xa = xq + m0 * K;
  int64_t g = 0;
  for (; g + 2 <= G; g += 2) {
    const uint8_t* cb = tile + g * kQ4Bytes;
    prefetch(cb + kAhead * kQ4Bytes, 2 * kQ4Bytes);
    unpack_q4(cb, wb[0]);
    unpack_q4(cb + kQ4Bytes, wb[1]);
    _tile_zero(0);
    _tile_zero(1);
    _tile_loadd(2, xa + g * kBlock, K);
    _tile_loadd(3, xa + (g + 1) * kBlock, K);
    _tile_loadd(4, wb[0], 64);
    _tile_loadd(5, wb[1], 64);
    _tile_dpbsud(0, 2, 4);
    _tile_dpbsud(1, 3, 5);
    _tile_stored(0, sums[0], 64);
    _tile_stored(1, sums[1], 64);
    q4_epilogue<R>(acc, sums[0], cb, s, ssum, G, m0, g);
    q4_epilogue<R>(acc, sums[1], cb + kQ4Bytes, s, ssum, G, m0, g + 1);
  }
  if (g < G) {
    const uint8_t* cb = tile + g * kQ4Bytes;
    unpack_q4(cb, wb[0]);
    _tile_zero(0);
    _tile_loadd(2, xa + g * kBlock, K);
    _tile_loadd(4, wb[0], 64);
    _tile_dpbsud(0, 2, 4);
    _tile_stored(0, sums[0], 64);
    q4_epilogue<R>(acc, sums[0], cb, s, ssum, G, m0, g);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + (m0 + r) * N + n0, acc[r]);
}

template <int R>
inline void q8_tile_amx(const uint8_t* tile, const int8_t* xu, const float* s, int64_t K, int64_t G, int64_t m0,
                        float* y, int64_t N, int64_t n0) {
  alignas(64) int32_t sums[2][kAmxRows * 16];
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const int8_t* xa = xu + m0 * K;
  int64_t g = 0;
  for (; g + 2 <= G; g += 2) {
    const uint8_t* cb = tile + g * kQ8Bytes;
    prefetch(cb + kAhead * kQ8Bytes, 2 * kQ8Bytes);
    _tile_zero(0);
    _tile_zero(1);
    _tile_loadd(2, xa + g * kBlock, K);
    _tile_loadd(3, xa + (g + 1) * kBlock, K);
    _tile_loadd(4, cb, 64);
    _tile_loadd(5, cb + kQ8Bytes, 64);
    _tile_dpbusd(0, 2, 4);
    _tile_dpbusd(1, 3, 5);
    _tile_stored(0, sums[0], 64);
    _tile_stored(1, sums[1], 64);
    q8_epilogue<R>(acc, sums[0], cb, s, G, m0, g);
    q8_epilogue<R>(acc, sums[1], cb + kQ8Bytes, s, G, m0, g + 1);
  }
  if (g < G) {
    const uint8_t* cb = tile + g * kQ8Bytes;
    _tile_zero(0);
    _tile_loadd(2, xa + g * kBlock, K);
    _tile_loadd(4, cb, 64);
    _tile_dpbusd(0, 2, 4);
    _tile_stored(0, sums[0], 64);
    q8_epilogue<R>(acc, sums[0], cb, s, G, m0, g);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + (m0 + r) * N + n0, acc[r]);
}

template <typename Tile>
void run_tiles_amx(int64_t M, int64_t N, int64_t K, Tile tile) {
  const int64_t tiles = N / 16;
  const int cfg_rows = static_cast<int>(std::min<int64_t>(M, kAmxRows));
  at::parallel_for(0, tiles, dspark_kernels::grain_for(tiles, dspark_kernels::splits(M * N * K), 16), [&](int64_t t0, int64_t t1) {
    amx_configure(cfg_rows);  // per thread; the A and C tiles always hold cfg_rows rows (padding past M)
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t m = 0; m < M; m += kAmxRows) {
        switch (std::min<int64_t>(M - m, kAmxRows)) {
#define DSPARK_AMX_ROWS(r) case r: tile(t, m, std::integral_constant<int, r>{}); break;
          DSPARK_AMX_ROWS(16) DSPARK_AMX_ROWS(15) DSPARK_AMX_ROWS(14) DSPARK_AMX_ROWS(13) DSPARK_AMX_ROWS(12)
          DSPARK_AMX_ROWS(11) DSPARK_AMX_ROWS(10) DSPARK_AMX_ROWS(9) DSPARK_AMX_ROWS(8) DSPARK_AMX_ROWS(7)
          DSPARK_AMX_ROWS(6) DSPARK_AMX_ROWS(5) DSPARK_AMX_ROWS(4) DSPARK_AMX_ROWS(3) DSPARK_AMX_ROWS(2)
          DSPARK_AMX_ROWS(1)
#undef DSPARK_AMX_ROWS
          default: break;
        }
      }
    }
    _tile_release();
  });
}
#endif  // DSPARK_AMX

#else  // AVX2: each tile as two halves of 8 columns (bytes 32 h .. 32 h + 31 of each 64-byte code vector)

inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// One half (8 columns) at a time over all blocks: 8 code vectors + R accumulators stay in the 16 registers.
template <int R>
inline void q4_tile(const uint8_t* tile, const int8_t* xq, const float* s, const float* ssum, int64_t K, int64_t G,
                    int64_t m0, float* y, int64_t N, int64_t n0, int64_t M) {
  const __m256i mask = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (int h = 0; h < 2; ++h) {
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* cb = tile + g * kQ4Bytes;
      if (h == 0 && m0 == 0) prefetch(cb + kAhead * kQ4Bytes, kQ4Bytes);
      prefetch_next(tile + G * kQ4Bytes, G * kQ4Bytes, pass_block(m0, h, g, G), pass_blocks(M, G));
      __m256i w[8];
      for (int v = 0; v < 4; ++v) {
        const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cb + 64 * v + 32 * h));
        w[2 * v] = _mm256_and_si256(packed, mask);
        w[2 * v + 1] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), mask);
      }
      const __m128i* dh = reinterpret_cast<const __m128i*>(cb + 256 + 16 * h);
      const __m128i* oh = reinterpret_cast<const __m128i*>(cb + 288 + 16 * h);
      for (int r = 0; r < R; ++r) {
        const int64_t m = m0 + r;
        const int8_t* xb = xq + m * K + g * kBlock;
        // pairs of 4-bit code x int8 products, |pair| <= 3,810: eight vectors' pairs stay inside int16
        __m256i pairs = _mm256_maddubs_epi16(w[0], bcast4(xb));
        for (int v = 1; v < 8; ++v) pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(w[v], bcast4(xb + 4 * v)));
        const __m256i isum = _mm256_madd_epi16(pairs, ones);
        const __m256 ds = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(dh)), _mm256_set1_ps(s[m * G + g]));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), ds, acc[r]);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(oh)), _mm256_set1_ps(ssum[m * G + g]), acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + (m0 + r) * N + n0 + 8 * h, acc[r]);
  }
}

// Q8 with signed activations: |w| (as uint8: |-128| reads as 128) times x sign(w), exact in int16 pairs.
template <int R>
inline void q8_tile(const uint8_t* tile, const int8_t* xq, const float* s, int64_t K, int64_t G, int64_t m0,
                    float* y, int64_t N, int64_t n0, int64_t M) {
  const __m256i ones = _mm256_set1_epi16(1);
  for (int h = 0; h < 2; ++h) {
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* cb = tile + g * kQ8Bytes;
      if (h == 0 && m0 == 0) prefetch(cb + kAhead * kQ8Bytes, kQ8Bytes);
      prefetch_next(tile + G * kQ8Bytes, G * kQ8Bytes, pass_block(m0, h, g, G), pass_blocks(M, G));
      const __m256i* wv = reinterpret_cast<const __m256i*>(cb + 32 * h);  // vector v at wv + 2 v
      __m256i aw[8];
      for (int v = 0; v < 8; ++v) aw[v] = _mm256_abs_epi8(_mm256_loadu_si256(wv + 2 * v));
      const __m128i* dh = reinterpret_cast<const __m128i*>(cb + 512 + 16 * h);
      for (int r = 0; r < R; ++r) {
        const int64_t m = m0 + r;
        const int8_t* xb = xq + m * K + g * kBlock;
        __m256i isum = _mm256_setzero_si256();
        for (int v = 0; v < 8; ++v) {
          // w reloaded from L1 rather than kept: 8 |w| vectors + R accumulators already fill the registers
          const __m256i sx = _mm256_sign_epi8(bcast4(xb + 4 * v), _mm256_loadu_si256(wv + 2 * v));
          isum = _mm256_add_epi32(isum, _mm256_madd_epi16(_mm256_maddubs_epi16(aw[v], sx), ones));
        }
        const __m256 ds = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(dh)), _mm256_set1_ps(s[m * G + g]));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), ds, acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + (m0 + r) * N + n0 + 8 * h, acc[r]);
  }
}

#endif

void check(const torch::Tensor& x, const torch::Tensor& codes, int64_t n, int64_t bytes_per_block) {
  TORCH_CHECK(codes.scalar_type() == torch::kByte, "packed weights must be uint8, got ", codes.scalar_type());
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "x must be a contiguous float32 [M, K] tensor");
  TORCH_CHECK(x.size(1) % kBlock == 0, "K must be a multiple of 32, got ", x.size(1));
  TORCH_CHECK(n % 16 == 0, "N must be a multiple of 16, got ", n);
  TORCH_CHECK(codes.is_contiguous() && codes.numel() == (n / 16) * (x.size(1) / kBlock) * bytes_per_block,
              "codes do not match N = ", n, ", K = ", x.size(1));
}

template <typename Tile>
void run_tiles(int64_t M, int64_t N, int64_t K, Tile tile) {
  const int64_t tiles = N / 16;
  at::parallel_for(0, tiles, dspark_kernels::grain_for(tiles, dspark_kernels::splits(M * N * K), 16), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      int64_t m = 0;
      for (; m + kRows <= M; m += kRows) tile(t, m, std::integral_constant<int, kRows>{});
      switch (M - m) {
#if defined(__AVX512F__)
        case 7: tile(t, m, std::integral_constant<int, 7>{}); break;
        case 6: tile(t, m, std::integral_constant<int, 6>{}); break;
        case 5: tile(t, m, std::integral_constant<int, 5>{}); break;
        case 4: tile(t, m, std::integral_constant<int, 4>{}); break;
#endif
        case 3: tile(t, m, std::integral_constant<int, 3>{}); break;
        case 2: tile(t, m, std::integral_constant<int, 2>{}); break;
        case 1: tile(t, m, std::integral_constant<int, 1>{}); break;
        default: break;
      }
    }
  });
}

}  // namespace

// Whether a product of M rows runs on the tile unit: AMX builds, where Linux grants it, from 8 rows on (below that
// the vpdpbusd chains are as fast or faster: scripts/kernel_ab.py on SmolLM2's projections, 2 rows 1.17x, 4 rows
// 1.01x, 8 rows 0.94x, 16-32 rows 0.78x of their time). DSPARK_AMX_MIN_ROWS overrides it (0 = never), to measure.
#if defined(DSPARK_AMX)
int64_t amx_min_rows() {
  static const int64_t rows = [] {
    const char* e = std::getenv("DSPARK_AMX_MIN_ROWS");
    const int64_t v = e ? std::atoll(e) : 8;
    return v > 0 && amx_permitted() ? v : int64_t(0);
  }();
  return rows;
}
inline bool use_amx(int64_t M) { return amx_min_rows() > 0 && M >= amx_min_rows(); }
#else
inline bool use_amx(int64_t) { return false; }
#endif

// x quantized per row and block (the offset form for signed weights), and the float32 output, for one product.
// `rows`: rows of xq to allocate (the tile path past 16 rows pads them with zeros to a multiple of 16, since its
// last A tile reads 16 rows).
struct Product {
  int64_t M, K, G;
  torch::Tensor xq, s, ssum, y;
  Product(const torch::Tensor& x, const torch::Tensor& packed, int64_t n, int64_t block_bytes, bool offset,
          int64_t rows = 0)
      : M(x.size(0)), K(x.size(1)), G(x.size(1) / kBlock) {
    check(x, packed, n, block_bytes);
    xq = rows > M ? torch::zeros({rows, K}, torch::kInt8) : torch::empty({M, K}, torch::kInt8);
    s = torch::empty({M, G}, torch::kFloat32);
    ssum = torch::empty({M, G}, torch::kFloat32);
    quantize_rows(x.data_ptr<float>(), M, K, xq.data_ptr<int8_t>(), s.data_ptr<float>(), ssum.data_ptr<float>(),
                  offset);
    y = torch::empty({M, n}, torch::kFloat32);
  }
};

#if defined(DSPARK_AMX)
// The tile path, kept out of line: the vpdpbusd path below compiles (and runs) as it does without it.
inline int64_t amx_rows_allocated(int64_t M) { return M > kAmxRows ? (M + kAmxRows - 1) / kAmxRows * kAmxRows : M; }

__attribute__((noinline)) torch::Tensor q4_mm_amx(const torch::Tensor& x, const torch::Tensor& packed, int64_t n) {
  Product p(x, packed, n, kQ4Bytes, false, amx_rows_allocated(x.size(0)));
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const int8_t* xp = p.xq.data_ptr<int8_t>();
  const float *sp = p.s.data_ptr<float>(), *ssp = p.ssum.data_ptr<float>();
  float* yp = p.y.data_ptr<float>();
  const int64_t K = p.K, G = p.G;
  run_tiles_amx(p.M, n, p.K, [&](int64_t t, int64_t m, auto rows) {
    q4_tile_amx<decltype(rows)::value>(wp + t * G * kQ4Bytes, xp, sp, ssp, K, G, m, yp, n, t * 16);
  });
  return p.y;
}

__attribute__((noinline)) torch::Tensor q8_mm_amx(const torch::Tensor& x, const torch::Tensor& packed, int64_t n) {
  Product p(x, packed, n, kQ8Bytes, kQ8Offset, amx_rows_allocated(x.size(0)));
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const int8_t* xp = p.xq.data_ptr<int8_t>();
  const float* sp = p.s.data_ptr<float>();
  float* yp = p.y.data_ptr<float>();
  const int64_t K = p.K, G = p.G;
  run_tiles_amx(p.M, n, p.K, [&](int64_t t, int64_t m, auto rows) {
    q8_tile_amx<decltype(rows)::value>(wp + t * G * kQ8Bytes, xp, sp, K, G, m, yp, n, t * 16);
  });
  return p.y;
}
#endif

torch::Tensor q4_mm(const torch::Tensor& x, const torch::Tensor& packed, int64_t n) {
#if defined(DSPARK_AMX)
  if (x.dim() == 2 && use_amx(x.size(0))) return q4_mm_amx(x, packed, n);
#endif
  Product p(x, packed, n, kQ4Bytes, false);
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const int8_t* xp = p.xq.data_ptr<int8_t>();
  const float *sp = p.s.data_ptr<float>(), *ssp = p.ssum.data_ptr<float>();
  float* yp = p.y.data_ptr<float>();
  const int64_t K = p.K, G = p.G;
  run_tiles(p.M, n, p.K, [&](int64_t t, int64_t m, auto rows) {
    q4_tile<decltype(rows)::value>(wp + t * G * kQ4Bytes, xp, sp, ssp, K, G, m, yp, n, t * 16, p.M);
  });
  return p.y;
}

torch::Tensor q8_mm(const torch::Tensor& x, const torch::Tensor& packed, int64_t n) {
#if defined(DSPARK_AMX)
  if (x.dim() == 2 && use_amx(x.size(0))) return q8_mm_amx(x, packed, n);
#endif
  Product p(x, packed, n, kQ8Bytes, kQ8Offset);
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const int8_t* xp = p.xq.data_ptr<int8_t>();
  const float* sp = p.s.data_ptr<float>();
  float* yp = p.y.data_ptr<float>();
  const int64_t K = p.K, G = p.G;
  run_tiles(p.M, n, p.K, [&](int64_t t, int64_t m, auto rows) {
    q8_tile<decltype(rows)::value>(wp + t * G * kQ8Bytes, xp, sp, K, G, m, yp, n, t * 16, p.M);
  });
  return p.y;
}

// Whether products of `rows` rows run on the tile unit here (for tests and reports).
bool q8dot_amx(int64_t rows) { return use_amx(rows); }

// The work (multiply-adds) from which a kernel call splits between threads (parallel.h); returns the previous value.
int64_t set_parallel_min_work(int64_t work) {
  TORCH_CHECK(work >= 0, "the parallel work threshold must be >= 0, got ", work);
  return dspark_kernels::parallel_min_work().exchange(work);
}

TORCH_LIBRARY(dspark_cpu, m) {
  m.def("q4_mm(Tensor x, Tensor packed, int n) -> Tensor", q4_mm);
  m.def("q8_mm(Tensor x, Tensor packed, int n) -> Tensor", q8_mm);
  m.def("q8dot_amx(int rows) -> bool", q8dot_amx);
  m.def("set_parallel_min_work(int work) -> int", set_parallel_min_work);
}
