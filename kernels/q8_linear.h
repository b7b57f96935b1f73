// Integer dot products with int8 activations, llama.cpp's arithmetic: quant_linear's default path (`exact` = 0).
//
// Each input row is quantized once per call to int8 in blocks, alone (so a row's result never depends on its batch):
// of 32 for Q8_0, Q4_1 and Q5_0 (scale absmax / 127, as llama.cpp's Q8_0); for the K formats (Q4_K, Q5_K, Q6_K) in
// blocks of 256 with two levels of scale, as the weights have: a float D per block and a small integer u_s per 32 (at
// most U: 63, Q6_K 7), u_s = ceil(absmax_s / (127 D)) with D = absmax / (127 U), each value x / (D u_s) rounded to
// nearest even. A 32-value sub-block then has nearly its own scale (llama.cpp's Q8_K has one per 256, and the hidden
// state's outlier channels before Qwen's MLP left its other 255 values a few levels: a mean KL of 0.019 against
// float32 on the 1.5B, 0.0013 with the gate/up matmul exact), yet the block's sums stay integer. With each block go
// the exact integer sums of its values per 16 and per 32 (for the weights' minimums and offsets). A weight block's
// dot product with an input block is then exact in int32: pairs of u8 x s8 products summed into int16 lanes
// (`vpmaddubsw`: the weights' integers are the unsigned side, at most 63 x 127 x 2 < 2^15; Q8_0's signed weights go
// in as |w| against x signed by w), then widened by the sub-block scales (times the input's u_s) into int32 lanes (`vpmaddwd`). That is twice
// the products per instruction of the exact path's int16 activations, and a quarter of their input bytes.
//
// The price is the activations' rounding (relative error ~1/254 per value, the exact path's ~1/65534); its effect on
// the model's next-token distributions is measured against float32 by benchmarks/bench_models.py.
//
// One arithmetic per output, whatever computes it: per block, two exact integer sums (A0 over the elements e with
// e % 8 < 4, A1 over the others; Q6_K's offset of 32 and Q5_0's of 16 taken off A0), each converted and multiplied
// into a float partial with d_w d_x (fmaf: f_i += A_i d_w d_x); the K formats' minimums as two more exact sums (sub-
// blocks 0-3 and 4-7 of sum_s m_s sum(x_s)) taken off the partials with dmin_w d_x; Q4_1's minimum (a float) summed
// in a third partial, min_w d_x sum(x); then y = (f0 + f1) + fmin + bias. The scalar code (rows past the last whole
// tile, and builds without AVX2), the few-row AVX2 kernel (decode) and the many-row one (prefill, where the 4 weight
// rows of a tile are read 8 bytes each into one vector and every input row's 8 bytes are broadcast against them) all
// compute exactly that, so the result is the same bits on every path, every row count and every ISA level.
#pragma once
// (included by quant_linear.c after kquant.h: Block, block_in, KBlock, kblock_in, kscales64, half, load_u32, hsum,
// abs_max, prefetch_tile_block, block_bytes, head_bytes, prepare_row, chunk_of, TILE_N, PREFETCH_BYTES)

// Input rows as int8 blocks: values, a scale per block (of 256 or 32), exact sums per 16 and per 32
typedef struct {
  const int8_t *q;
  const float *d;
  const int16_t *s16, *s32;
  const uint8_t *u;  // K formats: u_s per 32 values
} X8;

typedef struct {
  const float *bias;
  X8 x;
  const uint8_t *w;
  float *y;
  int64_t m, n, k;
} Q8Job;

// the largest u_s of a K format's input blocks: the sums' products stay under 2^31 (Q6_K's scales are 8-bit, and its
// offset of 32 is taken off in the same int32)
static inline int q8_units(const int fmt) { return fmt == Q6_K ? 7 : 63; }

// xb[0..n) * inv rounded to nearest even into q (n a multiple of 32; |xb * inv| <= 127)
static inline void round_i8(const float *xb, int64_t n, float inv, int8_t *q) {
#ifdef __AVX2__
  const __m256 vid = _mm256_set1_ps(inv);
  for (int64_t i = 0; i < n; i += 32) {  // the default rounding mode, packed in element order
    const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + i), vid));
    const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + i + 8), vid));
    const __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + i + 16), vid));
    const __m256i e = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + i + 24), vid));
    const __m256i v = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, e));  // per 128-bit lane
    _mm256_storeu_si256((__m256i *)(q + i), _mm256_permutevar8x32_epi32(v, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  }
#else
  for (int64_t i = 0; i < n; ++i) q[i] = (int8_t)nearbyintf(xb[i] * inv);
#endif
}

// x [k] as int8 blocks for weights of `fmt`: q; d [k / 32] (K formats: [k / 256], and u [k / 32]); s16 [k / 16],
// s32 [k / 32]
static void quantize_row_q8(const float *x, int64_t k, const int fmt, int8_t *q, float *d, uint8_t *u, int16_t *s16,
                            int16_t *s32) {
  if (fmt < Q4_K) {
    for (int64_t g = 0; g < k / QK; ++g) {
      const float amax = abs_max(x + g * QK, QK);
      d[g] = amax / 127.f;
      round_i8(x + g * QK, QK, amax > 0.f ? 127.f / amax : 0.f, q + g * QK);
    }
  } else {
    const int units = q8_units(fmt);
    for (int64_t g = 0; g < k / QKK; ++g) {
      float amax[8], top = 0.f;
      for (int s = 0; s < 8; ++s) amax[s] = abs_max(x + g * QKK + 32 * s, 32), top = fmaxf(top, amax[s]);
      const float dd = top / (127.f * (float)units), level = 127.f * dd;
      d[g] = dd;
      for (int s = 0; s < 8; ++s) {
        const int us = top > 0.f ? (int)fminf(ceilf(amax[s] / level), (float)units) : 0;
        u[g * 8 + s] = (uint8_t)us;
        round_i8(x + g * QKK + 32 * s, 32, us ? 1.f / (dd * (float)us) : 0.f, q + g * QKK + 32 * s);
      }
    }
  }
  for (int64_t j = 0; j < k / 16; ++j) {
    int sum = 0;
    for (int i = 0; i < 16; ++i) sum += q[j * 16 + i];
    s16[j] = (int16_t)sum;
  }
  for (int64_t j = 0; j < k / 32; ++j) s32[j] = (int16_t)(s16[2 * j] + s16[2 * j + 1]);
}

