// y[M, N] = x[M, K] . dequant(w)[N, K]^T (+ bias[N]) for few-row matmuls over block-quantized
// weights. x, y and bias are float32; w is rows of GGUF blocks of 32 weights:
//   Q8_0: f16 scale d, 32 int8 q            (34 bytes): w = d * q
//   Q4_1: f16 scale d, f16 min m, 16 bytes   (20 bytes): w = d * q + m, q = low nibble of byte j
//         for element j, high nibble for element j + 16
// These are llama.cpp's layouts, so a GGUF file's blocks are used as they are stored, only
// reordered: in each whole tile of 4 rows the rows' blocks are interleaved (block 0 of rows 0-3,
// then block 1, ...; kernels/cpu_quant.py `interleave`), so the kernel reads one sequential stream
// instead of 4, which the hardware prefetcher follows much better. Rows past the last whole tile
// stay plain.
//
// Integer dot products: each input row is quantized once per call to int16 in blocks of 32 (scale
// absmax / 32767, round to nearest even: a relative error of ~1e-5, where int8 activations as in
// llama.cpp cost this model 1-4% per matmul and a quarter of its greedy tokens), and a block's
// dot product is exact in int32: VNNI `vpdpwssd` (int16 pairs) where the CPU has it, else AVX2's
// `vpmaddwd`. The weights' integers are widened to int16 once per block and used for every input
// row. Then one float multiply-add per block applies d_w * d_x, and for Q4_1 min_w times the
// block's exact float sum of x.
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
#include "simd_cvt.h"
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

enum { Q8_0 = 0, Q4_1 = 1 };  // same numbering as kernels/cpu_quant.py
#define QK 32
#define TILE_N 4
#if defined(__AVX512VL__)
#define TILE_M 4  // 4 x 4 ymm accumulators fit in AVX-512's 32 vector registers
#else
#define TILE_M 2
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

static inline int64_t block_bytes(int fmt) { return fmt == Q8_0 ? 34 : 20; }

// Input rows quantized per block: int16 values, scale, exact float sum.
typedef struct {
  int16_t *q;
  float *d, *s;
} XQuant;

static void quantize_row(const float *x, int64_t k, int16_t *q, float *d, float *s) {
  for (int64_t g = 0; g < k / QK; ++g) {
    const float *xb = x + g * QK;
    float amax = 0.f, sum = 0.f;
    for (int i = 0; i < QK; ++i) {
      amax = fmaxf(amax, fabsf(xb[i]));
      sum += xb[i];
    }
    const float id = amax > 0.f ? 32767.f / amax : 0.f;
    d[g] = amax / 32767.f;
    s[g] = sum;
    for (int i = 0; i < QK; ++i) q[g * QK + i] = (int16_t)nearbyintf(xb[i] * id);  // nearest, ties to even
  }
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

// a block's 32 integers widened to int16: elements 0-15 and 16-31
static inline __attribute__((always_inline)) void block_ints(const uint8_t *b, const int fmt, __m256i *w) {
  if (fmt == Q8_0) {
    w[0] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 2)));
    w[1] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 18)));
  } else {
    // each byte widened to 16 bits holds both nibbles: the low one is a mask away, the high one a shift
    const __m256i both = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(b + 4)));
    w[0] = _mm256_and_si256(both, _mm256_set1_epi16(0xF));
    w[1] = _mm256_srli_epi16(both, 4);
  }
}

// the exact integer dot product of a block's integers with an input block, as 8 int32 lanes
static inline __attribute__((always_inline)) __m256i block_dot(const __m256i *w, const int16_t *xq) {
  const __m256i x0 = _mm256_loadu_si256((const __m256i *)xq), x1 = _mm256_loadu_si256((const __m256i *)(xq + 16));
  return dot_i16(dot_i16(_mm256_setzero_si256(), w[0], x0), w[1], x1);
}

