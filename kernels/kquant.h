// Super-block ("K") formats of llama.cpp for quant_linear.c: 256 weights per block in 8 sub-blocks of 32,
// each sub-block with a small integer scale under the block's float16 scale. In the kernel's layout
// (kernels/cpu_quant.py `from_gguf` repacks GGUF's blocks, same bytes, fields in this order):
//   Q4_K (144 B): d, dmin (f16); 12 bytes of 6-bit scales sc[8] and mins m[8] (GGUF's packing); 128 bytes of
//                 nibbles, 32 per sub-block pair p: byte l holds element l of sub-block 2p (low nibble) and of
//                 2p + 1 (high).                          w = d sc_s q - dmin m_s,  q in 0..15
//   Q5_K (176 B): as Q4_K, with 32 bytes of bit planes between scales and nibbles: u32 s, bit l = bit 4 of
//                 element l of sub-block s.               q in 0..31
//   Q6_K (210 B): d (f16); 16 int8 scales, one per 16 weights; 64 bytes of planes, two u32 per sub-block
//                 (bits 4 and 5); 128 bytes of nibbles as Q4_K.   w = d sc_(i/16) (q - 32),  q in 0..63
//
// Input rows are quantized to int16 per 256 (one scale per block, absmax / 32767) with exact int32 sums
// per 32 (for the mins). Within a block everything is integer: the sub-block scale multiplies the
// widened weights (q sc <= 1953 in magnitude, (q - 32) sc <= 4096, so int16), pairs of products add in
// int32 lanes (vpmaddwd / VNNI vpdpwssd), and the 8 sub-blocks accumulate in those lanes (at most
// 8 * 2 * 4096 * 32767 < 2^31); then one conversion and one float multiply-add with d * dx per block, and
// for Q4_K/Q5_K dmin * dx * sum_s m_s sum_x_s. The order of every sum is fixed per output, whatever the
// batch: a row's result never depends on what else is multiplied with it.
#pragma once
// (included by quant_linear.c after its block helpers: half, load_u32, bit_lanes, TILE_N, TILE_M, PREFETCH_BYTES)

#define QKK 256

// one weight row's block: where its fields are (in a whole tile, field by field for 4 rows; else plain)
typedef struct {
  const uint8_t *d, *dmin, *sc, *hi, *qs;
} KBlock;

// a block's fields in bytes, in layout order (d first), and the block size
static inline int64_t kblock_bytes(const int fmt) { return fmt == Q4_K ? 144 : fmt == Q5_K ? 176 : 210; }

static inline __attribute__((always_inline)) KBlock kblock_in(const uint8_t *w, int64_t k, int64_t n, const int whole,
                                                               int c, int64_t g, const int fmt) {
  const int64_t G = k / QKK, bb = kblock_bytes(fmt);
  const int T = whole ? TILE_N : 1, cc = whole ? c : 0;
  const uint8_t *t = whole ? w + (n * G + g * TILE_N) * bb : w + ((n + c) * G + g) * bb;
  KBlock b;
  if (fmt == Q6_K) {  // d 2, scales 16, planes 64, nibbles 128
    b.d = t + 2 * cc, b.dmin = 0, b.sc = t + 2 * T + 16 * cc, b.hi = t + 18 * T + 64 * cc, b.qs = t + 82 * T + 128 * cc;
  } else {  // d 2, dmin 2, scales 12, (Q5_K: planes 32), nibbles 128
    const int planes = fmt == Q5_K ? 32 : 0;
    b.d = t + 2 * cc, b.dmin = t + 2 * T + 2 * cc, b.sc = t + 4 * T + 12 * cc;
    b.hi = t + 16 * T + planes * cc, b.qs = t + (16 + planes) * T + 128 * cc;
  }
  return b;
}