// ---- the canonical arithmetic, portable: one weight row against one input row --------------------------------
// weight element i of a K block as its integer q (without its scale or offset)
static inline int kq(const KBlock *b, int i, const int fmt) {
  const int s = i / 32, l = i % 32, byte = b->qs[(s / 2) * 32 + l];
  int q = s % 2 ? byte >> 4 : byte & 0xF;
  if (fmt == Q6_K) {
    q |= q6_high(b, s, l) << 4;
  } else if (fmt == Q5_K) {
    q |= ((load_u32(b->hi + 4 * s) >> l) & 1) << 4;
  }
  return q;
}

// y[m][n + c] less the bias, for weight row n + c (whole: n starts a whole tile) against input row m
static float q8_dot_row(const Q8Job *j, int64_t n, const int whole, int c, int64_t m, const int fmt) {
  float f0 = 0.f, f1 = 0.f, fmin = 0.f;
  if (fmt >= Q4_K) {
    const int64_t G = j->k / QKK;
    for (int64_t g = 0; g < G; ++g) {
      const KBlock b = kblock_in(j->w, j->k, n, whole, c, g, fmt);
      const int8_t *xq = j->x.q + m * j->k + g * QKK;
      const uint8_t *u = j->x.u + m * (j->k / 32) + g * 8;
      int32_t a[2] = {0, 0}, mn[2] = {0, 0};
      if (fmt == Q6_K) {
        for (int i = 0; i < QKK; ++i) a[(i % 8) / 4] += kq(&b, i, fmt) * (int8_t)b.sc[i / 16] * u[i / 32] * xq[i];
        for (int i = 0; i < 16; ++i) a[0] -= 32 * (int8_t)b.sc[i] * u[i / 2] * j->x.s16[m * (j->k / 16) + g * 16 + i];
      } else {
        uint64_t sc, mv;
        kscales64(b.sc, &sc, &mv);
        for (int i = 0; i < QKK; ++i)
          a[(i % 8) / 4] += kq(&b, i, fmt) * (int)((sc >> (8 * (i / 32))) & 0xFF) * u[i / 32] * xq[i];
        for (int s = 0; s < 8; ++s)
          mn[s / 4] += (int)((mv >> (8 * s)) & 0xFF) * u[s] * j->x.s32[m * (j->k / 32) + g * 8 + s];
      }
      const float dx = j->x.d[m * G + g], dd = half(b.d) * dx;
      f0 = fmaf((float)a[0], dd, f0), f1 = fmaf((float)a[1], dd, f1);
      if (fmt != Q6_K) {
        const float dm = half(b.dmin) * dx;
        f0 = fmaf(-(float)mn[0], dm, f0), f1 = fmaf(-(float)mn[1], dm, f1);
      }
    }
    return (f0 + f1) + fmin;
  }
  const int64_t G = j->k / QK;
  for (int64_t g = 0; g < G; ++g) {
    const Block b = block_in(j->w, j->k, n, whole, c, g, fmt);
    const int8_t *xq = j->x.q + (m * G + g) * QK;
    const int32_t xs = j->x.s32[m * G + g];
    int32_t a[2] = {fmt == Q5_0 ? -16 * xs : 0, 0};
    for (int i = 0; i < QK; ++i) {
      int w = fmt == Q8_0 ? (int8_t)b.q[i] : (i < 16 ? b.q[i] & 0xF : b.q[i - 16] >> 4);
      if (fmt == Q5_0) w += (int)((load_u32(b.m) >> i) & 1) * 16;
      a[(i % 8) / 4] += w * xq[i];
    }
    const float dx = j->x.d[m * G + g], dd = half(b.d) * dx;
    f0 = fmaf((float)a[0], dd, f0), f1 = fmaf((float)a[1], dd, f1);
    if (fmt == Q4_1) fmin = fmaf(half(b.m) * dx, (float)xs, fmin);
  }
  return (f0 + f1) + fmin;
}

#if defined(__AVX2__)
// ---- AVX2 ---------------------------------------------------------------------------------------------------
// Both AVX2 kernels keep one 8-lane accumulator per input row for a whole tile: lane 2c holds weight row c's f0 (or
// A0), lane 2c + 1 its f1 (A1).

// byte i of `v` where bit i % 8 of byte index[i] of `bits` (in byte i's 128-bit half) is set, else 0
static inline __attribute__((always_inline)) __m256i select_bytes(__m256i bits, __m256i index, const __m256i v) {
  const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(bits, index), bit), bit), v);
}

// 32 bytes: byte i of `v` where bit i of `bits` is set, else 0
static inline __attribute__((always_inline)) __m256i bit_bytes(uint32_t bits, const __m256i v) {
  return select_bytes(_mm256_set1_epi32((int)bits), _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2,
                                                                     2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3), v);
}

// 8 int32 lanes (lane i: elements 4i..4i+3 of a weight row's block, as vpmaddwd leaves them) of the 4 rows as
// [A0 A1] of each row (lane 2c: the even lanes' sum, 2c + 1: the odd lanes')
static inline __attribute__((always_inline)) __m256i even_odd4(const __m256i *a) {
  const __m256i y01 = _mm256_hadd_epi32(_mm256_shuffle_epi32(a[0], 0xD8), _mm256_shuffle_epi32(a[1], 0xD8));
  const __m256i y23 = _mm256_hadd_epi32(_mm256_shuffle_epi32(a[2], 0xD8), _mm256_shuffle_epi32(a[3], 0xD8));
  return _mm256_add_epi32(_mm256_permute2x128_si256(y01, y23, 0x20), _mm256_permute2x128_si256(y01, y23, 0x31));
}