static inline float hsum(vf v) {  // a fixed order: halves, then pairs
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_add_ps(a, _mm_movehl_ps(a, a));
  a = _mm_add_ss(a, _mm_movehdup_ps(a));
  return _mm_cvtss_f32(a);
}
#endif

typedef struct {
  const float *bias;
  XQuant xq;
  const uint8_t *w;
  float *y;
  int64_t m, n, k;
} Job;

// weight rows [n, n + rows) (rows <= TILE_N) against input rows [m, m + R)
static inline __attribute__((always_inline)) void tile(const Job *j, int64_t n, const int rows, int64_t m,
                                                       const int R, const int fmt) {
  const int64_t K = j->k, G = K / QK, bb = block_bytes(fmt);
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
#if defined(__AVX2__)
    vf dx[TILE_M];  // the input blocks' scales, broadcast once per block for every weight row
    for (int r = 0; r < R; ++r) dx[r] = _mm256_set1_ps(j->xq.d[(m + r) * G + g]);
#endif
    for (int c = 0; c < rows; ++c) {
      // whole tiles are interleaved by block (one sequential stream); a tail tile's rows are plain
      const uint8_t *blk = j->w + (rows == TILE_N ? (n * G + g * TILE_N + c) * bb : ((n + c) * G + g) * bb);
      const float dw = half(blk), mw = fmt == Q4_1 ? half(blk + 2) : 0.f;
#if defined(__AVX2__)
      const vf dwv = _mm256_set1_ps(dw);
      __m256i wi[2];
      block_ints(blk, fmt, wi);
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
          const int w = fmt == Q8_0 ? (int8_t)blk[2 + i] : (i < 16 ? blk[4 + i] & 0xF : blk[4 + i - 16] >> 4);
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

static void run_rows(const Job *j, int64_t begin, int64_t end, const int fmt) {
  for (int64_t n = begin; n < end; n += TILE_N) {
    int64_t m = 0;
    if (n + TILE_N <= end) {  // constant tile sizes keep the accumulators in registers
      for (; m + TILE_M <= j->m; m += TILE_M) tile(j, n, TILE_N, m, TILE_M, fmt);
      for (; m < j->m; ++m) tile(j, n, TILE_N, m, 1, fmt);
    } else {
      for (; m < j->m; ++m) tile(j, n, (int)(end - n), m, 1, fmt);
    }
  }
}

// The OpenMP runtime is the one torch already loaded (same soname), so the kernel shares torch's
// worker threads. k must be a multiple of 32.
void quant_linear(const float *x, const void *w, const float *bias, float *y, int64_t m, int64_t n, int64_t k,
                  int fmt, int threads) {
  const int64_t G = k / QK, tiles = (n + TILE_N - 1) / TILE_N;
  char *buf = (char *)malloc((size_t)(2 * m * k + 2 * m * G * (int64_t)sizeof(float)));
  if (!buf) return;  // the caller's y stays unset only on an allocation failure, which torch would hit first
  const XQuant xq = {(int16_t *)buf, (float *)(buf + 2 * m * k), (float *)(buf + 2 * m * k) + m * G};
  for (int64_t r = 0; r < m; ++r) quantize_row(x + r * k, k, xq.q + r * k, xq.d + r * G, xq.s + r * G);
  const Job j = {bias, xq, (const uint8_t *)w, y, m, n, k};
  if (threads > tiles) threads = (int)tiles;
  if (threads < 1) threads = 1;
  // chunks of tiles handed out as threads free up: a thread slowed by a busy neighbour on its core
  // takes fewer, instead of the whole call waiting for its fixed share
  const int64_t chunk = tiles / (8 * threads) > 1 ? tiles / (8 * threads) : 1;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
  for (int64_t c0 = 0; c0 < tiles; c0 += chunk) {
    const int64_t begin = c0 * TILE_N, stop = (c0 + chunk) * TILE_N < n ? (c0 + chunk) * TILE_N : n;
    if (fmt == Q8_0)
      run_rows(&j, begin, stop, Q8_0);
    else
      run_rows(&j, begin, stop, Q4_1);
  }
  free(buf);
}

