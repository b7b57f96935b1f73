// y[M, N] = x[M, K] . dequant(w)[N, K]^T (+ bias[N]) for few-row matmuls over block-quantized
// weights. x, y and bias are float32; w is rows of GGUF blocks of 32 weights:
//   Q8_0: f16 scale d, 32 int8 q            (34 bytes): w = d * q
//   Q4_1: f16 scale d, f16 min m, 16 bytes   (20 bytes): w = d * q + m, q = low nibble of byte j
//         for element j, high nibble for element j + 16
//   Q5_0: f16 scale d, u32 high bits, 16 bytes (22 bytes): w = d * (q - 16), q's low 4 bits as Q4_1's,
//         bit 4 of element j = bit j of the u32
// or of super-blocks of 256 (Q4_K, Q5_K, Q6_K: kernels/kquant.h, with its own input quantization).
// These are llama.cpp's layouts, so a GGUF file's blocks are used as they are stored, only
// reordered: in each whole tile of 4 rows the rows' blocks are interleaved (block 0 of rows 0-3,
// then block 1, ...), each such tile block field by field (the 4 scales, Q4_1's 4 minimums, then
// the 4 rows' integers; kernels/cpu_quant.py `interleave`), so the kernel reads one sequential
// stream instead of 4, which the hardware prefetcher follows much better, and one load gets 4
// scales. Rows past the last whole tile stay plain.
//
// Integer dot products: each input row is quantized once per call to int16 in blocks of 32 (scale
// absmax / 32767, round to nearest even: a relative error of ~1e-5, where int8 activations as in
// llama.cpp cost this model 1-4% per matmul and a quarter of its greedy tokens), and a block's
// dot product is exact in int32 lanes (pairs of int16 products: `vpmaddwd`, or VNNI's `vpdpwssd` on
// the 8-lane path). The weights' integers are widened to int16 once per block and used for every
// input row. Then one float multiply-add per block applies d_w * d_x, and for Q4_1 min_w times the
// block's exact float sum of x. With AVX-512 a whole block is one 32-word register, so a block costs
// one widening, one vpmaddwd, one conversion and one FMA per input row: one input row is bound by
// memory, many rows by that float work per block.
//
// Batch-invariant: every output is summed in one fixed order whatever M is (an input row is
// quantized alone; integer sums are exact; the per-block float steps and the lane reduction are the
// same code for every tile size), so a row's result never depends on its batch. Threads take the
// weight rows in chunks of whole 4-row tiles, handed out as they free up.
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "row_ops.h"
#include "simd.h"
#include "simd_cvt.h"
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

enum { Q8_0 = 0, Q4_1 = 1, Q5_0 = 2, Q4_K = 3, Q5_K = 4, Q6_K = 5 };  // same numbering as kernels/cpu_quant.py
#define QK 32
// software prefetch this far ahead in a tile's stream: memory, not arithmetic, bounds one input row,
// and the hardware prefetcher alone left ~20% of the bandwidth unused (benchmarks: 12.0 -> 9.5 ms
// for the model's 121 int8 matmuls, cold)
#define PREFETCH_BYTES 4096
#define TILE_N 4
#if defined(__AVX512VL__)
#define TILE_M 4  // 4 x 4 accumulators fit in AVX-512's 32 vector registers
// K formats keep an integer and a float accumulator per pair; the float ones change once per 256 weights, so 4 input
// rows still pay: a verify's few rows then decode each weight block once, not once per pair (the 1.5B Qwen Q4_K_M, 2
// cores: 3 rows 115 -> 97 ms, 4 rows 139 -> 110 ms)
#define TILE_M_K 4
#else
#define TILE_M 2
#define TILE_M_K 1
#endif

static inline float half(const uint8_t *p) {
  uint16_t h;
  memcpy(&h, p, 2);
#ifdef __F16C__
  return _cvtsh_ss(h);
#else
  return f16_to_f32(h);
#endif
}

static inline uint32_t load_u32(const uint8_t *p) {
  uint32_t v;
  memcpy(&v, p, 4);
  return v;
}

static inline int64_t block_bytes(int fmt) { return fmt == Q8_0 ? 34 : fmt == Q4_1 ? 20 : 22; }

// Input rows quantized per block: int16 values, scale, exact float sum.
typedef struct {
  int16_t *q;
  float *d, *s;
} XQuant;

// the largest |x[i]| of n (a multiple of 8): exact in any order; a NaN is skipped, as fmaxf skips it (maxps keeps
// its second operand)
static inline float abs_max(const float *x, int64_t n) {
#ifdef __AVX2__
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 mx = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) mx = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + i), abs_mask), mx);
  return hmax(mx);
#else
  float amax = 0.f;
  for (int64_t i = 0; i < n; ++i) amax = fmaxf(amax, fabsf(x[i]));
  return amax;
#endif
}

// q[i] = x[i] * id rounded to nearest, ties to even (the default rounding mode, as nearbyintf), for n (a multiple
// of 16) values with |x[i] * id| <= 32767
static inline void round_i16(const float *x, int64_t n, float id, int16_t *q) {
#ifdef __AVX2__
  const __m256 vid = _mm256_set1_ps(id);
  for (int64_t i = 0; i < n; i += 16) {
    const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i), vid));
    const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8), vid));
    _mm256_storeu_si256((__m256i *)(q + i), _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8));
  }
#else
  for (int64_t i = 0; i < n; ++i) q[i] = (int16_t)nearbyintf(x[i] * id);
#endif
}

static void quantize_row(const float *x, int64_t k, int16_t *q, float *d, float *s) {
  for (int64_t g = 0; g < k / QK; ++g) {
    const float *xb = x + g * QK;
    float sum = 0.f;
    for (int i = 0; i < QK; ++i) sum += xb[i];  // in order: the sum's rounding is part of the result
    const float amax = abs_max(xb, QK), id = amax > 0.f ? 32767.f / amax : 0.f;
    d[g] = amax / 32767.f;
    s[g] = sum;
    round_i16(xb, QK, id, q + g * QK);
  }
}