// Q4_K/Q5_K: the 8 6-bit scales and mins from their 12 packed bytes (GGUF's get_scale_min_k4)
static inline void kscales(const uint8_t *q, int16_t *sc, int16_t *m) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = q[j] & 63;
    m[j] = q[j + 4] & 63;
    sc[j + 4] = (q[j + 8] & 0xF) | ((q[j] >> 6) << 4);
    m[j + 4] = (q[j + 8] >> 4) | ((q[j + 4] >> 6) << 4);
  }
}

// weight element i (0..255) of a block as its integer times its sub-block scale (what multiplies x)
static inline int kweight(const KBlock *b, const int16_t *sc, int i, const int fmt) {
  const int s = i / 32, l = i % 32, byte = b->qs[(s / 2) * 32 + l];
  int q = s % 2 ? byte >> 4 : byte & 0xF;
  if (fmt == Q6_K) {
    q |= ((load_u32(b->hi + 8 * s) >> l) & 1) << 4;
    q |= ((load_u32(b->hi + 8 * s + 4) >> l) & 1) << 5;
    return (q - 32) * (int8_t)b->sc[i / 16];
  }
  if (fmt == Q5_K) q |= ((load_u32(b->hi + 4 * s) >> l) & 1) << 4;
  return q * sc[s];
}

// Input rows quantized per 256: int16 values, one scale per block, exact int32 sums per 32
static void quantize_row_k(const float *x, int64_t k, int16_t *q, float *d, int32_t *isum) {
  for (int64_t g = 0; g < k / QKK; ++g) {
    const float *xb = x + g * QKK;
    float amax = 0.f;
    for (int i = 0; i < QKK; ++i) amax = fmaxf(amax, fabsf(xb[i]));
    const float id = amax > 0.f ? 32767.f / amax : 0.f;
    d[g] = amax / 32767.f;
    for (int s = 0; s < QKK / 32; ++s) {
      int32_t sum = 0;
      for (int i = 0; i < 32; ++i) {
        const int16_t v = (int16_t)nearbyintf(xb[s * 32 + i] * id);  // nearest, ties to even
        q[g * QKK + s * 32 + i] = v;
        sum += v;
      }
      isum[g * 8 + s] = sum;
    }
  }
}

typedef struct {
  const float *bias;
  const int16_t *xq;
  const float *xd;  // [m, K / 256]
  const int32_t *xs;  // [m, K / 32]
  const uint8_t *w;
  float *y;
  int64_t m, n, k;
} KJob;

// the float part of a block for one weight row and one input row: d dx (integer dot) - dmin dx sum_s m_s xs_s
static inline float kmin_term(const KBlock *b, const int16_t *mn, const int32_t *xs, const int fmt) {
  if (fmt == Q6_K) return 0.f;
  int32_t t = 0;
  for (int s = 0; s < 8; ++s) t += mn[s] * xs[s];
  return half(b->dmin) * (float)t;
}

