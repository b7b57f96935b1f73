// The small element-wise steps between a decoder layer's matmuls, fused (float32, row-major).
// In torch each is several ops (rms_norm alone is pow, mean, add, rsqrt, mul, mul), each a pass
// over memory plus dispatch; at decode sizes that glue cost about as much as attention.
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include "row_ops.h"
#include "simd.h"
#include "simd_cvt.h"

// rows per thread below which a second thread costs more than it saves
#define MIN_ELEMS_PER_THREAD 32768

static inline int pick_threads(int64_t elems, int threads) {
  return elems >= 2 * MIN_ELEMS_PER_THREAD && threads > 1 ? threads : 1;
}

// out[r] = x[r] / rms(x[r]) * w
void rms_norm(const float *x, const float *w, float *out, int64_t rows, int64_t cols, float eps, int threads) {
#pragma omp parallel for num_threads(pick_threads(rows * cols, threads))
  for (int64_t r = 0; r < rows; ++r) {
    const float *xr = x + r * cols;
    scale_row(xr, w, rms_scale(xr, cols, eps), out + r * cols, cols);
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
    scale_row(xr, w, rms_scale(xr, cols, eps), out + r * cols, cols);
  }
}

// x[r, off + h d : off + (h + 1) d] = rms_norm(that) * w, in place, for heads h < heads of each row r (rows `stride`
// floats apart): the per-head q/k norms of Qwen3 and Gemma 3, on their columns of a layer's qkv
void head_rms_norm(float *x, int64_t rows, int64_t stride, int64_t heads, int64_t d, const float *w, float eps,
                   int threads) {
#pragma omp parallel for num_threads(pick_threads(rows * heads * d, threads))
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < heads; ++h) {
      float *xh = x + r * stride + h * d;
      scale_row(xh, w, rms_scale(xh, d, eps), xh, d);
    }
}

// gu [rows, 2 n] holds gate | up; out [rows, n] = silu(gate) * up
void silu_mul(const float *gu, float *out, int64_t rows, int64_t n, int threads) {
#pragma omp parallel for num_threads(pick_threads(rows * n, threads))
  for (int64_t r = 0; r < rows; ++r) silu_mul_row(gu + r * 2 * n, gu + r * 2 * n + n, out + r * n, n);
}

// gu [rows, 2 n] holds gate | up; out [rows, n] = gelu_tanh(gate) * up
void gelu_mul(const float *gu, float *out, int64_t rows, int64_t n, int threads) {
#pragma omp parallel for num_threads(pick_threads(rows * n, threads))
  for (int64_t r = 0; r < rows; ++r) gelu_tanh_mul_row(gu + r * 2 * n, gu + r * 2 * n + n, out + r * n, n);
}

// x rotated by rotate-half RoPE: out[i] = x[i] cos[i] - x[i + D/2] sin[i], out[i + D/2] = x[i + D/2] cos[i + D/2]
// + x[i] sin[i + D/2] (HF's layout)
static inline void rope_row(const float *x, const float *c, const float *s, float *out, int64_t d) {
  const int64_t h = d / 2;
  for (int64_t i = 0; i < h; ++i) out[i] = x[i] * c[i] - x[i + h] * s[i];
  for (int64_t i = h; i < d; ++i) out[i] = x[i] * c[i] + x[i - h] * s[i];
}

static inline void store_row(const float *src, void *dst, int64_t d, int fmt) {
  if (fmt == FMT_BF16) {
    uint16_t *o = (uint16_t *)dst;
    for (int64_t i = 0; i < d; ++i) o[i] = f32_to_bf16(src[i]);
  } else {
    memcpy(dst, src, sizeof(float) * (size_t)d);
  }
}

// One pass over a layer's fresh qkv [T, (hq + 2 hkv) d] (q heads, k heads, v heads per row): q rotated
// into q_out [T, hq, d]; k rotated and v as is, stored in the pools (format kv_fmt: FMT_F32 or
// FMT_BF16, rounded to nearest even) at slot slots[t] of each head (k_row / v_row elements between
// slots, k_head / v_head between heads). cos, sin [T, d]. Replaces about a dozen torch ops per layer.
void rope_store(const float *qkv, const float *cos, const float *sin, float *q_out, void *k_pool, void *v_pool,
                const int64_t *slots, int64_t tokens, int64_t hq, int64_t hkv, int64_t d, int64_t k_row,
                int64_t k_head, int64_t v_row, int64_t v_head, int kv_fmt, int threads) {
  const int64_t width = (hq + 2 * hkv) * d, esize = kv_fmt == FMT_BF16 ? 2 : 4;
#pragma omp parallel for num_threads(pick_threads(tokens * width, threads))
  for (int64_t t = 0; t < tokens; ++t) {
    const float *row = qkv + t * width, *c = cos + t * d, *s = sin + t * d;
    float rotated[1024];  // head size <= 1024, checked by the caller
    for (int64_t h = 0; h < hq; ++h) rope_row(row + h * d, c, s, q_out + (t * hq + h) * d, d);
    for (int64_t h = 0; h < hkv; ++h) {
      rope_row(row + (hq + h) * d, c, s, rotated, d);
      store_row(rotated, (char *)k_pool + (h * k_head + slots[t] * k_row) * esize, d, kv_fmt);
      store_row(row + (hq + hkv + h) * d, (char *)v_pool + (h * v_head + slots[t] * v_row) * esize, d, kv_fmt);
    }
  }
}