typedef struct {
  const float *bias;
  XQuant xq;
  const uint8_t *w;
  float *y;
  int64_t m, n, k;
} Job;

// where one weight block's scale, minimum (Q4_1) or high bits (Q5_0), and integers are
typedef struct {
  const uint8_t *d, *m, *q;
} Block;

// bytes before a row's integers: scale, and Q4_1's minimum or Q5_0's high bits
static inline int head_bytes(int fmt) { return fmt == Q8_0 ? 2 : fmt == Q4_1 ? 4 : 6; }

// block g of weight row n + c of a weight with k columns: in a whole tile (n a multiple of 4) field by
// field, else plain
static inline __attribute__((always_inline)) Block block_in(const uint8_t *w, int64_t k, int64_t n, const int whole,
                                                             int c, int64_t g, const int fmt) {
  const int64_t G = k / QK, bb = block_bytes(fmt), h = head_bytes(fmt);
  if (whole) {
    const uint8_t *t = w + (n * G + g * TILE_N) * bb;
    return (Block){t + 2 * c, t + 2 * TILE_N + (h - 2) * c, t + h * TILE_N + c * (bb - h)};
  }
  const uint8_t *b = w + ((n + c) * G + g) * bb;
  return (Block){b, b + 2, b + h};
}

static inline __attribute__((always_inline)) Block block_at(const Job *j, int64_t n, const int whole, int c,
                                                             int64_t g, const int fmt) {
  return block_in(j->w, j->k, n, whole, c, g, fmt);
}

static inline __attribute__((always_inline)) void prefetch_tile_block(Block b, const int fmt) {
  for (int64_t o = 0; o < TILE_N * block_bytes(fmt); o += 64) __builtin_prefetch(b.d + PREFETCH_BYTES + o);
}

#if defined(__AVX2__)
typedef __m256 vf;
// int32 lanes: a += sums of adjacent int16 products of w and x
static inline __m256i dot_i16(__m256i a, __m256i w, __m256i x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpwssd_epi32(a, w, x);
#else
  return _mm256_add_epi32(a, _mm256_madd_epi16(w, x));
#endif
}

// lane i of 16 = 0xFFFF where bit i of `bits` is set
static inline __m256i bit_lanes(uint32_t bits) {
  const __m256i sel = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, -32768);
  return _mm256_cmpeq_epi16(_mm256_and_si256(_mm256_set1_epi16((short)bits), sel), sel);
}

// a block's 32 integers widened to int16: elements 0-15 and 16-31 (hi: Q5_0's high bits)
static inline __attribute__((always_inline)) void block_ints(const uint8_t *q, const uint8_t *hi, const int fmt,
                                                             __m256i *w) {
  if (fmt == Q8_0) {
    w[0] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)q));
    w[1] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(q + 16)));
  } else {
    // each byte widened to 16 bits holds both nibbles: the low one is a mask away, the high one a shift
    const __m256i both = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)q));
    w[0] = _mm256_and_si256(both, _mm256_set1_epi16(0xF));
    w[1] = _mm256_srli_epi16(both, 4);
    if (fmt == Q5_0) {  // q - 16: minus 16 where the high bit is clear
      const uint32_t h = load_u32(hi);
      const __m256i k16 = _mm256_set1_epi16(16);
      w[0] = _mm256_sub_epi16(w[0], _mm256_andnot_si256(bit_lanes(h), k16));
      w[1] = _mm256_sub_epi16(w[1], _mm256_andnot_si256(bit_lanes(h >> 16), k16));
    }
  }
}

// the exact integer dot product of a block's integers with an input block, as 8 int32 lanes
static inline __attribute__((always_inline)) __m256i block_dot(const __m256i *w, const int16_t *xq) {
  const __m256i x0 = _mm256_loadu_si256((const __m256i *)xq), x1 = _mm256_loadu_si256((const __m256i *)(xq + 16));
  return dot_i16(dot_i16(_mm256_setzero_si256(), w[0], x0), w[1], x1);
}

#endif

// weight rows [n, n + rows) (rows <= TILE_N; whole: a whole tile) against input rows [m, m + R)
static inline __attribute__((always_inline)) void tile(const Job *j, int64_t n, const int rows, const int whole,
                                                       int64_t m, const int R, const int fmt) {
  const int64_t G = j->k / QK;
  float mins[TILE_M][TILE_N];
#if defined(__AVX2__)
  vf acc[TILE_M][TILE_N];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < TILE_N; ++c) acc[r][c] = _mm256_setzero_ps(), mins[r][c] = 0.f;
#else
  float acc[TILE_M][TILE_N];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < TILE_N; ++c) acc[r][c] = 0.f, mins[r][c] = 0.f;
