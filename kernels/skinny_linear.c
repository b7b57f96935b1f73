// y[M, N] = x[M, K] . w[N, K]^T (+ bias[N]) for the few-row matmuls of decoding, float32.
//
// With few rows the work is reading the weight once, so the kernel streams it row-block by
// row-block and keeps each block in L1 while every input row is multiplied against it (4 weight
// rows x 3 input rows of accumulators fill AVX2's 16 registers). Threads split the weight rows.
// Threads are persistent: creating one per call costs ~50 us, against ~100 us for the call itself.
#include <omp.h>
#include <stdint.h>
#include "simd.h"

typedef struct {
  const float *x, *w, *bias;
  float *y;
  int64_t m, n, k;
} Job;

static inline float dot(const float *a, const float *b, int64_t k) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < k; ++i) s += a[i] * b[i];
  return s;
}

static inline void store(const Job *j, int64_t m, int64_t n, float v) {
  j->y[m * j->n + n] = v + (j->bias ? j->bias[n] : 0.f);
}

// rows [begin, end) of the weight; begin is a multiple of 4
static void run_rows(const Job *j, int64_t begin, int64_t end) {
  const int64_t K = j->k, M = j->m;
  int64_t n = begin;
#ifdef __AVX2__
  const int64_t kv = K & ~(int64_t)7;
  for (; n + 4 <= end; n += 4) {
    const float *w0 = j->w + n * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
    int64_t m = 0;
    for (; m + 3 <= M; m += 3) {
      const float *x0 = j->x + m * K, *x1 = x0 + K, *x2 = x1 + K;
      __m256 a[3][4];
      for (int r = 0; r < 3; ++r)
        for (int c = 0; c < 4; ++c) a[r][c] = _mm256_setzero_ps();
      for (int64_t k = 0; k < kv; k += 8) {
        const __m256 v0 = _mm256_loadu_ps(x0 + k), v1 = _mm256_loadu_ps(x1 + k), v2 = _mm256_loadu_ps(x2 + k);
        const float *ws[4] = {w0 + k, w1 + k, w2 + k, w3 + k};
        for (int c = 0; c < 4; ++c) {
          const __m256 wv = _mm256_loadu_ps(ws[c]);
          a[0][c] = _mm256_fmadd_ps(wv, v0, a[0][c]);
          a[1][c] = _mm256_fmadd_ps(wv, v1, a[1][c]);
          a[2][c] = _mm256_fmadd_ps(wv, v2, a[2][c]);
        }
      }
      const float *xs[3] = {x0, x1, x2};
      const float *wr[4] = {w0, w1, w2, w3};
      for (int r = 0; r < 3; ++r)
        for (int c = 0; c < 4; ++c)
          store(j, m + r, n + c, hsum(a[r][c]) + dot(xs[r] + kv, wr[c] + kv, K - kv));
    }
    for (; m < M; ++m) {
      const float *x0 = j->x + m * K;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t k = 0; k < kv; k += 8) {
        const __m256 v = _mm256_loadu_ps(x0 + k);
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + k), v, a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w1 + k), v, a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w2 + k), v, a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w3 + k), v, a3);
      }
      const int64_t t = K - kv;
      store(j, m, n, hsum(a0) + dot(x0 + kv, w0 + kv, t));
      store(j, m, n + 1, hsum(a1) + dot(x0 + kv, w1 + kv, t));
      store(j, m, n + 2, hsum(a2) + dot(x0 + kv, w2 + kv, t));
      store(j, m, n + 3, hsum(a3) + dot(x0 + kv, w3 + kv, t));
    }
  }
#endif
  for (; n < end; ++n)
    for (int64_t m = 0; m < M; ++m) store(j, m, n, dot(j->x + m * K, j->w + n * K, K));
}

// The OpenMP runtime is the one torch already loaded (same soname), so the kernel shares torch's
// worker threads instead of competing with them for the cores.
void skinny_linear(const float *x, const float *w, const float *bias, float *y, int64_t m, int64_t n,
                   int64_t k, int threads) {
  const Job j = {x, w, bias, y, m, n, k};
  const int64_t blocks = (n + 3) / 4;
  if (threads > blocks) threads = (int)blocks;
  if (threads < 1) threads = 1;
#pragma omp parallel num_threads(threads)
  {
    const int parts = omp_get_num_threads(), part = omp_get_thread_num();
    // whole 4-row blocks per part, so only the last part has a tail
    const int64_t b0 = blocks * part / parts, b1 = blocks * (part + 1) / parts;
    run_rows(&j, b0 * 4, b1 * 4 < n ? b1 * 4 : n);
  }
}