// the 4 rows' 16-bit values u64 (8 bytes each) as [row0 x 4 words, row1 x 4 | row2 x 4, row3 x 4] of byte `s` of each,
// zero-extended
static inline __attribute__((always_inline)) __m256i tile_words(__m256i bytes4, int s) {
  const char z = (char)0x80;
  return _mm256_shuffle_epi8(bytes4, _mm256_setr_epi8(s, z, s, z, s, z, s, z, 8 + s, z, 8 + s, z, 8 + s, z, 8 + s, z, s,
                                                      z, s, z, s, z, s, z, 8 + s, z, 8 + s, z, 8 + s, z, 8 + s, z));
}

// one input row's block epilogue: f += A d_w d_x, less M dmin_w d_x (mins: NULL for none)
static inline __attribute__((always_inline)) __m256 q8_fold(__m256 f, __m256i a, __m256 dd, const __m256i *mins,
                                                            __m256 dm) {
  f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a), dd, f);
  return mins ? _mm256_fnmadd_ps(_mm256_cvtepi32_ps(*mins), dm, f) : f;
}

// y of input row m from its accumulator (and Q4_1's minimum partials, lane 2c)
static inline __attribute__((always_inline)) void q8_store(const Q8Job *j, int64_t n, int64_t m, __m256 f,
                                                           const __m256 *fmin) {
  float v[8] __attribute__((aligned(32))), mn[8] __attribute__((aligned(32)));
  _mm256_store_ps(v, f);
  if (fmin) _mm256_store_ps(mn, *fmin);
  for (int c = 0; c < TILE_N; ++c)
    j->y[m * j->n + n + c] = (v[2 * c] + v[2 * c + 1]) + (fmin ? mn[2 * c] : 0.f) + (j->bias ? j->bias[n + c] : 0.f);
}

// A K-format tile block's per-row scales and minimums, as the kernels use them
typedef struct {
  __m256i sc[16];  // per scale index: [row0's x 4 words, row1's x 4 | row2's x 4, row3's x 4] (Q4_K/Q5_K: 8 used)
  __m256i w6[TILE_N];  // Q6_K: each row's 16 scales as words (for the offset)
  __m256i mn01, mn23;  // Q4_K/Q5_K: rows 0 and 1's 8 minimums as words, rows 2 and 3's
  __m256 d, dmin;      // [d of row c] in lanes 2c and 2c + 1
  uint64_t s[TILE_N];  // Q4_K/Q5_K: each row's 8 scales, a byte each
} KScales;

// the tile block's d, dmin, scales and minimums; with `vectors`, its scales as sc[] (what the many-row kernel takes)
static inline __attribute__((always_inline)) void kscales_tile(const KBlock *b, KScales *t, const int fmt,
                                                               const int vectors) {
  float d[TILE_N], dm[TILE_N];
  for (int c = 0; c < TILE_N; ++c) d[c] = half(b[c].d), dm[c] = fmt == Q6_K ? 0.f : half(b[c].dmin);
  t->d = _mm256_setr_ps(d[0], d[0], d[1], d[1], d[2], d[2], d[3], d[3]);
  t->dmin = _mm256_setr_ps(dm[0], dm[0], dm[1], dm[1], dm[2], dm[2], dm[3], dm[3]);
  if (fmt == Q6_K) {  // byte i of rows 0 and 2, then of rows 1 and 3, into the high byte of words: signed by a shift
    const __m256i a = _mm256_setr_m128i(_mm_loadu_si128((const __m128i *)b[0].sc), _mm_loadu_si128((const __m128i *)b[2].sc));
    const __m256i c = _mm256_setr_m128i(_mm_loadu_si128((const __m128i *)b[1].sc), _mm_loadu_si128((const __m128i *)b[3].sc));
    const char z = (char)0x80;
    for (int i = 0; i < 16 && vectors; ++i) {
      const __m256i lo = _mm256_setr_epi8(z, i, z, i, z, i, z, i, z, z, z, z, z, z, z, z, z, i, z, i, z, i, z, i, z, z,
                                          z, z, z, z, z, z);
      const __m256i hi = _mm256_setr_epi8(z, z, z, z, z, z, z, z, z, i, z, i, z, i, z, i, z, z, z, z, z, z, z, z, z, i,
                                          z, i, z, i, z, i);
      t->sc[i] = _mm256_srai_epi16(_mm256_or_si256(_mm256_shuffle_epi8(a, lo), _mm256_shuffle_epi8(c, hi)), 8);
    }
    for (int c2 = 0; c2 < TILE_N; ++c2) t->w6[c2] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)b[c2].sc));
    return;
  }
  uint64_t *s = t->s, m[TILE_N];
  for (int c = 0; c < TILE_N; ++c) kscales64(b[c].sc, s + c, m + c);
  const __m256i sq = _mm256_setr_epi64x((long long)s[0], (long long)s[1], (long long)s[2], (long long)s[3]);
  for (int i = 0; i < 8 && vectors; ++i) t->sc[i] = tile_words(sq, i);
  t->mn01 = _mm256_cvtepu8_epi16(_mm_set_epi64x((long long)m[1], (long long)m[0]));
  t->mn23 = _mm256_cvtepu8_epi16(_mm_set_epi64x((long long)m[3], (long long)m[2]));
}

// an input row's 8 u_s of a block as words, in both halves
static inline __attribute__((always_inline)) __m256i units8(const uint8_t *u) {
  return _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)u)));
}