#endif
  for (int64_t g = 0; g < G; ++g) {
    if (whole) prefetch_tile_block(block_at(j, n, 1, 0, g, fmt), fmt);
#if defined(__AVX2__)
    vf dx[TILE_M];  // the input blocks' scales, broadcast once per block for every weight row
    for (int r = 0; r < R; ++r) dx[r] = _mm256_set1_ps(j->xq.d[(m + r) * G + g]);
#endif
    for (int c = 0; c < rows; ++c) {
      const Block b = block_at(j, n, whole, c, g, fmt);
      const float dw = half(b.d), mw = fmt == Q4_1 ? half(b.m) : 0.f;
#if defined(__AVX2__)
      const vf dwv = _mm256_set1_ps(dw);
      __m256i wi[2];
      block_ints(b.q, b.m, fmt, wi);
#endif
      for (int r = 0; r < R; ++r) {
        const int64_t xb = (m + r) * G + g;
#if defined(__AVX2__)
        const __m256i dot = block_dot(wi, j->xq.q + xb * QK);
        acc[r][c] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(dot), dwv), dx[r], acc[r][c]);
#else
        int32_t dot = 0;
        const int16_t *xq = j->xq.q + xb * QK;
        for (int i = 0; i < QK; ++i) {
          int w = fmt == Q8_0 ? (int8_t)b.q[i] : (i < 16 ? b.q[i] & 0xF : b.q[i - 16] >> 4);
          if (fmt == Q5_0) w += (int)((load_u32(b.m) >> i) & 1) * 16 - 16;
          dot += w * xq[i];
        }
        acc[r][c] = fmaf((float)dot, dw * j->xq.d[xb], acc[r][c]);
#endif
        // fmaf, not `+= a * b`: whether the compiler contracts that may differ between tile sizes
        if (fmt == Q4_1) mins[r][c] = fmaf(mw, j->xq.s[xb], mins[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < rows; ++c) {
#if defined(__AVX2__)
      const float dot = hsum(acc[r][c]);
#else
      const float dot = acc[r][c];
#endif
      j->y[(m + r) * j->n + n + c] = dot + mins[r][c] + (j->bias ? j->bias[n + c] : 0.f);
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// a block's 32 integers widened to one register of int16 words (hi: Q5_0's high bits)
static inline __attribute__((always_inline)) __m512i block_ints512(const uint8_t *q, const uint8_t *hi,
                                                                   const int fmt) {
  if (fmt == Q8_0) return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)q));
  // the 16 bytes twice, as words: the first copy's low nibbles are elements 0-15, the second's high ones 16-31
  const __m512i both = _mm512_cvtepu8_epi16(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)q)));
  const __m512i shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
  const __m512i w = _mm512_and_si512(_mm512_srlv_epi16(both, shift), _mm512_set1_epi16(0xF));
  if (fmt != Q5_0) return w;
  return _mm512_mask_sub_epi16(w, ~(__mmask32)load_u32(hi), w, _mm512_set1_epi16(16));  // q - 16
}

// *p in every lane, broadcast by a load (compilers forward a value just stored and broadcast it from a register, on
// the shuffle port)
static inline __attribute__((always_inline)) __m512 bcast_load(const float *p) {
  __m512 v;
  __asm__("vbroadcastss %1, %0" : "=v"(v) : "m"(*p));
  return v;
}

// a whole tile (4 weight rows from n) against input rows [m, m + R), one 16-lane accumulator each
static inline __attribute__((always_inline)) void tile512(const Job *j, int64_t n, int64_t m, const int R,
                                                          const int fmt) {
  const int64_t G = j->k / QK, qbytes = block_bytes(fmt) - head_bytes(fmt);
  __m512 acc[TILE_M][TILE_N];
  __m128 mins[TILE_M];  // Q4_1: the 4 rows' sums of min_w * sum(x)
  for (int r = 0; r < R; ++r) {
    mins[r] = _mm_setzero_ps();
    for (int c = 0; c < TILE_N; ++c) acc[r][c] = _mm512_setzero_ps();
  }
  for (int64_t g = 0; g < G; ++g) {
    const Block b = block_at(j, n, 1, 0, g, fmt);
    prefetch_tile_block(b, fmt);
    const __m128 dw = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)b.d));  // the 4 rows' scales
    __m512i w[TILE_N];
    for (int c = 0; c < TILE_N; ++c) w[c] = block_ints512(b.q + c * qbytes, b.m + 4 * c, fmt);
    for (int r = 0; r < R; ++r) {
      const int64_t xb = (m + r) * G + g;
      const __m512i x = _mm512_loadu_si512((const void *)(j->xq.q + xb * QK));
      // d_w * d_x per weight row, stored: each is broadcast from memory by a load, not by the shuffle port (which
      // the widening needs, and which bounds this loop)
      float s[TILE_N] __attribute__((aligned(16)));
      _mm_store_ps(s, _mm_mul_ps(dw, _mm_set1_ps(j->xq.d[xb])));
      for (int c = 0; c < TILE_N; ++c) {
        // exact: each lane sums two products of at most 2^22
        const __m512 dot = _mm512_cvtepi32_ps(_mm512_madd_epi16(w[c], x));
        acc[r][c] = _mm512_fmadd_ps(dot, bcast_load(s + c), acc[r][c]);
      }
      if (fmt == Q4_1)
        mins[r] = _mm_fmadd_ps(_mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)b.m)), _mm_set1_ps(j->xq.s[xb]), mins[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float mn[TILE_N];
    _mm_storeu_ps(mn, mins[r]);
    for (int c = 0; c < TILE_N; ++c)
      j->y[(m + r) * j->n + n + c] = _mm512_reduce_add_ps(acc[r][c]) + mn[c] + (j->bias ? j->bias[n + c] : 0.f);
  }
}
#define WHOLE_TILE(j, n, m, R, fmt) tile512(j, n, m, R, fmt)
#else
#define WHOLE_TILE(j, n, m, R, fmt) tile(j, n, TILE_N, 1, m, R, fmt)
#endif

// the input rows [m, j->m) left after whole groups of `max` (fewer than max): one pass over the weight tile for them
// all, each count a constant so the accumulators stay in registers
#define REST_ROWS(TILE_FN, j, n, m, max, fmt)                      \
  do {                                                             \
    const int64_t rest_ = (j)->m - (m);                            \
    if ((max) > 3 && rest_ == 3) TILE_FN(j, n, m, REST3(max), fmt); \
    else if ((max) > 2 && rest_ == 2) TILE_FN(j, n, m, REST2(max), fmt); \
    else if (rest_ == 1) TILE_FN(j, n, m, 1, fmt);                 \
  } while (0)
// 3 and 2 where a group holds more, else 1 (the branch is then dead, but its tile must fit the accumulator arrays)
#define REST3(max) ((max) > 3 ? 3 : 1)
#define REST2(max) ((max) > 2 ? 2 : 1)

