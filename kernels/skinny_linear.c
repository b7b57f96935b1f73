// y[M, N] = x[M, K] . w[N, K]^T (+ bias[N]) for the few-row matmuls of decoding. x, y and bias
// are float32; w is float32, bfloat16 or float16 (widened on load, float32 arithmetic).
//
// With few rows the work is reading the weight once, so the kernel streams it row-block by
// row-block and keeps each block in L1 while every input row is multiplied against it (4 weight
// rows x 3 input rows of accumulators fill AVX2's 16 registers). Threads take the weight rows in
// chunks, handed out dynamically. Threads are persistent: creating one per call costs ~50 us,
// against ~100 us for the call itself.
//
// Batch-invariant: every output element is one dot product summed in the same order (8-wide
// partial sums over K, then the lane sum, then the tail) whatever M is, whichever row block it
// falls in and however many threads run, so a row's result never depends on its batch. Many-row
// calls go through L2-sized chunks of x for the same reason they stay exact: only the order of
// the loops changes, never that of a sum.
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include "simd.h"
#include "simd_cvt.h"

typedef struct {
  const float *x, *bias;
  const void *w;
  float *y;
  int64_t m, n, k;
} Job;

#define M_CHUNK 48  // input rows per pass over the weight block: 48 x K floats stay in L2

static inline __attribute__((always_inline)) float dot_tail(const float *a, const void *w, int64_t k0, int64_t k,
                                                           const int fmt) {
  float s = 0.f;
  for (int64_t i = k0; i < k; ++i) s += a[i] * load1(w, i, fmt);
  return s;
}

static inline void store(const Job *j, int64_t m, int64_t n, float v) {
  j->y[m * j->n + n] = v + (j->bias ? j->bias[n] : 0.f);
}

// weight rows [begin, end) against input rows [m0, m1); begin is a multiple of 4
static inline __attribute__((always_inline)) void run_rows(const Job *j, int64_t begin, int64_t end, int64_t m0,
                                                          int64_t m1, const int fmt) {
  const int64_t K = j->k;
  int64_t n = begin;
#ifdef __AVX2__
  const int64_t kv = K & ~(int64_t)7;
  for (; n + 4 <= end; n += 4) {
    const void *w0 = at(j->w, n * K, fmt), *w1 = at(j->w, (n + 1) * K, fmt), *w2 = at(j->w, (n + 2) * K, fmt),
               *w3 = at(j->w, (n + 3) * K, fmt);
    const void *wr[4] = {w0, w1, w2, w3};
    int64_t m = m0;
    for (; m + 3 <= m1; m += 3) {
      const float *x0 = j->x + m * K, *x1 = x0 + K, *x2 = x1 + K;
      __m256 a[3][4];
      for (int r = 0; r < 3; ++r)
        for (int c = 0; c < 4; ++c) a[r][c] = _mm256_setzero_ps();
      for (int64_t k = 0; k < kv; k += 8) {
        const __m256 v0 = _mm256_loadu_ps(x0 + k), v1 = _mm256_loadu_ps(x1 + k), v2 = _mm256_loadu_ps(x2 + k);
        for (int c = 0; c < 4; ++c) {
          const __m256 wv = load8(at(wr[c], k, fmt), fmt);
          a[0][c] = _mm256_fmadd_ps(wv, v0, a[0][c]);
          a[1][c] = _mm256_fmadd_ps(wv, v1, a[1][c]);
          a[2][c] = _mm256_fmadd_ps(wv, v2, a[2][c]);
        }
      }
      const float *xs[3] = {x0, x1, x2};
      for (int r = 0; r < 3; ++r)
        for (int c = 0; c < 4; ++c) store(j, m + r, n + c, hsum(a[r][c]) + dot_tail(xs[r], wr[c], kv, K, fmt));
    }
    for (; m < m1; ++m) {
      const float *x0 = j->x + m * K;
      __m256 a[4];
      for (int c = 0; c < 4; ++c) a[c] = _mm256_setzero_ps();
      for (int64_t k = 0; k < kv; k += 8) {
        const __m256 v = _mm256_loadu_ps(x0 + k);
        for (int c = 0; c < 4; ++c) a[c] = _mm256_fmadd_ps(load8(at(wr[c], k, fmt), fmt), v, a[c]);
      }
      for (int c = 0; c < 4; ++c) store(j, m, n + c, hsum(a[c]) + dot_tail(x0, wr[c], kv, K, fmt));
    }
  }
#endif
  for (; n < end; ++n)
    for (int64_t m = m0; m < m1; ++m) store(j, m, n, dot_tail(j->x + m * K, at(j->w, n * K, fmt), 0, K, fmt));
}