// Q4_K/Q5_K: [M0 M1] of the 4 rows against one input row's sums per 32 times its u_s (M0: sub-blocks 0-3, M1: 4-7)
static inline __attribute__((always_inline)) __m256i kmins4(const KScales *t, const int16_t *s32, const uint8_t *u) {
  const __m256i x = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)s32)), uw = units8(u);
  const __m256i h = _mm256_hadd_epi32(_mm256_madd_epi16(_mm256_mullo_epi16(t->mn01, uw), x),  // m_s u_s < 2^12
                                      _mm256_madd_epi16(_mm256_mullo_epi16(t->mn23, uw), x));
  return _mm256_permute4x64_epi64(h, 0xD8);  // [r0 r2 | r1 r3] pairs -> rows in order
}

// Q6_K: [32 sum_j sc_j u_(j/2) s16_j, 0] of the 4 rows against one input row's sums per 16 (taken off A0)
static inline __attribute__((always_inline)) __m256i koffset4(const KScales *t, const int16_t *s16, const uint8_t *u) {
  const __m128i u8 = _mm_loadl_epi64((const __m128i *)u);  // each u_s for its two groups of 16
  const __m256i x = _mm256_mullo_epi16(_mm256_loadu_si256((const __m256i *)s16),
                                       _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(u8, u8)));
  __m256i p[TILE_N];
  for (int c = 0; c < TILE_N; ++c) p[c] = _mm256_madd_epi16(t->w6[c], x);
  const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));  // [r0..r3 | r0..r3]
  const __m256i tot = _mm256_add_epi32(h, _mm256_permute2x128_si256(h, h, 0x01));
  const __m256i spread = _mm256_permutevar8x32_epi32(tot, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  return _mm256_slli_epi32(_mm256_blend_epi32(spread, _mm256_setzero_si256(), 0xAA), 5);
}

// Q5_K: the high bits (bit 4) of the 32 weights of sub-block s, as 0x10 bytes
static inline __attribute__((always_inline)) __m256i khigh5(const KBlock *b, int s) {
  return bit_bytes(load_u32(b->hi + 4 * s), _mm256_set1_epi8(16));
}

// Q6_K: the high bits (4 and 5) of the 32 weights of sub-block s, as 0x10 / 0x20 bytes (a whole tile's block)
#if Q6K_PACKED
// packed bytes of sub-blocks 4h .. 4h + 3 (h = s / 4) with sub-block s's 2 bits moved to bits 4-5 and the rest masked off
static inline __attribute__((always_inline)) __m256i q6_high_bytes(__m256i packed, int s) {
  const int j = s % 4;  // a constant where the loops unroll
  const __m256i h = j == 0 ? _mm256_slli_epi16(packed, 4) : j == 1 ? _mm256_slli_epi16(packed, 2)
                    : j == 2 ? packed : _mm256_srli_epi16(packed, 2);
  return _mm256_and_si256(h, _mm256_set1_epi8(0x30));
}

static inline __attribute__((always_inline)) __m256i khigh6(const KBlock *b, int s) {
  return q6_high_bytes(_mm256_loadu_si256((const __m256i *)(b->hi + 32 * (s / 4))), s);
}
#else
static inline __attribute__((always_inline)) __m256i khigh6(const KBlock *b, int s) {  // both planes in one load
  int64_t planes;
  memcpy(&planes, b->hi + 8 * s, 8);
  const __m256i v = _mm256_set1_epi64x(planes);
  return _mm256_or_si256(select_bytes(v, _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2,
                                                          2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3), _mm256_set1_epi8(16)),
                         select_bytes(v, _mm256_setr_epi8(4, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5, 6, 6, 6, 6, 6,
                                                          6, 6, 6, 7, 7, 7, 7, 7, 7, 7, 7), _mm256_set1_epi8(32)));
}
#endif

// word `lo` of each 128-bit half in every word of the low half, word `hi` in every word of the high one
static inline __attribute__((always_inline)) __m256i word_of(__m256i v, int lo, int hi) {
  return _mm256_shuffle_epi8(v, _mm256_setr_m128i(_mm_set1_epi16((short)((2 * lo + 1) << 8 | 2 * lo)),
                                                  _mm_set1_epi16((short)((2 * hi + 1) << 8 | 2 * hi))));
}