// Q6_K's high bits in whole tiles: where AVX-512 kernels read them (as masks: one 32-bit plane per bit and sub-block),
// two bit planes as the plain block holds them; elsewhere packed 2 bits a weight, byte 32 (s / 4) + l holding element
// l of sub-blocks s, 4 at a time (q6k_pack_high), so an AVX2 kernel takes a sub-block's high bits with a shift and a
// mask instead of expanding bits to bytes (batch-1 Q6_K 13-20 -> 18-26 GB/s on a Zen 3). Same bits either way.
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define Q6K_PACKED 0
#else
#define Q6K_PACKED 1
#endif

#include "kquant.h"

static inline __attribute__((always_inline)) void run_rows(const Job *j, int64_t begin, int64_t end, const int fmt) {
  for (int64_t n = begin; n < end; n += TILE_N) {
    int64_t m = 0;
    if (n + TILE_N <= end) {  // constant tile sizes keep the accumulators in registers
      for (; m + TILE_M <= j->m; m += TILE_M) WHOLE_TILE(j, n, m, TILE_M, fmt);
      REST_ROWS(WHOLE_TILE, j, n, m, TILE_M, fmt);
    } else {
      for (; m < j->m; ++m) tile(j, n, (int)(end - n), 0, m, 1, fmt);
    }
  }
}

enum { AS_IS = 0, RMS_NORM = 1, SILU_MUL = 2, ADD_RMS_NORM = 3, GELU_MUL = 4 };  // prologues, numbered as in kernels/cpu_quant.py

// input row r transformed by the prologue (into `row` where it changes it), as fused_ops.c computes it
static inline const float *prepare_row(float *x, int64_t r, int64_t k, int prologue, const float *norm_w, float eps,
                                       const float *residual, float *row) {
  float *xr = x + r * (prologue == SILU_MUL || prologue == GELU_MUL ? 2 * k : k);
  if (prologue == ADD_RMS_NORM) {
    const float *yr = residual + r * k;
#pragma omp simd
    for (int64_t i = 0; i < k; ++i) xr[i] += yr[i];
  }
  if (prologue == RMS_NORM || prologue == ADD_RMS_NORM) {
    scale_row(xr, norm_w, rms_scale(xr, k, eps), row, k);
    return row;
  }
  if (prologue == SILU_MUL) {
    silu_mul_row(xr, xr + k, row, k);
    return row;
  }
  if (prologue == GELU_MUL) {
    gelu_tanh_mul_row(xr, xr + k, row, k);
    return row;
  }
  return xr;
}

// threads for `tiles` tiles, and the chunk of tiles each takes at a time: chunks are handed out as threads free
// up, so a thread slowed by a busy neighbour on its core takes fewer, instead of the whole call waiting for it
static inline int64_t chunk_of(int64_t tiles, int *threads) {
  if (*threads > tiles) *threads = (int)tiles;
  if (*threads < 1) *threads = 1;
  return tiles / (8 * *threads) > 1 ? tiles / (8 * *threads) : 1;
}

// block b's 32 weights as floats (as cpu_quant.dequantize computes them)
static inline __attribute__((always_inline)) void block_floats(Block b, const int fmt, float *o) {
  const float d = half(b.d);
  if (fmt == Q8_0) {
    for (int e = 0; e < QK; ++e) o[e] = (float)(int8_t)b.q[e] * d;
  } else if (fmt == Q5_0) {
    const uint32_t hi = load_u32(b.m);
    for (int e = 0; e < QK; ++e)
      o[e] = (float)((e < 16 ? b.q[e] & 0xF : b.q[e - 16] >> 4) + (int)((hi >> e) & 1) * 16 - 16) * d;
  } else {
    const float mn = half(b.m);
    for (int e = 0; e < QK; ++e) o[e] = fmaf((float)(e < 16 ? b.q[e] & 0xF : b.q[e - 16] >> 4), d, mn);
  }
}

#if defined(__AVX512BF16__)
// the 4 rows of whole tile block g (weight rows n to n + 3) as bfloat16, a 32-word vector a row, rounded to nearest
// even as f32_to_bf16 rounds. Q4_1 and Q5_0 have 16 and 32 possible values per block: those are computed (as floats,
// then rounded) into a table that one word permute indexes with the block's integers; two Q4_1 rows share a table
// (the index's bit 4 picks the row). The tile's 4 scales (and minimums) are converted by one instruction, not one
// per row: the shuffle port, which bounds this loop, is left to the widening and the permute.
static inline __attribute__((always_inline)) void tile_bf16v(const uint8_t *w, int64_t k, int64_t n, int64_t g,
                                                             const int fmt, __m512i *v) {
  const Block b = block_in(w, k, n, 1, 0, g, fmt);
  const int64_t qbytes = block_bytes(fmt) - head_bytes(fmt);
  prefetch_tile_block(b, fmt);
  float hd[8] __attribute__((aligned(32)));  // the 4 scales, then Q4_1's 4 minimums (stored after the scales)
  if (fmt == Q4_1)
    _mm256_store_ps(hd, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b.d)));
  else
    _mm_store_ps(hd, _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)b.d)));
  if (fmt == Q8_0) {
    for (int t = 0; t < TILE_N; ++t) {
      const uint8_t *q = b.q + t * qbytes;
      const __m512 d = bcast_load(hd + t);
      const __m512 lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q))), d);
      const __m512 hi =
          _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16)))), d);
      v[t] = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
    }
    return;
  }
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  if (fmt == Q4_1) {
    for (int t = 0; t < TILE_N; t += 2) {
      const __m512 v0 = _mm512_fmadd_ps(iota, bcast_load(hd + t), bcast_load(hd + 4 + t));
      const __m512 v1 = _mm512_fmadd_ps(iota, bcast_load(hd + t + 1), bcast_load(hd + 5 + t));
      const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(v1, v0);  // words 0-15 row t's values, 16-31 row t + 1's
      v[t] = _mm512_permutexvar_epi16(block_ints512(b.q + t * qbytes, NULL, Q4_1), table);
      v[t + 1] = _mm512_permutexvar_epi16(
          _mm512_or_si512(block_ints512(b.q + (t + 1) * qbytes, NULL, Q4_1), _mm512_set1_epi16(16)), table);
    }
    return;
  }
  for (int t = 0; t < TILE_N; ++t) {  // Q5_0: index q + 16 (bit 4) for the value d (index - 16)
    const __m512 d = bcast_load(hd + t);
    const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(iota, d),
                                                       _mm512_mul_ps(_mm512_sub_ps(iota, _mm512_set1_ps(16.f)), d));
    __m512i q = block_ints512(b.q + t * qbytes, b.m + 4 * t, Q4_1);  // the low 4 bits
    q = _mm512_mask_add_epi16(q, (__mmask32)load_u32(b.m + 4 * t), q, _mm512_set1_epi16(16));
    v[t] = _mm512_permutexvar_epi16(q, table);
  }
}
#endif

