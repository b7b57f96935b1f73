// Row operations shared by the fused element-wise kernels (fused_ops.c) and the quantized matmul's
// input prologues (quant_linear.c), so a fused and an unfused path compute the same bits.
#pragma once
#include <math.h>
#include <stdint.h>
#include "simd.h"

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

// 1 / rms(x) of a row of n: the scale rms_norm applies
static inline float rms_scale(const float *x, int64_t n, float eps) {
  return 1.f / sqrtf(sum_squares(x, n) / (float)n + eps);
}

// o[i] = silu(g[i]) * u[i]
static inline void silu_mul_row(const float *g, const float *u, float *o, int64_t n) {
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

// o[i] = gelu(g[i]) * u[i], gelu's tanh approximation (Gemma's GeGLU): 0.5 g (1 + tanh(c (g + 0.044715 g^3))),
// written as g / (1 + e^(-2 c (g + 0.044715 g^3))), which is the same function
static inline void gelu_tanh_mul_row(const float *g, const float *u, float *o, int64_t n) {
  const float c2 = 2.f * 0.7978845608028654f;
  int64_t i = 0;
#ifdef __AVX2__
  const __m256 one = _mm256_set1_ps(1.f), k = _mm256_set1_ps(0.044715f), nc2 = _mm256_set1_ps(-c2);
  for (; i + 8 <= n; i += 8) {
    const __m256 gv = _mm256_loadu_ps(g + i);
    const __m256 inner = _mm256_mul_ps(gv, _mm256_fmadd_ps(_mm256_mul_ps(k, gv), gv, one));
    const __m256 e = exp256(_mm256_mul_ps(nc2, inner));
    _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
  }
#endif
  for (; i < n; ++i) o[i] = g[i] / (1.f + expf(-c2 * g[i] * (1.f + 0.044715f * g[i] * g[i]))) * u[i];
}