#ifdef __AVX2__
// bfloat16 weights in the blocked layout of kernels/cpu_linear.py (`block_bf16`): each block of 4
// rows stores, for every 16 columns, the 4 rows' 16 values side by side (128 bytes), then the 4
// rows' tails; rows past the last whole block stay plain. The kernel then reads one sequential
// stream: 4 rows of a 16-bit weight read in place are 4 streams of about one 4 KiB page each, which
// the hardware prefetcher follows badly (11 against 19 GB/s for the LM head here).
// One 256-bit load holds 16 values in pairs; a shift (even elements) and a mask (odd ones) widen
// both halves to float32 with no shuffle. The input rows are split the same way once per call
// (xp: per 16-block, its 8 even then its 8 odd elements). 4 weight rows x 2 input rows of
// accumulators, plus 2 x 2 input vectors, fit AVX2's 16 registers.
static inline __attribute__((always_inline)) void widen(const uint16_t *p, __m256 *even, __m256 *odd) {
  const __m256i raw = _mm256_loadu_si256((const __m256i *)p);
  *even = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
  *odd = _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32((int)0xffff0000u)));
}

static void run_rows_bf16(const Job *j, const float *xp, int64_t begin, int64_t end, int64_t m0, int64_t m1) {
  const int64_t K = j->k, k16 = K & ~(int64_t)15, kt = K - k16;
  const uint16_t *w = (const uint16_t *)j->w;
  int64_t n = begin;
  for (; n + 4 <= end; n += 4) {
    const uint16_t *blk = w + n * K, *tails = blk + 4 * k16;
    int64_t m = m0;
    for (; m + 2 <= m1; m += 2) {
      const float *p0 = xp + m * K, *p1 = p0 + K;
      __m256 a[2][4];
      for (int r = 0; r < 2; ++r)
        for (int c = 0; c < 4; ++c) a[r][c] = _mm256_setzero_ps();
      for (int64_t k = 0; k < k16; k += 16) {
        const __m256 e0 = _mm256_loadu_ps(p0 + k), o0 = _mm256_loadu_ps(p0 + k + 8);
        const __m256 e1 = _mm256_loadu_ps(p1 + k), o1 = _mm256_loadu_ps(p1 + k + 8);
        const uint16_t *chunk = blk + 4 * k;
        for (int c = 0; c < 4; ++c) {
          __m256 we, wo;
          widen(chunk + 16 * c, &we, &wo);
          a[0][c] = _mm256_fmadd_ps(wo, o0, _mm256_fmadd_ps(we, e0, a[0][c]));
          a[1][c] = _mm256_fmadd_ps(wo, o1, _mm256_fmadd_ps(we, e1, a[1][c]));
        }
      }
      for (int r = 0; r < 2; ++r)
        for (int c = 0; c < 4; ++c)
          store(j, m + r, n + c,
                hsum(a[r][c]) + dot_tail(j->x + (m + r) * K + k16, tails + c * kt, 0, kt, FMT_BF16));
    }
    for (; m < m1; ++m) {
      const float *p0 = xp + m * K;
      __m256 a[4];
      for (int c = 0; c < 4; ++c) a[c] = _mm256_setzero_ps();
      for (int64_t k = 0; k < k16; k += 16) {
        const __m256 e0 = _mm256_loadu_ps(p0 + k), o0 = _mm256_loadu_ps(p0 + k + 8);
        const uint16_t *chunk = blk + 4 * k;
        for (int c = 0; c < 4; ++c) {
          __m256 we, wo;
          widen(chunk + 16 * c, &we, &wo);
          a[c] = _mm256_fmadd_ps(wo, o0, _mm256_fmadd_ps(we, e0, a[c]));
        }
      }
      for (int c = 0; c < 4; ++c)
        store(j, m, n + c, hsum(a[c]) + dot_tail(j->x + m * K + k16, tails + c * kt, 0, kt, FMT_BF16));
    }
  }
  for (; n < end; ++n)  // plain rows past the last whole block
    for (int64_t m = m0; m < m1; ++m) store(j, m, n, dot_tail(j->x + m * K, w + n * K, 0, K, FMT_BF16));
}