#ifdef KMANY_BF16
// the panel chunk [kc, kc + len) of weight rows [n, n + 4 tiles) for Q8_0 / Q4_1 / Q5_0, decoded to bfloat16 (the rows
// of missing tiles zero)
static inline __attribute__((always_inline)) void qpanel_fill(const uint8_t *w, int64_t k, int64_t n, int tiles,
                                                              int64_t kc, int64_t len, uint16_t *panel, const int fmt) {
  for (int64_t g = kc / QK; g < (kc + len) / QK; ++g) {
    __m512i v[4][TILE_N], col[4];
    for (int c = 0; c < 4; ++c)
      if (c < tiles)
        tile_bf16v(w, k, n + TILE_N * c, g, fmt, v[c]);
      else
        for (int t = 0; t < TILE_N; ++t) v[c][t] = _mm512_setzero_si512();
    for (int t = 0; t < TILE_N; ++t) {
      for (int c = 0; c < 4; ++c) col[c] = v[c][t];
      panel_put4(panel, g - kc / QK, t, col);
    }
  }
}

#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
#include "amx_panel.h"
#define KMANY_AMX 1

// weight rows [n, n + 4 tiles) over the whole of K as AMX tiles (amx_panel.h: row r of a panel's half at 32 r in each
// k-block's tile), for Q8_0 / Q4_1 / Q5_0
static inline __attribute__((always_inline)) void qamx_fill(const uint8_t *w, int64_t k, int64_t n, int tiles,
                                                            int64_t g0, int64_t g1, uint16_t *panel, const int fmt) {
  for (int64_t g = g0; g < g1; ++g)
    for (int c = 0; c < tiles; ++c) {
      __m512i v[TILE_N];
      tile_bf16v(w, k, n + TILE_N * c, g, fmt, v);
      for (int t = 0; t < TILE_N; ++t) _mm512_store_si512((void *)(panel + g * 512 + (TILE_N * c + t) * 32), v[t]);
    }
}

// k-blocks [b0, b1) of weight rows [n0, n0 + 32) (`tiles` whole tiles of them) decoded into `panel`, 16 rows to a half
static inline __attribute__((always_inline)) void amx_fill(const KJob *j, int64_t n0, int tiles, int64_t b0,
                                                           int64_t b1, uint16_t *panel, const int fmt) {
  for (int h = 0; h < 2 && 4 * h < tiles; ++h) {
    const int part = tiles - 4 * h < 4 ? tiles - 4 * h : 4;
    if (fmt < Q4_K)
      qamx_fill(j->w, j->k, n0 + 16 * h, part, b0, b1, panel + 16 * h * j->k, fmt);
    else
      kamx_fill(j, n0 + 16 * h, part, b0 * 32 / QKK, b1 * 32 / QKK, panel + 16 * h * j->k, fmt);
  }
}

// k-blocks decoded between passes of the tiles when one panel pass covers every input row (a super-block): the panel's
// part stays in L1 from its decode to its tile loads
#define AMX_CHUNK_BLOCKS (QKK / 32)

// weight rows [n0, n0 + 32) (`tiles` whole tiles of them) against input-row blocks [i0, i1): with at most two input
// blocks, the panel decoded a chunk at a time between the tile products, else whole and then passed over the blocks
static inline __attribute__((always_inline)) void amx_rows_of(const KJob *j, const uint16_t *xv, int64_t n0,
                                                              int tiles, int64_t i0, int64_t i1, uint16_t *panel,
                                                              const int fmt) {
  const __mmask16 mask[2] = {(__mmask16)((1u << (TILE_N * (tiles < 4 ? tiles : 4))) - 1),
                             (__mmask16)((1u << (TILE_N * (tiles > 4 ? tiles - 4 : 0))) - 1)};
  const int64_t kb = j->k / 32;
  float *y = j->y + n0;
  const float *bias = j->bias ? j->bias + n0 : NULL;
  if (i1 - i0 <= 2) {
    const int two = i1 - i0 == 2;
    amx_zero();
    for (int64_t b = 0; b < kb; b += AMX_CHUNK_BLOCKS) {
      const int64_t e = b + AMX_CHUNK_BLOCKS < kb ? b + AMX_CHUNK_BLOCKS : kb;
      amx_fill(j, n0, tiles, b, e, panel, fmt);
      amx_dots(xv + i0 * kb * 512, kb, panel, b, e, two);
    }
    amx_store(i0, two, j->m, y, j->n, bias, mask);
    return;
  }
  amx_fill(j, n0, tiles, 0, kb, panel, fmt);
  amx_pass(xv, kb, panel, i0, i1, j->m, y, j->n, bias, mask);
}
#endif

// a weight row past the last whole tile against bfloat16 input rows [m0, m1): its floats, one dot per input row
static void qmany_bf16_tail(const KJob *j, const uint16_t *xb, int64_t row, int64_t m0, int64_t m1, float *wrow,
                            int fmt) {
  for (int64_t g = 0; g < j->k / QK; ++g) block_floats(block_in(j->w, j->k, row, 0, 0, g, fmt), fmt, wrow + g * QK);
  many_bf16_row(j, xb, row, m0, m1, wrow);
}
#endif

