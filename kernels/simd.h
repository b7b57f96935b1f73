// Small SIMD helpers shared by the CPU kernels (each kernel includes this header).
#pragma once
#ifdef __AVX2__
#include <immintrin.h>

// the sum of a vector's eight lanes
static inline float hsum(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_shuffle_ps(x, x, 1));
  return _mm_cvtss_f32(x);
}
#endif