// K formats, few input rows (R <= 2: decode): each weight row's sub-block pair at a time (64 weights, its 32 bytes of
// nibbles) against each input row's. A row's sub-block scales times the input's u_s are multiplied once per block (8
// or 16 words in one vpmullw), each then spread over a vector by one shuffle.
#define Q8_FEW 2
static inline __attribute__((always_inline)) void q8k_few(const Q8Job *j, int64_t n, int64_t m, const int R,
                                                          const int fmt) {
  const int64_t G = j->k / QKK, bb = kblock_bytes(fmt);
  __m256 f[Q8_FEW];
  for (int r = 0; r < R; ++r) f[r] = _mm256_setzero_ps();
  const __m256i m4 = _mm256_set1_epi8(0xF);
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t *tb = j->w + (n * G + g * TILE_N) * bb;
    for (int64_t o = 0; o < TILE_N * bb; o += 64) __builtin_prefetch(tb + PREFETCH_BYTES + o);
    KBlock b[TILE_N];
    for (int c = 0; c < TILE_N; ++c) b[c] = kblock_in(j->w, j->k, n, 1, c, g, fmt);
    KScales t;
    kscales_tile(b, &t, fmt, 0);
    __m256i acc[Q8_FEW][TILE_N];
    for (int c = 0; c < TILE_N; ++c) {
      // su[r][h]: row c's scales times input row r's u_s as words (Q4_K/Q5_K: the 8 per 32 in both halves of h = 0;
      // Q6_K: the 16 per 16, words 0-7 in both halves of h = 0, 8-15 of h = 1)
      __m256i su[Q8_FEW][2];
      for (int r = 0; r < R; ++r) {
        const __m128i u8 = _mm_loadl_epi64((const __m128i *)(j->x.u + (m + r) * (j->k / 32) + g * 8));
        if (fmt == Q6_K) {
          const __m256i prod = _mm256_mullo_epi16(t.w6[c], _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(u8, u8)));
          su[r][0] = _mm256_permute2x128_si256(prod, prod, 0x00), su[r][1] = _mm256_permute2x128_si256(prod, prod, 0x11);
        } else {
          su[r][0] = _mm256_broadcastsi128_si256(
              _mm_mullo_epi16(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)t.s[c])), _mm_cvtepu8_epi16(u8)));
        }
        acc[r][c] = _mm256_setzero_si256();
      }
      for (int p = 0; p < 4; ++p) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(b[c].qs + 32 * p));
        __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
        if (fmt == Q6_K)
          lo = _mm256_or_si256(lo, khigh6(&b[c], 2 * p)), hi = _mm256_or_si256(hi, khigh6(&b[c], 2 * p + 1));
        else if (fmt == Q5_K)
          lo = _mm256_or_si256(lo, khigh5(&b[c], 2 * p)), hi = _mm256_or_si256(hi, khigh5(&b[c], 2 * p + 1));
        for (int r = 0; r < R; ++r) {
          const int8_t *x = j->x.q + (m + r) * j->k + g * QKK + 64 * p;
          __m256i sl, sh;  // each 16-bit lane's scale (Q6_K: one per 16 weights, so the halves of a sub-block differ)
          if (fmt == Q6_K) {
            const __m256i src = su[r][p / 2];
            sl = word_of(src, 4 * (p % 2), 4 * (p % 2) + 1), sh = word_of(src, 4 * (p % 2) + 2, 4 * (p % 2) + 3);
          } else {
            sl = word_of(su[r][0], 2 * p, 2 * p), sh = word_of(su[r][0], 2 * p + 1, 2 * p + 1);
          }
          acc[r][c] = _mm256_add_epi32(
              acc[r][c],
              _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)x)), sl),
                               _mm256_madd_epi16(_mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(x + 32))), sh)));
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256 dx = _mm256_set1_ps(j->x.d[(m + r) * G + g]);
      __m256i a = even_odd4(acc[r]);
      if (fmt == Q6_K) {
        a = _mm256_sub_epi32(a, koffset4(&t, j->x.s16 + (m + r) * (j->k / 16) + g * 16, j->x.u + (m + r) * (j->k / 32) + g * 8));
        f[r] = q8_fold(f[r], a, _mm256_mul_ps(t.d, dx), NULL, dx);
      } else {
        const __m256i mn = kmins4(&t, j->x.s32 + (m + r) * (j->k / 32) + g * 8, j->x.u + (m + r) * (j->k / 32) + g * 8);
        f[r] = q8_fold(f[r], a, _mm256_mul_ps(t.d, dx), &mn, _mm256_mul_ps(t.dmin, dx));
      }
    }
  }
  for (int r = 0; r < R; ++r) q8_store(j, n, m + r, f[r], NULL);
}

// 8 bytes at p in every quarter: an input row's 8 values against the 4 weight rows' 8 bytes (one broadcast load)
static inline __attribute__((always_inline)) __m256i bcast8(const int8_t *p) {
  return _mm256_broadcastq_epi64(_mm_loadl_epi64((const __m128i *)p));
}

// 8 bytes of each of 4 rows, row c's in quarter c
static inline __attribute__((always_inline)) __m256i gather8(const uint8_t *p0, const uint8_t *p1, const uint8_t *p2,
                                                             const uint8_t *p3) {
  const __m128d a = _mm_loadh_pd(_mm_castsi128_pd(_mm_loadl_epi64((const __m128i *)p0)), (const double *)p1);
  const __m128d b = _mm_loadh_pd(_mm_castsi128_pd(_mm_loadl_epi64((const __m128i *)p2)), (const double *)p3);
  return _mm256_setr_m128i(_mm_castpd_si128(a), _mm_castpd_si128(b));
}

// the 4 rows' bit planes (u32 each, bit l: element l) in both halves, for planes_chunk
static inline __attribute__((always_inline)) __m256i planes4(const uint8_t *p0, const uint8_t *p1, const uint8_t *p2,
                                                             const uint8_t *p3) {
  return _mm256_broadcastsi128_si256(_mm_setr_epi32((int)load_u32(p0), (int)load_u32(p1), (int)load_u32(p2),
                                                    (int)load_u32(p3)));
}

// bytes of `v` for elements [8q, 8q + 8) of each row whose bit is set in its plane (planes4)
static inline __attribute__((always_inline)) __m256i planes_chunk(__m256i planes, int q, const __m256i v) {
  return select_bytes(planes, _mm256_setr_epi8(q, q, q, q, q, q, q, q, 4 + q, 4 + q, 4 + q, 4 + q, 4 + q, 4 + q, 4 + q,
                                               4 + q, 8 + q, 8 + q, 8 + q, 8 + q, 8 + q, 8 + q, 8 + q, 8 + q, 12 + q,
                                               12 + q, 12 + q, 12 + q, 12 + q, 12 + q, 12 + q, 12 + q), v);
}