#ifdef KMANY_BF16
// weight rows [n0, n0 + 16) (`tiles` whole tiles of them) against bfloat16 input rows [m0, m1), a chunk of PANEL_KC
// columns at a time decoded into `panel`
static inline __attribute__((always_inline)) void panel_rows_of(const KJob *j, const uint16_t *xb, int64_t n0,
                                                                int tiles, int64_t m0, int64_t m1, uint16_t *panel,
                                                                const int fmt) {
  const __mmask16 mask = (__mmask16)((1u << (TILE_N * tiles)) - 1);  // row 4c + t of the panel is in lane 4c + t
  for (int64_t kc = 0; kc < j->k; kc += PANEL_KC) {
    const int64_t len = j->k - kc < PANEL_KC ? j->k - kc : PANEL_KC;
    if (fmt < Q4_K)
      qpanel_fill(j->w, j->k, n0, tiles, kc, len, panel, fmt);
    else
      kpanel_fill(j, n0, tiles, kc, len, panel, fmt);
    panel_pass(xb, j->k, j->n, panel, kc, len, m0, m1, j->y + n0, j->bias ? j->bias + n0 : NULL, mask);
  }
}

// a panel's weight rows [n0, ...) against input rows [m0, m1): on AMX tiles (xv) where `amx`, else the AVX512-BF16
// panel (xb)
static inline __attribute__((always_inline)) void rows_of(const KJob *j, const uint16_t *xb, const uint16_t *xv,
                                                          int64_t n0, int tiles, int64_t m0, int64_t m1,
                                                          uint16_t *panel, int amx, const int fmt) {
#ifdef KMANY_AMX
  if (amx) {
    amx_rows_of(j, xv, n0, tiles, m0 / 16, (m1 + 15) / 16, panel, fmt);
    return;
  }
#endif
  (void)xv, (void)amx;
  panel_rows_of(j, xb, n0, tiles, m0, m1, panel, fmt);
}

static void kquant_linear_bf16(float *x, const void *w, const float *bias, float *y, int64_t m, int64_t n, int64_t k,
                               int fmt, int prologue, const float *norm_w, float eps, const float *residual,
                               int threads) {
#ifdef KMANY_AMX
  const int amx = amx_ready();
#else
  const int amx = 0;
#endif
  const int64_t blocks16 = (m + 15) / 16;  // AMX's input-row blocks
  uint16_t *xb = (uint16_t *)malloc((size_t)(m * k * 2)), *xv = NULL;
  if (amx) xv = (uint16_t *)aligned_alloc(64, (size_t)(blocks16 * 16 * k * 2));
  if (!xb || (amx && !xv)) {
    free(xb), free(xv);
    return;
  }
  const KJob j = {bias, NULL, NULL, NULL, (const uint8_t *)w, y, m, n, k};
  // whole tiles in panels of 16 rows (the last may hold fewer tiles), then the rows past the last whole tile
  const int64_t rows = amx ? 2 * PANEL_N : PANEL_N;  // weight rows per panel: AMX takes two halves of 16
  const int64_t n4 = n / TILE_N * TILE_N, panels = (n4 + rows - 1) / rows, items = panels + n - n4;
  if (threads > items) threads = (int)items;
  if (threads < 1) threads = 1;
  // input rows per pass over the weights, a multiple of what one pass over a panel takes (AMX: 4 blocks of 16)
  const int64_t unit = amx ? 64 : PANEL_MR;
  int64_t block = (amx ? AMX_BLOCK_BYTES : PANEL_BLOCK_BYTES) / (2 * k) / unit * unit;
  block = block < unit ? unit : block;
#pragma omp parallel num_threads(threads)
  {
    // the panel (the whole of K for AMX), a weight row's floats (rows past the last whole tile), a transformed input row
    const int64_t kc = amx ? k : k < PANEL_KC ? k : PANEL_KC;
    uint16_t *panel = (uint16_t *)aligned_alloc(64, (size_t)((rows * kc * 2 + 2 * k * 4 + 63) / 64 * 64));
    float *wrow = (float *)(panel + rows * kc), *row = wrow + k;
    if (amx) {
      memset(panel, 0, (size_t)(rows * kc * 2));  // a last panel's missing rows: their sums are never stored
#ifdef KMANY_AMX
      amx_configure();
#endif
    }
#pragma omp for schedule(static)
    for (int64_t r = 0; r < m; ++r) {  // each input row transformed, then rounded to bfloat16 once
      const float *xr = prepare_row(x, r, k, prologue, norm_w, eps, residual, row);
      for (int64_t i = 0; i < k; i += 32)
        _mm512_storeu_si512((void *)(xb + r * k + i),
                            (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(xr + i + 16), _mm512_loadu_ps(xr + i)));
    }
#ifdef KMANY_AMX
    if (amx) {
#pragma omp for schedule(static)
      for (int64_t i = 0; i < blocks16; ++i) amx_inputs(xb, m, k, i, xv);
    }
#endif
    for (int64_t m0 = 0; m0 < m; m0 += block) {
      const int64_t m1 = m0 + block < m ? m0 + block : m;
#pragma omp for schedule(dynamic, 1)
      for (int64_t i = 0; i < items; ++i) {
        if (i >= panels) {
          const int64_t r = n4 + i - panels;
          if (fmt >= Q4_K)
            kmany_bf16_tail(&j, xb, r, m0, m1, wrow, fmt);
          else
            qmany_bf16_tail(&j, xb, r, m0, m1, wrow, fmt);
          continue;
        }
        const int64_t n0 = i * rows;
        const int tiles = n4 - n0 < rows ? (int)((n4 - n0) / TILE_N) : (int)(rows / TILE_N);
        switch (fmt) {  // one specialised fill per format
          case Q8_0: rows_of(&j, xb, xv, n0, tiles, m0, m1, panel, amx, Q8_0); break;
          case Q4_1: rows_of(&j, xb, xv, n0, tiles, m0, m1, panel, amx, Q4_1); break;
          case Q5_0: rows_of(&j, xb, xv, n0, tiles, m0, m1, panel, amx, Q5_0); break;
          case Q4_K: rows_of(&j, xb, xv, n0, tiles, m0, m1, panel, amx, Q4_K); break;
          case Q5_K: rows_of(&j, xb, xv, n0, tiles, m0, m1, panel, amx, Q5_K); break;
          default: rows_of(&j, xb, xv, n0, tiles, m0, m1, panel, amx, Q6_K); break;
        }
      }
    }
#ifdef KMANY_AMX
    if (amx) _tile_release();
#endif
    free(panel);
  }
  free(xb), free(xv);
}
#endif