// x [M, K] -> xp: within each 16-block of a row, its even elements then its odd ones (the tail as is)
static void split_even_odd(const float *x, float *xp, int64_t m, int64_t k) {
  const int64_t k16 = k & ~(int64_t)15;
  for (int64_t r = 0; r < m; ++r) {
    const float *src = x + r * k;
    float *dst = xp + r * k;
    for (int64_t b = 0; b < k16; b += 16)
      for (int i = 0; i < 8; ++i) {
        dst[b + i] = src[b + 2 * i];
        dst[b + 8 + i] = src[b + 2 * i + 1];
      }
    for (int64_t i = k16; i < k; ++i) dst[i] = src[i];
  }
}
#endif

static void run_part(const Job *j, const float *xp, int64_t begin, int64_t end, int fmt) {
  for (int64_t m0 = 0; m0 < j->m; m0 += M_CHUNK) {
    const int64_t m1 = m0 + M_CHUNK < j->m ? m0 + M_CHUNK : j->m;
    switch (fmt) {  // each case is run_rows specialised for its weight format
#ifdef __AVX2__
      case FMT_BF16_BLOCKED: run_rows_bf16(j, xp, begin, end, m0, m1); break;
#endif
      case FMT_BF16: run_rows(j, begin, end, m0, m1, FMT_BF16); break;
      case FMT_F16: run_rows(j, begin, end, m0, m1, FMT_F16); break;
      default: run_rows(j, begin, end, m0, m1, FMT_F32); break;
    }
  }
}

// The OpenMP runtime is the one torch already loaded (same soname), so the kernel shares torch's
// worker threads instead of competing with them for the cores. w_fmt: FMT_F32 / FMT_BF16 / FMT_F16, or
// FMT_BF16_BLOCKED (AVX2 builds only: `skinny_linear_blocked_bf16` says whether this build has it).
void skinny_linear(const float *x, const void *w, const float *bias, float *y, int64_t m, int64_t n, int64_t k,
                   int w_fmt, int threads) {
  const Job j = {x, bias, w, y, m, n, k};
  float *xp = NULL;
#ifdef __AVX2__
  if (w_fmt == FMT_BF16_BLOCKED) {
    xp = (float *)malloc(sizeof(float) * (size_t)(m * k));
    if (!xp) return;  // the caller's y stays unset only on an allocation failure, which torch would hit first
    split_even_odd(x, xp, m, k);
  }
#endif
  const int64_t blocks = (n + 3) / 4;
  if (threads > blocks) threads = (int)blocks;
  if (threads < 1) threads = 1;
  // chunks of whole 4-row blocks (only the last has a tail), handed out as threads free up: a thread
  // slowed by a busy neighbour on its core takes fewer instead of the call waiting for its fixed share
  const int64_t chunk = blocks / (8 * threads) > 1 ? blocks / (8 * threads) : 1;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
  for (int64_t b0 = 0; b0 < blocks; b0 += chunk) {
    const int64_t b1 = b0 + chunk;
    run_part(&j, xp, b0 * 4, b1 * 4 < n ? b1 * 4 : n, w_fmt);
  }
  free(xp);
}

// whether this build reads FMT_BF16_BLOCKED weights
int skinny_linear_blocked_bf16(void) {
#ifdef __AVX2__
  return 1;
#else
  return 0;
#endif
}