// K formats, many input rows (R <= Q8_MANY): per sub-block pair p, the 4 rows' nibbles 8 bytes each into one vector per
// 8-byte chunk q (its low nibbles: elements [8q, 8q + 8) of sub-block 2p of each row; high: of 2p + 1), decoded once
// for the R input rows; each input row's 8 values of a chunk broadcast against them. A sub-block's products sum in
// int16 lanes over its chunks (Q4_K: 4 x 2 x 15 x 127, Q5_K: 4 x 2 x 31 x 127, Q6_K two at a time: 2 x 2 x 63 x 127,
// all under 2^15) before one vpmaddwd by its scales: every product lands in its output's canonical lane.
#define Q8_MANY 16  // input rows that share one decode of a weight tile's blocks
static inline __attribute__((always_inline)) void q8k_many(const Q8Job *j, int64_t n, int64_t m, const int R,
                                                           const int fmt) {
  const int64_t G = j->k / QKK, bb = kblock_bytes(fmt);
  __m256 f[Q8_MANY];
  for (int r = 0; r < R; ++r) f[r] = _mm256_setzero_ps();
  const __m256i m4 = _mm256_set1_epi8(0xF);
  const int pb = fmt == Q6_K ? 8 : 4;  // plane bytes per sub-block
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t *tb = j->w + (n * G + g * TILE_N) * bb;
    for (int64_t o = 0; o < TILE_N * bb; o += 64) __builtin_prefetch(tb + PREFETCH_BYTES + o);
    KBlock b[TILE_N];
    for (int c = 0; c < TILE_N; ++c) b[c] = kblock_in(j->w, j->k, n, 1, c, g, fmt);
    KScales t;
    kscales_tile(b, &t, fmt, 1);
    __m256i acc[Q8_MANY];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_si256();
    for (int p = 0; p < 4; ++p) {
      __m256i lo[4], hi[4];  // chunk q of sub-blocks 2p and 2p + 1, the 4 rows side by side
      __m256i p4l = _mm256_setzero_si256(), p4h = p4l, p5l = p4l, p5h = p4l;  // the high bits' planes
      const int planar = fmt == Q5_K || (fmt == Q6_K && !Q6K_PACKED);
      if (planar) {
        const int sl = 2 * p * pb, sh = (2 * p + 1) * pb;
        p4l = planes4(b[0].hi + sl, b[1].hi + sl, b[2].hi + sl, b[3].hi + sl);
        p4h = planes4(b[0].hi + sh, b[1].hi + sh, b[2].hi + sh, b[3].hi + sh);
        if (fmt == Q6_K) {
          p5l = planes4(b[0].hi + sl + 4, b[1].hi + sl + 4, b[2].hi + sl + 4, b[3].hi + sl + 4);
          p5h = planes4(b[0].hi + sh + 4, b[1].hi + sh + 4, b[2].hi + sh + 4, b[3].hi + sh + 4);
        }
      }
      for (int q = 0; q < 4; ++q) {
        const int o = 32 * p + 8 * q;
        const __m256i v = gather8(b[0].qs + o, b[1].qs + o, b[2].qs + o, b[3].qs + o);
        lo[q] = _mm256_and_si256(v, m4), hi[q] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
        if (planar) {
          lo[q] = _mm256_or_si256(lo[q], planes_chunk(p4l, q, _mm256_set1_epi8(16)));
          hi[q] = _mm256_or_si256(hi[q], planes_chunk(p4h, q, _mm256_set1_epi8(16)));
        }
        if (planar && fmt == Q6_K) {
          lo[q] = _mm256_or_si256(lo[q], planes_chunk(p5l, q, _mm256_set1_epi8(32)));
          hi[q] = _mm256_or_si256(hi[q], planes_chunk(p5h, q, _mm256_set1_epi8(32)));
        }
#if Q6K_PACKED
        if (fmt == Q6_K) {  // the 4 rows' packed high bits of elements [8q, 8q + 8) of sub-blocks 2p and 2p + 1
          const int h = 32 * (p / 2) + 8 * q;
          const __m256i hv = gather8(b[0].hi + h, b[1].hi + h, b[2].hi + h, b[3].hi + h);
          lo[q] = _mm256_or_si256(lo[q], q6_high_bytes(hv, 2 * p)), hi[q] = _mm256_or_si256(hi[q], q6_high_bytes(hv, 2 * p + 1));
        }
#endif
      }
      for (int r = 0; r < R; ++r) {
        const int8_t *x = j->x.q + (m + r) * j->k + g * QKK + 64 * p;
        const uint8_t *u = j->x.u + (m + r) * (j->k / 32) + g * 8 + 2 * p;
        const __m256i ul = _mm256_set1_epi16(u[0]), uh = _mm256_set1_epi16(u[1]);  // the pair's u_s
        __m256i pl[4], ph[4];
        for (int q = 0; q < 4; ++q)
          pl[q] = _mm256_maddubs_epi16(lo[q], bcast8(x + 8 * q)), ph[q] = _mm256_maddubs_epi16(hi[q], bcast8(x + 32 + 8 * q));
        __m256i s;
        if (fmt == Q6_K) {  // a scale per 16 weights: chunks 0-1, then 2-3
          s = _mm256_add_epi32(_mm256_madd_epi16(_mm256_add_epi16(pl[0], pl[1]), _mm256_mullo_epi16(t.sc[4 * p], ul)),
                               _mm256_madd_epi16(_mm256_add_epi16(pl[2], pl[3]), _mm256_mullo_epi16(t.sc[4 * p + 1], ul)));
          s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_add_epi16(ph[0], ph[1]), _mm256_mullo_epi16(t.sc[4 * p + 2], uh)));
          s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_add_epi16(ph[2], ph[3]), _mm256_mullo_epi16(t.sc[4 * p + 3], uh)));
        } else {
          s = _mm256_add_epi32(
              _mm256_madd_epi16(_mm256_add_epi16(_mm256_add_epi16(pl[0], pl[1]), _mm256_add_epi16(pl[2], pl[3])),
                                _mm256_mullo_epi16(t.sc[2 * p], ul)),
              _mm256_madd_epi16(_mm256_add_epi16(_mm256_add_epi16(ph[0], ph[1]), _mm256_add_epi16(ph[2], ph[3])),
                                _mm256_mullo_epi16(t.sc[2 * p + 1], uh)));
        }
        acc[r] = _mm256_add_epi32(acc[r], s);
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256 dx = _mm256_set1_ps(j->x.d[(m + r) * G + g]);
      if (fmt == Q6_K) {
        const __m256i a = _mm256_sub_epi32(acc[r], koffset4(&t, j->x.s16 + (m + r) * (j->k / 16) + g * 16, j->x.u + (m + r) * (j->k / 32) + g * 8));
        f[r] = q8_fold(f[r], a, _mm256_mul_ps(t.d, dx), NULL, dx);
      } else {
        const __m256i mn = kmins4(&t, j->x.s32 + (m + r) * (j->k / 32) + g * 8, j->x.u + (m + r) * (j->k / 32) + g * 8);
        f[r] = q8_fold(f[r], acc[r], _mm256_mul_ps(t.d, dx), &mn, _mm256_mul_ps(t.dmin, dx));
      }
    }
  }
  for (int r = 0; r < R; ++r) q8_store(j, n, m + r, f[r], NULL);
}