static void kquant_linear(float *x, const void *w, const float *bias, float *y, int64_t m, int64_t n, int64_t k,
                          int fmt, int prologue, const float *norm_w, float eps, const float *residual, int threads,
                          int invariant) {
#ifdef KMANY_BF16
  if (m >= KMANY_MIN_ROWS && !invariant) {
    kquant_linear_bf16(x, w, bias, y, m, n, k, fmt, prologue, norm_w, eps, residual, threads);
    return;
  }
#else
  (void)invariant;
#endif
  const int64_t tiles = (n + TILE_N - 1) / TILE_N;
  char *buf = (char *)malloc((size_t)(2 * m * k + (m * k / QKK + k) * (int64_t)sizeof(float) +
                                      m * k / 32 * (int64_t)sizeof(int32_t)));
  if (!buf) return;
  int16_t *xq = (int16_t *)buf;
  float *xd = (float *)(buf + 2 * m * k), *row = xd + m * k / QKK;
  int32_t *xs = (int32_t *)(row + k);
  for (int64_t r = 0; r < m; ++r)
    quantize_row_k(prepare_row(x, r, k, prologue, norm_w, eps, residual, row), k, xq + r * k, xd + r * (k / QKK),
                   xs + r * (k / 32));
  const KJob j = {bias, xq, xd, xs, (const uint8_t *)w, y, m, n, k};
  const int64_t chunk = chunk_of(tiles, &threads);
#ifdef KMANY
  const int many = m >= KMANY_MIN_ROWS;
  // input rows per pass over the weights (a multiple of the row tile, at least one tile)
  int64_t block = KMANY_BLOCK_BYTES / (2 * k) / KMANY_R * KMANY_R;
  block = !many ? m : block < KMANY_R ? KMANY_R : block;
#else
  const int64_t block = m;
#endif
#pragma omp parallel num_threads(threads)
  {
#ifdef KMANY
    char *scratch = many ? (char *)malloc((size_t)kmany_scratch(k)) : NULL;
#else
    char *scratch = NULL;
#endif
    for (int64_t m0 = 0; m0 < m; m0 += block) {
      const int64_t m1 = m0 + block < m ? m0 + block : m;
#pragma omp for schedule(dynamic, 1)
      for (int64_t c0 = 0; c0 < tiles; c0 += chunk) {
        const int64_t begin = c0 * TILE_N, stop = (c0 + chunk) * TILE_N < n ? (c0 + chunk) * TILE_N : n;
        switch (fmt) {  // the format a constant in each copy
          case Q4_K: krun_rows(&j, begin, stop, m0, m1, scratch, Q4_K); break;
          case Q5_K: krun_rows(&j, begin, stop, m0, m1, scratch, Q5_K); break;
          default: krun_rows(&j, begin, stop, m0, m1, scratch, Q6_K); break;
        }
      }
    }
    free(scratch);
  }
  free(buf);
}

#include "q8_linear.h"

// The OpenMP runtime is the one torch already loaded (same soname), so the kernel shares torch's
// worker threads. k must be a multiple of 32 (256 for the K formats). The input rows are first transformed by
// `prologue`, by the same row functions as kernels/fused_ops.c (so the result is the unfused one, bit for bit):
// AS_IS x [m, k]; RMS_NORM x [m, k] normalized and scaled by norm_w; SILU_MUL (GELU_MUL) x [m, 2k], gate | up;
// ADD_RMS_NORM x [m, k] += residual [m, k] in place (the residual stream), then as RMS_NORM. K-format calls of many rows
// decode each weight tile once for all of them (kquant.h's kmany, the same sums as for a few rows); unless
// `invariant`, a CPU with bfloat16 dot products takes kquant.h's bfloat16 path for them instead (faster, sums that
// round differently). Those are the `exact` path (int16 activations); otherwise the activations are int8
// (q8_linear.h), batch-invariant always.
void quant_linear(float *x, const void *w, const float *bias, float *y, int64_t m, int64_t n, int64_t k, int fmt,
                  int prologue, const float *norm_w, float eps, const float *residual, int threads, int invariant,
                  int exact) {
  if (!exact) {
    q8_linear(x, w, bias, y, m, n, k, fmt, prologue, norm_w, eps, residual, threads);
    return;
  }
  if (fmt >= Q4_K) {
    kquant_linear(x, w, bias, y, m, n, k, fmt, prologue, norm_w, eps, residual, threads, invariant);
    return;
  }
#ifdef KMANY_BF16
  if (m >= KMANY_MIN_ROWS && !invariant) {  // each tile decoded to bfloat16 once for all the rows, as the K formats
    kquant_linear_bf16(x, w, bias, y, m, n, k, fmt, prologue, norm_w, eps, residual, threads);
    return;
  }
#endif
  const int64_t G = k / QK, tiles = (n + TILE_N - 1) / TILE_N;
  char *buf = (char *)malloc((size_t)(2 * m * k + 2 * m * G * (int64_t)sizeof(float) + k * (int64_t)sizeof(float)));
  if (!buf) return;  // the caller's y stays unset only on an allocation failure, which torch would hit first
  const XQuant xq = {(int16_t *)buf, (float *)(buf + 2 * m * k), (float *)(buf + 2 * m * k) + m * G};
  float *row = xq.s + m * G;  // one transformed input row
  for (int64_t r = 0; r < m; ++r)
    quantize_row(prepare_row(x, r, k, prologue, norm_w, eps, residual, row), k, xq.q + r * k, xq.d + r * G,
                 xq.s + r * G);
  const Job j = {bias, xq, (const uint8_t *)w, y, m, n, k};
  const int64_t chunk = chunk_of(tiles, &threads);
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
  for (int64_t c0 = 0; c0 < tiles; c0 += chunk) {
    const int64_t begin = c0 * TILE_N, stop = (c0 + chunk) * TILE_N < n ? (c0 + chunk) * TILE_N : n;
    switch (fmt) {
      case Q8_0: run_rows(&j, begin, stop, Q8_0); break;
      case Q4_1: run_rows(&j, begin, stop, Q4_1); break;
      default: run_rows(&j, begin, stop, Q5_0); break;
    }
  }
  free(buf);
}

