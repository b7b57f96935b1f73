// Loading 16-bit floats (bfloat16, float16) as float32, and rounding float32 back to bfloat16.
// Weights and KV are stored narrow to halve the bytes a decode step reads; the arithmetic stays
// float32, so a widened value is exact and results differ from float32 storage only by the
// storage rounding.
#pragma once
#include <stdint.h>
#include <string.h>

// storage formats a kernel argument can name (same numbering in the Python wrappers)
enum { FMT_F32 = 0, FMT_BF16 = 1, FMT_F16 = 2, FMT_BF16_BLOCKED = 3 };  // blocked: skinny_linear.c

static inline float bf16_to_f32(uint16_t h) {
  const uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

// float32 -> bfloat16, round to nearest even (as torch's .to(torch.bfloat16)); NaN stays NaN
static inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

// IEEE half to float, portable (subnormals, inf and NaN included)
static inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  uint32_t u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    u = sign | ((exp + 112u) << 23) | (man << 13);
  } else if (man == 0) {
    u = sign;
  } else {  // subnormal: normalise
    int e = -1;
    uint32_t m = man;
    do { m <<= 1; ++e; } while (!(m & 0x400u));
    u = sign | ((uint32_t)(112 - e) << 23) | ((m & 0x3ffu) << 13);
  }
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

// element i of a row stored in format `fmt`, as float32
static inline float load1(const void *row, int64_t i, const int fmt) {
  if (fmt == FMT_BF16) return bf16_to_f32(((const uint16_t *)row)[i]);
  if (fmt == FMT_F16) return f16_to_f32(((const uint16_t *)row)[i]);
  return ((const float *)row)[i];
}

// the address of element i of a row stored in format `fmt`
static inline const void *at(const void *row, int64_t i, const int fmt) {
  return fmt == FMT_F32 ? (const void *)((const float *)row + i) : (const void *)((const uint16_t *)row + i);
}

#ifdef __AVX2__
#include <immintrin.h>
// eight consecutive elements at p, as float32
static inline __attribute__((always_inline)) __m256 load8(const void *p, const int fmt) {
  if (fmt == FMT_BF16)
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
  if (fmt == FMT_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
  return _mm256_loadu_ps((const float *)p);
}
#endif

#ifdef __AVX512F__
// sixteen consecutive elements at p, as float32
static inline __attribute__((always_inline)) __m512 load16(const void *p, const int fmt) {
  if (fmt == FMT_BF16)
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
  if (fmt == FMT_F16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
  return _mm512_loadu_ps((const float *)p);
}
#endif