// portable tile: weight rows [n, n + rows) against input rows [m, m + R) (rows past the last whole tile, and
// builds without AVX2)
static inline __attribute__((always_inline)) void ktile(const KJob *j, int64_t n, const int rows, const int whole,
                                                        int64_t m, const int R, const int fmt) {
  const int64_t G = j->k / QKK;
  float acc[TILE_M][TILE_N], mins[TILE_M][TILE_N];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < TILE_N; ++c) acc[r][c] = 0.f, mins[r][c] = 0.f;
  for (int64_t g = 0; g < G; ++g) {
    for (int c = 0; c < rows; ++c) {
      const KBlock b = kblock_in(j->w, j->k, n, whole, c, g, fmt);
      int16_t sc[8], mn[8];
      if (fmt != Q6_K) kscales(b.sc, sc, mn);
      const float dw = half(b.d);
      for (int r = 0; r < R; ++r) {
        const int16_t *xq = j->xq + (m + r) * j->k + g * QKK;
        int32_t dot = 0;
        for (int i = 0; i < QKK; ++i) dot += kweight(&b, sc, i, fmt) * xq[i];
        const float dx = j->xd[(m + r) * G + g];
        acc[r][c] = fmaf((float)dot, dw * dx, acc[r][c]);
        mins[r][c] = fmaf(kmin_term(&b, mn, j->xs + (m + r) * (j->k / 32) + g * 8, fmt), dx, mins[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < rows; ++c) j->y[(m + r) * j->n + n + c] = acc[r][c] - mins[r][c] + (j->bias ? j->bias[n + c] : 0.f);
}

#if defined(__AVX2__)
// 16 weights (half h of sub-block s) as integers times their scale, from one 16-byte half of a nibble pair
static inline __attribute__((always_inline)) __m256i khalf256(const KBlock *b, const int16_t *sc, int s, int h,
                                                              const int fmt) {
  const __m256i both = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(b->qs + (s / 2) * 32 + 16 * h)));
  __m256i w = s % 2 ? _mm256_srli_epi16(both, 4) : _mm256_and_si256(both, _mm256_set1_epi16(0xF));
  if (fmt == Q6_K) {
    const uint32_t b4 = load_u32(b->hi + 8 * s) >> (16 * h), b5 = load_u32(b->hi + 8 * s + 4) >> (16 * h);
    w = _mm256_add_epi16(w, _mm256_and_si256(bit_lanes(b4), _mm256_set1_epi16(16)));
    w = _mm256_add_epi16(w, _mm256_and_si256(bit_lanes(b5), _mm256_set1_epi16(32)));
    return _mm256_mullo_epi16(_mm256_sub_epi16(w, _mm256_set1_epi16(32)), _mm256_set1_epi16((int8_t)b->sc[2 * s + h]));
  }
  if (fmt == Q5_K)
    w = _mm256_add_epi16(w, _mm256_and_si256(bit_lanes(load_u32(b->hi + 4 * s) >> (16 * h)), _mm256_set1_epi16(16)));
  return _mm256_mullo_epi16(w, _mm256_set1_epi16(sc[s]));
}

// a whole tile (4 weight rows from n) against input row m (AVX2: the accumulators of one input row fill the
// registers)
static inline __attribute__((always_inline)) void ktile256(const KJob *j, int64_t n, int64_t m, const int fmt) {
  const int64_t G = j->k / QKK, bb = kblock_bytes(fmt);
  __m256 facc[TILE_N];
  float mins[TILE_N];
  for (int c = 0; c < TILE_N; ++c) facc[c] = _mm256_setzero_ps(), mins[c] = 0.f;
  const int16_t *x = j->xq + m * j->k;
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t *tb = j->w + (n * G + g * TILE_N) * bb;
    for (int64_t o = 0; o < TILE_N * bb; o += 64) __builtin_prefetch(tb + PREFETCH_BYTES + o);
    const float dx = j->xd[m * G + g];
    const int32_t *xs = j->xs + m * (j->k / 32) + g * 8;
    for (int c = 0; c < TILE_N; ++c) {
      const KBlock b = kblock_in(j->w, j->k, n, 1, c, g, fmt);
      int16_t sc[8], mn[8];
      if (fmt != Q6_K) kscales(b.sc, sc, mn);
      __m256i acc = _mm256_setzero_si256();
      for (int s = 0; s < 8; ++s)
        for (int h = 0; h < 2; ++h) {
          const __m256i xv = _mm256_loadu_si256((const __m256i *)(x + g * QKK + 32 * s + 16 * h));
          acc = _mm256_add_epi32(acc, _mm256_madd_epi16(khalf256(&b, sc, s, h, fmt), xv));
        }
      facc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), _mm256_set1_ps(half(b.d) * dx), facc[c]);
      mins[c] = fmaf(kmin_term(&b, mn, xs, fmt), dx, mins[c]);
    }
  }
  for (int c = 0; c < TILE_N; ++c) j->y[m * j->n + n + c] = hsum(facc[c]) - mins[c] + (j->bias ? j->bias[n + c] : 0.f);
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
static inline __m512i dot16x2(__m512i acc, __m512i w, __m512i x) {
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, w, x);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(w, x));
#endif
}

