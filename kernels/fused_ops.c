// The small element-wise steps between a decoder layer's matmuls, fused (float32, row-major).
// In torch each is several ops (rms_norm alone is pow, mean, add, rsqrt, mul, mul), each a pass
// over memory plus dispatch; at decode sizes that glue cost about as much as attention.
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include "simd.h"

// rows per thread below which a second thread costs more than it saves
#define MIN_ELEMS_PER_THREAD 32768

static inline int pick_threads(int64_t elems, int threads) {
  return elems >= 2 * MIN_ELEMS_PER_THREAD && threads > 1 ? threads : 1;
}

static inline float sum_squares(const float *x, int64_t n) {
  int64_t i = 0;
  float s = 0.f;
#ifdef __AVX2__
  __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    const __m256 u = _mm256_loadu_ps(x + i), v = _mm256_loadu_ps(x + i + 8);
    a = _mm256_fmadd_ps(u, u, a);
    b = _mm256_fmadd_ps(v, v, b);
  }
  s = hsum(_mm256_add_ps(a, b));
#endif
  for (; i < n; ++i) s += x[i] * x[i];
  return s;
}

static inline void scale_row(const float *x, const float *w, float r, float *out, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * r * w[i];
}

// out[r] = x[r] / rms(x[r]) * w
void rms_norm(const float *x, const float *w, float *out, int64_t rows, int64_t cols, float eps, int threads) {
#pragma omp parallel for num_threads(pick_threads(rows * cols, threads))
  for (int64_t r = 0; r < rows; ++r) {
    const float *xr = x + r * cols;
    scale_row(xr, w, 1.f / sqrtf(sum_squares(xr, cols) / (float)cols + eps), out + r * cols, cols);
  }
}

// x[r] += y[r] (the residual stream, in place); out[r] = rms_norm(x[r]) * w
void add_rms_norm(float *x, const float *y, const float *w, float *out, int64_t rows, int64_t cols, float eps,
                  int threads) {
#pragma omp parallel for num_threads(pick_threads(rows * cols, threads))
  for (int64_t r = 0; r < rows; ++r) {
    float *xr = x + r * cols;
    const float *yr = y + r * cols;
#pragma omp simd
    for (int64_t i = 0; i < cols; ++i) xr[i] += yr[i];
    scale_row(xr, w, 1.f / sqrtf(sum_squares(xr, cols) / (float)cols + eps), out + r * cols, cols);
  }
}

// gu [rows, 2 n] holds gate | up; out [rows, n] = silu(gate) * up
void silu_mul(const float *gu, float *out, int64_t rows, int64_t n, int threads) {
#pragma omp parallel for num_threads(pick_threads(rows * n, threads))
  for (int64_t r = 0; r < rows; ++r) {
    const float *g = gu + r * 2 * n, *u = g + n;
    float *o = out + r * n;
    int64_t i = 0;
#ifdef __AVX2__
    const __m256 one = _mm256_set1_ps(1.f);
    for (; i + 8 <= n; i += 8) {
      const __m256 gv = _mm256_loadu_ps(g + i);
      const __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), gv));
      _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
    }
#endif
    for (; i < n; ++i) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
  }
}