// Q8_0 / Q4_1 / Q5_0, a whole tile against R <= Q8_MANY input rows: per block and 8-byte chunk q, the 4 rows' bytes in
// one vector (Q8_0: elements [8q, 8q + 8); Q4_1/Q5_0: their low nibbles elements [8q, 8q + 8), high ones [16 + 8q,
// 24 + 8q)), each input row's matching values broadcast against them; per block the sums fold into the partials
static inline __attribute__((always_inline)) void q8_many(const Q8Job *j, int64_t n, int64_t m, const int R,
                                                          const int fmt) {
  const int64_t G = j->k / QK, qbytes = block_bytes(fmt) - head_bytes(fmt);
  __m256 f[Q8_MANY], fmin[Q8_MANY];
  for (int r = 0; r < R; ++r) f[r] = fmin[r] = _mm256_setzero_ps();
  const __m256i m4 = _mm256_set1_epi8(0xF), ones = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < G; ++g) {
    const Block b = block_in(j->w, j->k, n, 1, 0, g, fmt);
    prefetch_tile_block(b, fmt);
    const __m128 d4 = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)b.d));  // the 4 rows' scales
    const __m256 d = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(d4), _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
    __m256 mw = _mm256_setzero_ps();  // Q4_1: [min of row c, 0]
    if (fmt == Q4_1)
      mw = _mm256_blend_ps(_mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)b.m))),
                                                    _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3)),
                           _mm256_setzero_ps(), 0xAA);
    const uint8_t *q0 = b.q, *q1 = b.q + qbytes, *q2 = b.q + 2 * qbytes, *q3 = b.q + 3 * qbytes;
    __m256i acc[Q8_MANY];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_si256();
    if (fmt == Q8_0) {
      for (int q = 0; q < 4; ++q) {
        const __m256i v = gather8(q0 + 8 * q, q1 + 8 * q, q2 + 8 * q, q3 + 8 * q), av = _mm256_abs_epi8(v);
        for (int r = 0; r < R; ++r) {
          const __m256i x = bcast8(j->x.q + ((m + r) * G + g) * QK + 8 * q);
          acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(_mm256_maddubs_epi16(av, _mm256_sign_epi8(x, v)), ones));
        }
      }
    } else {
      // the block's 32 values a row as two chunks, low nibbles [8q, 8q + 8) and high ones [16 + 8q, 24 + 8q); their
      // products summed in int16 lanes (4 x 2 x 31 x 127 < 2^15) before one vpmaddwd
      const __m256i planes = fmt == Q5_0 ? planes4(b.m, b.m + 4, b.m + 8, b.m + 12) : _mm256_setzero_si256();
      __m256i lo[2], hi[2];
      for (int q = 0; q < 2; ++q) {
        const __m256i v = gather8(q0 + 8 * q, q1 + 8 * q, q2 + 8 * q, q3 + 8 * q);
        lo[q] = _mm256_and_si256(v, m4), hi[q] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
        if (fmt == Q5_0) {
          lo[q] = _mm256_or_si256(lo[q], planes_chunk(planes, q, _mm256_set1_epi8(16)));
          hi[q] = _mm256_or_si256(hi[q], planes_chunk(planes, 2 + q, _mm256_set1_epi8(16)));
        }
      }
      for (int r = 0; r < R; ++r) {
        const int8_t *x = j->x.q + ((m + r) * G + g) * QK;
        const __m256i s0 = _mm256_add_epi16(_mm256_maddubs_epi16(lo[0], bcast8(x)), _mm256_maddubs_epi16(hi[0], bcast8(x + 16)));
        const __m256i s1 = _mm256_add_epi16(_mm256_maddubs_epi16(lo[1], bcast8(x + 8)), _mm256_maddubs_epi16(hi[1], bcast8(x + 24)));
        acc[r] = _mm256_madd_epi16(_mm256_add_epi16(s0, s1), ones);
      }
    }
    for (int r = 0; r < R; ++r) {
      const int64_t xb = (m + r) * G + g;
      const __m256 dx = _mm256_set1_ps(j->x.d[xb]);
      __m256i a = acc[r];
      if (fmt == Q5_0)  // q - 16: less 16 times the input block's sum, from A0
        a = _mm256_sub_epi32(a, _mm256_blend_epi32(_mm256_set1_epi32(16 * j->x.s32[xb]), _mm256_setzero_si256(), 0xAA));
      f[r] = q8_fold(f[r], a, _mm256_mul_ps(d, dx), NULL, dx);
      if (fmt == Q4_1) fmin[r] = _mm256_fmadd_ps(_mm256_mul_ps(mw, dx), _mm256_set1_ps((float)j->x.s32[xb]), fmin[r]);
    }
  }
  for (int r = 0; r < R; ++r) q8_store(j, n, m + r, f[r], fmt == Q4_1 ? &fmin[r] : NULL);
}
#endif