// 1 where non-invariant calls of many rows take bfloat16 dot products (this build has AVX512-BF16), else 0
int quant_bf16_panels(void) {
#ifdef KMANY_BF16
  return 1;
#else
  return 0;
#endif
}

// out[i] = the float weights of row ids[i] (an embedding lookup): as cpu_quant.dequantize computes them
void quant_rows(const void *w, const int64_t *ids, int64_t count, int64_t n, int64_t k, int fmt, float *out) {
  if (fmt >= Q4_K) {
    kquant_rows((const uint8_t *)w, ids, count, n, k, fmt, out);
    return;
  }
  const int64_t n4 = n / TILE_N * TILE_N;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t row = ids[i], tile0 = row < n4 ? row / TILE_N * TILE_N : row;
    for (int64_t g = 0; g < k / QK; ++g) {
      const Block b = block_in((const uint8_t *)w, k, tile0, row < n4, (int)(row - tile0), g, fmt);
      block_floats(b, fmt, out + i * k + g * QK);
    }
  }
}

// GGUF's Q6_K blocks (ql[128], qh[64], scales[16], d) in plait's plain Q6_K layout (d, scales, the two high-bit
// planes, the low nibbles paired as Q4_K's): cpu_quant._repack's Q6_K branch, its reference, at load speed
void q6k_from_gguf(const uint8_t *src, uint8_t *dst, int64_t blocks) {
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t *ql = src + b * 210, *qh = ql + 128;
    uint8_t *o = dst + b * 210, *planes = o + 18, *nibbles = o + 82, q[8][32];
    memcpy(o, ql + 208, 2);
    memcpy(o + 2, ql + 192, 16);
    for (int s = 0; s < 8; ++s) {  // sub-block s = 4 h + j: element l takes a nibble of ql and bits 2j, 2j + 1 of qh
      const int h = s / 4, j = s % 4;
      for (int l = 0; l < 32; ++l) {
        const uint8_t low = ql[64 * h + 32 * (j % 2) + l];
        q[s][l] = (uint8_t)((j < 2 ? low & 0xF : low >> 4) | (((qh[32 * h + l] >> (2 * j)) & 3) << 4));
      }
    }
    for (int s = 0; s < 8; ++s)  // bit 4 + p of 8 bytes into one byte: a multiply gathers them (0.75 s -> 0.17 s)
      for (int p = 0; p < 2; ++p)
        for (int i = 0; i < 4; ++i) {
          uint64_t word;
          memcpy(&word, q[s] + 8 * i, 8);
          planes[s * 8 + p * 4 + i] = (uint8_t)((((word >> (4 + p)) & 0x0101010101010101ull) * 0x0102040810204080ull) >> 56);
        }
    for (int p = 0; p < 4; ++p)
      for (int l = 0; l < 32; ++l) nibbles[p * 32 + l] = (uint8_t)((q[2 * p][l] & 0xF) | ((q[2 * p + 1][l] & 0xF) << 4));
  }
}

// 1 where whole tiles hold Q6_K's high bits packed (Q6K_PACKED), else 0
int quant_q6k_packed(void) { return Q6K_PACKED; }

// plain Q6_K blocks' two bit planes as Q6K_PACKED tiles hold the high bits, in place (what interleaving does to the rows of
// whole tiles where Q6K_PACKED); cpu_quant._q6k_pack_high is its reference
void q6k_pack_high(uint8_t *blocks, int64_t count) {
  for (int64_t i = 0; i < count; ++i) {
    uint8_t *hi = blocks + i * 210 + 18, packed[64] = {0};
    const KBlock b = {.hi = hi, .packed = 0};  // the plain block's planes, as q6_high reads them
    for (int s = 0; s < 8; ++s)
      for (int l = 0; l < 32; ++l) packed[32 * (s / 4) + l] |= (uint8_t)(q6_high(&b, s, l) << (2 * (s % 4)));
    memcpy(hi, packed, 64);
  }
}

// plain blocks [n, row_bytes] in the kernel's tile layout, in place: within each whole tile of TILE_N rows, block g
// of every row, field by field (the fields' sizes in `fields`); cpu_quant._interleave is its reference
void interleave_tiles(uint8_t *w, int64_t n, int64_t row_bytes, int64_t block_bytes, const int64_t *fields,
                      int64_t nfields) {
  uint8_t *tile = malloc((size_t)(TILE_N * row_bytes));
  for (int64_t t = 0; t + TILE_N <= n; t += TILE_N) {
    uint8_t *out = w + t * row_bytes;
    memcpy(tile, out, (size_t)(TILE_N * row_bytes));
    for (int64_t g = 0; g < row_bytes / block_bytes; ++g)
      for (int64_t f = 0, offset = g * block_bytes; f < nfields; offset += fields[f++])
        for (int r = 0; r < TILE_N; ++r, out += fields[f]) memcpy(out, tile + r * row_bytes + offset, (size_t)fields[f]);
  }
  free(tile);
}