// a whole tile (4 weight rows from n) against input rows [m, m + R): per block, int32 lanes per (row, input row),
// then one conversion and multiply-add
static inline __attribute__((always_inline)) void ktile512(const KJob *j, int64_t n, int64_t m, const int R,
                                                           const int fmt) {
  const int64_t G = j->k / QKK, bb = kblock_bytes(fmt);
  __m512 facc[TILE_M_K][TILE_N];
  float mins[TILE_M_K][TILE_N];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < TILE_N; ++c) facc[r][c] = _mm512_setzero_ps(), mins[r][c] = 0.f;
  const __m512i low = _mm512_set1_epi16(0xF);
  const __m512i halves = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(1), 1);  // Q6_K scale index
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t *tb = j->w + (n * G + g * TILE_N) * bb;
    for (int64_t o = 0; o < TILE_N * bb; o += 64) __builtin_prefetch(tb + PREFETCH_BYTES + o);
    KBlock b[TILE_N];
    int16_t sc[TILE_N][8], mn[TILE_N][8];
    __m512i sc16[TILE_N];
    for (int c = 0; c < TILE_N; ++c) {
      b[c] = kblock_in(j->w, j->k, n, 1, c, g, fmt);
      if (fmt == Q6_K)
        sc16[c] = _mm512_cvtepi8_epi16(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)b[c].sc)));
      else
        kscales(b[c].sc, sc[c], mn[c]);
    }
    __m512i acc[TILE_M_K][TILE_N];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < TILE_N; ++c) acc[r][c] = _mm512_setzero_si512();
    for (int p = 0; p < 4; ++p) {  // sub-block pairs
      for (int c = 0; c < TILE_N; ++c) {
        const __m512i both = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(b[c].qs + 32 * p)));
        __m512i w0 = _mm512_and_si512(both, low), w1 = _mm512_srli_epi16(both, 4);
        if (fmt == Q6_K) {
          const __m512i k16 = _mm512_set1_epi16(16), k32 = _mm512_set1_epi16(32);
          const uint8_t *h = b[c].hi + 16 * p;
          w0 = _mm512_sub_epi16(w0, k32), w1 = _mm512_sub_epi16(w1, k32);
          w0 = _mm512_mask_add_epi16(w0, load_u32(h), w0, k16);
          w0 = _mm512_mask_add_epi16(w0, load_u32(h + 4), w0, k32);
          w1 = _mm512_mask_add_epi16(w1, load_u32(h + 8), w1, k16);
          w1 = _mm512_mask_add_epi16(w1, load_u32(h + 12), w1, k32);
          // lanes 0-15 take scale 4p (resp. 4p + 2), lanes 16-31 scale 4p + 1 (4p + 3)
          const __m512i i0 = _mm512_add_epi16(halves, _mm512_set1_epi16((short)(4 * p)));
          w0 = _mm512_mullo_epi16(w0, _mm512_permutexvar_epi16(i0, sc16[c]));
          w1 = _mm512_mullo_epi16(w1, _mm512_permutexvar_epi16(_mm512_add_epi16(i0, _mm512_set1_epi16(2)), sc16[c]));
        } else {
          if (fmt == Q5_K) {
            const __m512i k16 = _mm512_set1_epi16(16);
            w0 = _mm512_mask_add_epi16(w0, load_u32(b[c].hi + 8 * p), w0, k16);
            w1 = _mm512_mask_add_epi16(w1, load_u32(b[c].hi + 8 * p + 4), w1, k16);
          }
          w0 = _mm512_mullo_epi16(w0, _mm512_set1_epi16(sc[c][2 * p]));
          w1 = _mm512_mullo_epi16(w1, _mm512_set1_epi16(sc[c][2 * p + 1]));
        }
        for (int r = 0; r < R; ++r) {
          const int16_t *xq = j->xq + (m + r) * j->k + g * QKK + 64 * p;
          acc[r][c] = dot16x2(acc[r][c], w0, _mm512_loadu_si512((const void *)xq));
          acc[r][c] = dot16x2(acc[r][c], w1, _mm512_loadu_si512((const void *)(xq + 32)));
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const float dx = j->xd[(m + r) * G + g];
      const int32_t *xs = j->xs + (m + r) * (j->k / 32) + g * 8;
      for (int c = 0; c < TILE_N; ++c) {
        facc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][c]), _mm512_set1_ps(half(b[c].d) * dx), facc[r][c]);
        mins[r][c] = fmaf(kmin_term(&b[c], mn[c], xs, fmt), dx, mins[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < TILE_N; ++c)
      j->y[(m + r) * j->n + n + c] = _mm512_reduce_add_ps(facc[r][c]) - mins[r][c] + (j->bias ? j->bias[n + c] : 0.f);
}
#define KWHOLE_TILE(j, n, m, R, fmt) ktile512(j, n, m, R, fmt)
#elif defined(__AVX2__)
#define KWHOLE_TILE(j, n, m, R, fmt) \
  for (int r_ = 0; r_ < (R); ++r_) ktile256(j, n, (m) + r_, fmt)