#if defined(__AVX2__)
// a whole tile against input rows [m0, m1): groups of Q8_MANY, then of 8, then the rest in one pass (K formats: two
// rows or one by the few-row kernel); each row count a constant in its call, so its loops over rows unroll
#define Q8_GROUPS(MANY, FEW)                                  \
  int64_t m = m0;                                             \
  for (; m + Q8_MANY <= m1; m += Q8_MANY) MANY(j, n, m, Q8_MANY, fmt); \
  if (m + 8 <= m1) MANY(j, n, m, 8, fmt), m += 8;             \
  switch (m1 - m) {                                           \
    case 7: MANY(j, n, m, 7, fmt); break;                     \
    case 6: MANY(j, n, m, 6, fmt); break;                     \
    case 5: MANY(j, n, m, 5, fmt); break;                     \
    case 4: MANY(j, n, m, 4, fmt); break;                     \
    case 3: MANY(j, n, m, 3, fmt); break;                     \
    case 2: FEW(j, n, m, 2, fmt); break;                      \
    case 1: FEW(j, n, m, 1, fmt); break;                      \
    default: break;                                           \
  }
static inline __attribute__((always_inline)) void q8k_rows(const Q8Job *j, int64_t n, int64_t m0, int64_t m1,
                                                           const int fmt) {
  Q8_GROUPS(q8k_many, q8k_few)
}
static inline __attribute__((always_inline)) void q8_rows(const Q8Job *j, int64_t n, int64_t m0, int64_t m1,
                                                          const int fmt) {
  Q8_GROUPS(q8_many, q8_many)
}
#undef Q8_GROUPS
#endif

// weight rows [begin, end) against input rows [m0, m1)
static inline __attribute__((always_inline)) void q8_run_rows(const Q8Job *j, int64_t begin, int64_t end, int64_t m0,
                                                              int64_t m1, const int fmt) {
  for (int64_t n = begin; n < end; n += TILE_N) {
    if (n + TILE_N > end) {  // rows past the last whole tile: plain blocks, one dot at a time
      for (int64_t m = m0; m < m1; ++m)
        for (int c = 0; c < end - n; ++c)
          j->y[m * j->n + n + c] = q8_dot_row(j, n, 0, c, m, fmt) + (j->bias ? j->bias[n + c] : 0.f);
      continue;
    }
#if defined(__AVX2__)
    if (fmt >= Q4_K)
      q8k_rows(j, n, m0, m1, fmt);
    else
      q8_rows(j, n, m0, m1, fmt);
#else
    for (int64_t m = m0; m < m1; ++m)
      for (int c = 0; c < TILE_N; ++c)
        j->y[m * j->n + n + c] = q8_dot_row(j, n, 1, c, m, fmt) + (j->bias ? j->bias[n + c] : 0.f);
#endif
  }
}

// bytes of int8 input rows one pass over the weights takes (they stay in L2 while every tile of a thread passes them)
#define Q8_BLOCK_BYTES (192 * 1024)
// input rows from which their quantization is shared among the threads
#define Q8_PARALLEL_ROWS 16

// quant_linear with int8 activations (its arguments, less `invariant`: this path is batch-invariant always)
static void q8_linear(float *x, const void *w, const float *bias, float *y, int64_t m, int64_t n, int64_t k, int fmt,
                      int prologue, const float *norm_w, float eps, const float *residual, int threads) {
  const int64_t blk = fmt >= Q4_K ? QKK : QK, tiles = (n + TILE_N - 1) / TILE_N;
  int8_t *q = (int8_t *)malloc((size_t)(m * k + m * (k / blk) * (int64_t)sizeof(float) + m * (k / 16 + k / 32) * 2 +
                                        m * (k / 32)));
  if (!q) return;
  float *d = (float *)(q + m * k);
  int16_t *s16 = (int16_t *)(d + m * (k / blk)), *s32 = s16 + m * (k / 16);
  uint8_t *u = (uint8_t *)(s32 + m * (k / 32));
  const Q8Job j = {bias, {q, d, s16, s32, u}, (const uint8_t *)w, y, m, n, k};
  const int64_t chunk = chunk_of(tiles, &threads);
  int64_t block = Q8_BLOCK_BYTES / k / Q8_MANY * Q8_MANY;
  block = block < Q8_MANY ? Q8_MANY : block;
#pragma omp parallel num_threads(m >= Q8_PARALLEL_ROWS ? threads : 1)
  {
    float *row = (float *)malloc((size_t)(k * (int64_t)sizeof(float)));  // one transformed input row
#pragma omp for schedule(static)
    for (int64_t r = 0; r < m; ++r)
      quantize_row_q8(prepare_row(x, r, k, prologue, norm_w, eps, residual, row), k, fmt, q + r * k,
                      d + r * (k / blk), u + r * (k / 32), s16 + r * (k / 16), s32 + r * (k / 32));
    free(row);
  }
#pragma omp parallel num_threads(threads)
  for (int64_t m0 = 0; m0 < m; m0 += block) {
    const int64_t m1 = m0 + block < m ? m0 + block : m;
#pragma omp for schedule(dynamic, 1)
    for (int64_t c0 = 0; c0 < tiles; c0 += chunk) {
      const int64_t begin = c0 * TILE_N, stop = (c0 + chunk) * TILE_N < n ? (c0 + chunk) * TILE_N : n;
      switch (fmt) {  // the format a constant in each copy
        case Q8_0: q8_run_rows(&j, begin, stop, m0, m1, Q8_0); break;
        case Q4_1: q8_run_rows(&j, begin, stop, m0, m1, Q4_1); break;
        case Q5_0: q8_run_rows(&j, begin, stop, m0, m1, Q5_0); break;
        case Q4_K: q8_run_rows(&j, begin, stop, m0, m1, Q4_K); break;
        case Q5_K: q8_run_rows(&j, begin, stop, m0, m1, Q5_K); break;
        default: q8_run_rows(&j, begin, stop, m0, m1, Q6_K); break;
      }
    }
  }
  free(q);
}