#else
#define KWHOLE_TILE(j, n, m, R, fmt) ktile(j, n, TILE_N, 1, m, R, fmt)
#endif

static void krun_rows(const KJob *j, int64_t begin, int64_t end, const int fmt) {
  for (int64_t n = begin; n < end; n += TILE_N) {
    int64_t m = 0;
    if (n + TILE_N <= end) {
      for (; m + TILE_M_K <= j->m; m += TILE_M_K) KWHOLE_TILE(j, n, m, TILE_M_K, fmt);
      for (; m < j->m; ++m) KWHOLE_TILE(j, n, m, 1, fmt);
    } else {
      for (; m < j->m; ++m) ktile(j, n, (int)(end - n), 0, m, 1, fmt);
    }
  }
}

// out[i] = row ids[i] of the weight as floats (an embedding lookup), as cpu_quant.dequantize computes them
static void kquant_rows(const uint8_t *w, const int64_t *ids, int64_t count, int64_t n, int64_t k, const int fmt,
                        float *out) {
  const int64_t n4 = n / TILE_N * TILE_N;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t row = ids[i], tile0 = row < n4 ? row / TILE_N * TILE_N : row;
    for (int64_t g = 0; g < k / QKK; ++g) {
      const KBlock b = kblock_in(w, k, tile0, row < n4, (int)(row - tile0), g, fmt);
      int16_t sc[8], mn[8];
      const float d = half(b.d);
      float *o = out + i * k + g * QKK;
      if (fmt == Q6_K) {
        for (int e = 0; e < QKK; ++e) {
          const int s = e / 32, l = e % 32, byte = b.qs[(s / 2) * 32 + l];
          int q = s % 2 ? byte >> 4 : byte & 0xF;
          q |= ((load_u32(b.hi + 8 * s) >> l) & 1) << 4;
          q |= ((load_u32(b.hi + 8 * s + 4) >> l) & 1) << 5;
          o[e] = d * (float)(int8_t)b.sc[e / 16] * (float)(q - 32);
        }
        continue;
      }
      kscales(b.sc, sc, mn);
      const float dmin = half(b.dmin);
      for (int e = 0; e < QKK; ++e) {
        const int s = e / 32, l = e % 32, byte = b.qs[(s / 2) * 32 + l];
        int q = s % 2 ? byte >> 4 : byte & 0xF;
        if (fmt == Q5_K) q |= ((load_u32(b.hi + 4 * s) >> l) & 1) << 4;
        o[e] = d * (float)sc[s] * (float)q - dmin * (float)mn[s];
      }
    }
  }
}
