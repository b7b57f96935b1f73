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

// one weight row's block: where its fields are (in a whole tile, field by field for 4 rows; else plain); `packed`:
// Q6_K's high bits as Q6K_PACKED tiles hold them (q6_high), not as two bit planes
typedef struct {
  const uint8_t *d, *dmin, *sc, *hi, *qs;
  int packed;
} KBlock;

// a block's fields in bytes, in layout order (d first), and the block size
static inline int64_t kblock_bytes(const int fmt) { return fmt == Q4_K ? 144 : fmt == Q5_K ? 176 : 210; }

static inline __attribute__((always_inline)) KBlock kblock_in(const uint8_t *w, int64_t k, int64_t n, const int whole,
                                                               int c, int64_t g, const int fmt) {
  const int64_t G = k / QKK, bb = kblock_bytes(fmt);
  const int T = whole ? TILE_N : 1, cc = whole ? c : 0;
  const uint8_t *t = whole ? w + (n * G + g * TILE_N) * bb : w + ((n + c) * G + g) * bb;
  KBlock b;
  b.packed = Q6K_PACKED && whole && fmt == Q6_K;
  if (fmt == Q6_K) {  // d 2, scales 16, planes (or packed high bits) 64, nibbles 128
    b.d = t + 2 * cc, b.dmin = 0, b.sc = t + 2 * T + 16 * cc, b.hi = t + 18 * T + 64 * cc, b.qs = t + 82 * T + 128 * cc;
  } else {  // d 2, dmin 2, scales 12, (Q5_K: planes 32), nibbles 128
    const int planes = fmt == Q5_K ? 32 : 0;
    b.d = t + 2 * cc, b.dmin = t + 2 * T + 2 * cc, b.sc = t + 4 * T + 12 * cc;
    b.hi = t + 16 * T + planes * cc, b.qs = t + (16 + planes) * T + 128 * cc;
  }
  return b;
}

// Q4_K/Q5_K: the 8 6-bit scales and mins from their 12 packed bytes (GGUF's get_scale_min_k4), one byte each,
// scale s in byte s of *sc: four 32-bit operations per half instead of a loop over bytes
static inline void kscales64(const uint8_t *q, uint64_t *sc, uint64_t *m) {
  const uint32_t u0 = load_u32(q), u1 = load_u32(q + 4), u2 = load_u32(q + 8);
  const uint32_t sc_hi = (u2 & 0x0f0f0f0fu) | (((u0 >> 6) & 0x03030303u) << 4);
  const uint32_t m_hi = ((u2 >> 4) & 0x0f0f0f0fu) | (((u1 >> 6) & 0x03030303u) << 4);
  *sc = (uint64_t)(u0 & 0x3f3f3f3fu) | ((uint64_t)sc_hi << 32);
  *m = (uint64_t)(u1 & 0x3f3f3f3fu) | ((uint64_t)m_hi << 32);
}

static inline void kscales(const uint8_t *q, int16_t *sc, int16_t *m) {
  uint64_t s, n;
  kscales64(q, &s, &n);
  for (int j = 0; j < 8; ++j) sc[j] = (int16_t)((s >> (8 * j)) & 0xFF), m[j] = (int16_t)((n >> (8 * j)) & 0xFF);
}

// Q6_K: the two high bits of element l of sub-block s (bits 4 and 5 of its integer, as 0..3): from the two bit planes
// of a plain block, or from a packed tile's byte 32 (s / 4) + l, bits 2 (s % 4) and up
static inline int q6_high(const KBlock *b, int s, int l) {
  if (b->packed) return (b->hi[32 * (s / 4) + l] >> (2 * (s % 4))) & 3;
  return (int)(((load_u32(b->hi + 8 * s) >> l) & 1) | (((load_u32(b->hi + 8 * s + 4) >> l) & 1) << 1));
}

// weight element i (0..255) of a block as its integer times its sub-block scale (what multiplies x)
static inline int kweight(const KBlock *b, const int16_t *sc, int i, const int fmt) {
  const int s = i / 32, l = i % 32, byte = b->qs[(s / 2) * 32 + l];
  int q = s % 2 ? byte >> 4 : byte & 0xF;
  if (fmt == Q6_K) {
    q |= q6_high(b, s, l) << 4;
    return (q - 32) * (int8_t)b->sc[i / 16];
  }
  if (fmt == Q5_K) q |= ((load_u32(b->hi + 4 * s) >> l) & 1) << 4;
  return q * sc[s];
}

// Input rows quantized per 256: int16 values, one scale per block, exact int32 sums per 32
static void quantize_row_k(const float *x, int64_t k, int16_t *q, float *d, int32_t *isum) {
  for (int64_t g = 0; g < k / QKK; ++g) {
    const float *xb = x + g * QKK;
    const float amax = abs_max(xb, QKK), id = amax > 0.f ? 32767.f / amax : 0.f;
    d[g] = amax / 32767.f;
    round_i16(xb, QKK, id, q + g * QKK);
    for (int s = 0; s < QKK / 32; ++s) {
      int32_t sum = 0;
      for (int i = 0; i < 32; ++i) sum += q[g * QKK + s * 32 + i];
      isum[g * 8 + s] = sum;
    }
  }
}

static void kquant_rows(const uint8_t *w, const int64_t *ids, int64_t count, int64_t n, int64_t k, const int fmt,
                        float *out);

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
#if Q6K_PACKED  // whole tiles only (the scalar code takes the rest)
    const __m256i hb = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(b->hi + 32 * (s / 4) + 16 * h)));
    w = _mm256_or_si256(w, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * (s % 4)), _mm256_set1_epi16(3)), 4));
#else
    const uint32_t b4 = load_u32(b->hi + 8 * s) >> (16 * h), b5 = load_u32(b->hi + 8 * s + 4) >> (16 * h);
    w = _mm256_add_epi16(w, _mm256_and_si256(bit_lanes(b4), _mm256_set1_epi16(16)));
    w = _mm256_add_epi16(w, _mm256_and_si256(bit_lanes(b5), _mm256_set1_epi16(32)));
#endif
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

// a whole tile's block g: the 4 rows' fields and sub-block scales
typedef struct {
  KBlock b[TILE_N];
  uint64_t sc[TILE_N], mn[TILE_N];  // Q4_K/Q5_K: 8 scales and 8 mins, a byte each
  __m512i sc16[TILE_N];  // Q6_K: the 16 scales as words
} KTileBlock;

static inline __attribute__((always_inline)) void kprep512(const KJob *j, int64_t n, int64_t g, KTileBlock *t,
                                                           const int fmt) {
  for (int c = 0; c < TILE_N; ++c) {
    t->b[c] = kblock_in(j->w, j->k, n, 1, c, g, fmt);
    if (fmt == Q6_K)
      t->sc16[c] = _mm512_cvtepi8_epi16(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)t->b[c].sc)));
    else
      kscales64(t->b[c].sc, &t->sc[c], &t->mn[c]);
  }
}

// row c's sub-blocks 2p and 2p + 1 as 32 int16 weights each, times their scales
static inline __attribute__((always_inline)) void kpair512(const KTileBlock *t, int c, int p, __m512i *w0,
                                                           __m512i *w1, const int fmt) {
  const __m512i both = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(t->b[c].qs + 32 * p)));
  __m512i a = _mm512_and_si512(both, _mm512_set1_epi16(0xF)), b = _mm512_srli_epi16(both, 4);
  if (fmt == Q6_K) {
    const __m512i k16 = _mm512_set1_epi16(16), k32 = _mm512_set1_epi16(32);
    const uint8_t *h = t->b[c].hi + 16 * p;
    a = _mm512_sub_epi16(a, k32), b = _mm512_sub_epi16(b, k32);
    a = _mm512_mask_add_epi16(a, load_u32(h), a, k16);
    a = _mm512_mask_add_epi16(a, load_u32(h + 4), a, k32);
    b = _mm512_mask_add_epi16(b, load_u32(h + 8), b, k16);
    b = _mm512_mask_add_epi16(b, load_u32(h + 12), b, k32);
    // lanes 0-15 take scale 4p (resp. 4p + 2), lanes 16-31 scale 4p + 1 (4p + 3)
    const __m512i halves = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(1), 1);
    const __m512i i0 = _mm512_add_epi16(halves, _mm512_set1_epi16((short)(4 * p)));
    *w0 = _mm512_mullo_epi16(a, _mm512_permutexvar_epi16(i0, t->sc16[c]));
    *w1 = _mm512_mullo_epi16(b, _mm512_permutexvar_epi16(_mm512_add_epi16(i0, _mm512_set1_epi16(2)), t->sc16[c]));
    return;
  }
  if (fmt == Q5_K) {
    const __m512i k16 = _mm512_set1_epi16(16);
    a = _mm512_mask_add_epi16(a, load_u32(t->b[c].hi + 8 * p), a, k16);
    b = _mm512_mask_add_epi16(b, load_u32(t->b[c].hi + 8 * p + 4), b, k16);
  }
  *w0 = _mm512_mullo_epi16(a, _mm512_set1_epi16((short)((t->sc[c] >> (16 * p)) & 0xFF)));
  *w1 = _mm512_mullo_epi16(b, _mm512_set1_epi16((short)((t->sc[c] >> (16 * p + 8)) & 0xFF)));
}

// sum_s m_s xs_s, exact in int32 (Q4_K/Q5_K)
static inline int32_t kmins(uint64_t mn, const int32_t *xs) {
  int32_t t = 0;
  for (int s = 0; s < 8; ++s) t += (int32_t)((mn >> (8 * s)) & 0xFF) * xs[s];
  return t;
}

// block g's integer dots of one input row with one weight row, into the row's float accumulators
static inline __attribute__((always_inline)) void kfinish512(__m512i acc, float d, float dmin, uint64_t mn,
                                                             float dx, const int32_t *xs, __m512 *facc, float *mins,
                                                             const int fmt) {
  *facc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_set1_ps(d * dx), *facc);
  if (fmt != Q6_K) *mins = fmaf(dmin * (float)kmins(mn, xs), dx, *mins);
}

static inline void kstore(const KJob *j, int64_t m, int64_t n, __m512 facc, float mins) {
  j->y[m * j->n + n] = _mm512_reduce_add_ps(facc) - mins + (j->bias ? j->bias[n] : 0.f);
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
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t *tb = j->w + (n * G + g * TILE_N) * bb;
    for (int64_t o = 0; o < TILE_N * bb; o += 64) __builtin_prefetch(tb + PREFETCH_BYTES + o);
    KTileBlock t;
    kprep512(j, n, g, &t, fmt);
    __m512i acc[TILE_M_K][TILE_N];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < TILE_N; ++c) acc[r][c] = _mm512_setzero_si512();
    for (int p = 0; p < 4; ++p) {  // sub-block pairs
      for (int c = 0; c < TILE_N; ++c) {
        __m512i w0, w1;
        kpair512(&t, c, p, &w0, &w1, fmt);
        for (int r = 0; r < R; ++r) {
          const int16_t *xq = j->xq + (m + r) * j->k + g * QKK + 64 * p;
          acc[r][c] = dot16x2(acc[r][c], w0, _mm512_loadu_si512((const void *)xq));
          acc[r][c] = dot16x2(acc[r][c], w1, _mm512_loadu_si512((const void *)(xq + 32)));
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < TILE_N; ++c)
        kfinish512(acc[r][c], half(t.b[c].d), fmt == Q6_K ? 0.f : half(t.b[c].dmin), t.mn[c],
                   j->xd[(m + r) * G + g], j->xs + (m + r) * (j->k / 32) + g * 8, &facc[r][c], &mins[r][c], fmt);
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < TILE_N; ++c) kstore(j, m + r, n + c, facc[r][c], mins[r][c]);
}

#define KMANY_R 4  // input rows per pass over a decoded tile: 16 integer accumulators and 8 input vectors
// Many input rows: the tile's weights decoded once (integers times their sub-block scales, 4 rows x K words:
// 12 KB for K = 1536) into `buf`, then every input row streams past them, so a weight's decoding is shared by
// all rows and the inner loop is VNNI dot products alone (each input vector loaded once per 4 weight rows, the
// float accumulators in memory: touched once per block). Each output is summed exactly as in ktile512.
static inline __attribute__((always_inline)) void kmany_rows(const KJob *j, int64_t n, int64_t m, const int16_t *buf,
                                                             const float *d, const float *dmin, const int32_t *mn,
                                                             const int R, const int fmt) {
  const int64_t G = j->k / QKK;
  float facc[KMANY_R][TILE_N][16] __attribute__((aligned(64)));
  float mins[KMANY_R][TILE_N];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < TILE_N; ++c) _mm512_store_ps(facc[r][c], _mm512_setzero_ps()), mins[r][c] = 0.f;
  for (int64_t g = 0; g < G; ++g) {
    __m512i acc[KMANY_R][TILE_N];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < TILE_N; ++c) acc[r][c] = _mm512_setzero_si512();
    for (int p = 0; p < 4; ++p) {
      __m512i x0[KMANY_R], x1[KMANY_R];
      for (int r = 0; r < R; ++r) {
        const int16_t *xq = j->xq + (m + r) * j->k + g * QKK + 64 * p;
        x0[r] = _mm512_loadu_si512((const void *)xq), x1[r] = _mm512_loadu_si512((const void *)(xq + 32));
      }
      for (int c = 0; c < TILE_N; ++c) {
        const int16_t *w = buf + ((g * 4 + p) * TILE_N + c) * 64;
        const __m512i w0 = _mm512_loadu_si512((const void *)w), w1 = _mm512_loadu_si512((const void *)(w + 32));
        for (int r = 0; r < R; ++r) acc[r][c] = dot16x2(dot16x2(acc[r][c], w0, x0[r]), w1, x1[r]);
      }
    }
    for (int r = 0; r < R; ++r) {
      const float dx = j->xd[(m + r) * G + g];
      int32_t mt[TILE_N] = {0};  // sum_s m_s xs_s of each weight row: the 4 rows' mins against the 8 sums at once
      if (fmt != Q6_K) {
        const __m512i xs = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(j->xs + (m + r) * (j->k / 32) + g * 8)));
        const __m512i t01 = _mm512_mullo_epi32(_mm512_loadu_si512((const void *)(mn + g * 32)), xs);
        const __m512i t23 = _mm512_mullo_epi32(_mm512_loadu_si512((const void *)(mn + g * 32 + 16)), xs);
        mt[0] = _mm512_mask_reduce_add_epi32(0x00FF, t01), mt[1] = _mm512_mask_reduce_add_epi32(0xFF00, t01);
        mt[2] = _mm512_mask_reduce_add_epi32(0x00FF, t23), mt[3] = _mm512_mask_reduce_add_epi32(0xFF00, t23);
      }
      for (int c = 0; c < TILE_N; ++c) {
        const __m512 f = _mm512_load_ps(facc[r][c]);
        _mm512_store_ps(facc[r][c], _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][c]), _mm512_set1_ps(d[g * TILE_N + c] * dx), f));
        if (fmt != Q6_K) mins[r][c] = fmaf(dmin[g * TILE_N + c] * (float)mt[c], dx, mins[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < TILE_N; ++c) kstore(j, m + r, n + c, _mm512_load_ps(facc[r][c]), mins[r][c]);
}

// bytes of scratch one thread needs for kmany (decoded tile; each block's d and dmin per row, and its 8 mins)
static inline int64_t kmany_scratch(int64_t k) {
  return TILE_N * k * 2 + (k / QKK) * TILE_N * (2 * (int64_t)sizeof(float) + 8 * (int64_t)sizeof(int32_t));
}

// weight rows [n, n + 4) against input rows [m0, m1)
static inline __attribute__((always_inline)) void kmany(const KJob *j, int64_t n, int64_t m0, int64_t m1,
                                                        char *scratch, const int fmt) {
  const int64_t G = j->k / QKK;
  int16_t *buf = (int16_t *)scratch;
  float *d = (float *)(scratch + TILE_N * j->k * 2), *dmin = d + G * TILE_N;
  int32_t *mn = (int32_t *)(dmin + G * TILE_N);  // [G][row c][8]
  for (int64_t g = 0; g < G; ++g) {
    KTileBlock t;
    kprep512(j, n, g, &t, fmt);
    for (int c = 0; c < TILE_N; ++c) {
      d[g * TILE_N + c] = half(t.b[c].d);
      dmin[g * TILE_N + c] = fmt == Q6_K ? 0.f : half(t.b[c].dmin);
      for (int s = 0; s < 8; ++s) mn[(g * TILE_N + c) * 8 + s] = fmt == Q6_K ? 0 : (int32_t)((t.mn[c] >> (8 * s)) & 0xFF);
      for (int p = 0; p < 4; ++p) {
        __m512i w0, w1;
        kpair512(&t, c, p, &w0, &w1, fmt);
        int16_t *w = buf + ((g * 4 + p) * TILE_N + c) * 64;
        _mm512_storeu_si512((void *)w, w0);
        _mm512_storeu_si512((void *)(w + 32), w1);
      }
    }
  }
  int64_t m = m0;
  for (; m + KMANY_R <= m1; m += KMANY_R) kmany_rows(j, n, m, buf, d, dmin, mn, KMANY_R, fmt);
  for (; m < m1; ++m) kmany_rows(j, n, m, buf, d, dmin, mn, 1, fmt);
}
#define KMANY 1
#define KWHOLE_TILE(j, n, m, R, fmt) ktile512(j, n, m, R, fmt)
#elif defined(__AVX2__)
#define KWHOLE_TILE(j, n, m, R, fmt) \
  for (int r_ = 0; r_ < (R); ++r_) ktile256(j, n, (m) + r_, fmt)
#else
#define KWHOLE_TILE(j, n, m, R, fmt) ktile(j, n, TILE_N, 1, m, R, fmt)
#endif

#if defined(__AVX512BF16__)
// Many rows on a CPU with bfloat16 dot products: the weights are dequantized once per call (d sc q - dmin m, rounded
// to bfloat16) a panel of 16 rows at a time (bf16_panel.h), and the input rows, rounded to bfloat16 once per call,
// stream past each panel: a float GEMM's speed without a lasting copy of the weights.
// row c's sub-blocks 2p and 2p + 1 dequantized (d sc q - dmin m) and rounded to bfloat16, stored at dst[0], dst[1]
static inline __attribute__((always_inline)) void kpair_bf16(const KTileBlock *t, int c, int p, uint16_t *const *dst,
                                                             const int fmt) {
  const __m512i both = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(t->b[c].qs + 32 * p)));
  __m512i v[2] = {_mm512_and_si512(both, _mm512_set1_epi16(0xF)), _mm512_srli_epi16(both, 4)};
  const float d = half(t->b[c].d);
  if (fmt == Q6_K) {
    const __m512i k16 = _mm512_set1_epi16(16), k32 = _mm512_set1_epi16(32);
    const uint8_t *h = t->b[c].hi + 16 * p;
    for (int i = 0; i < 2; ++i) {
      v[i] = _mm512_sub_epi16(v[i], k32);
      v[i] = _mm512_mask_add_epi16(v[i], load_u32(h + 8 * i), v[i], k16);
      v[i] = _mm512_mask_add_epi16(v[i], load_u32(h + 8 * i + 4), v[i], k32);
    }
  } else if (fmt == Q5_K) {
    for (int i = 0; i < 2; ++i)
      v[i] = _mm512_mask_add_epi16(v[i], load_u32(t->b[c].hi + 8 * p + 4 * i), v[i], _mm512_set1_epi16(16));
  }
  const float dmin = fmt == Q6_K ? 0.f : half(t->b[c].dmin);
  for (int i = 0; i < 2; ++i) {  // sub-block s = 2p + i: elements 0-15 and 16-31
    const int s = 2 * p + i;
    const __m512 q0 = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(v[i])));
    const __m512 q1 = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(v[i], 1)));
    __m512 w0, w1;
    if (fmt == Q6_K) {
      w0 = _mm512_mul_ps(q0, _mm512_set1_ps(d * (float)(int8_t)t->b[c].sc[2 * s]));
      w1 = _mm512_mul_ps(q1, _mm512_set1_ps(d * (float)(int8_t)t->b[c].sc[2 * s + 1]));
    } else {
      const __m512 scale = _mm512_set1_ps(d * (float)((t->sc[c] >> (8 * s)) & 0xFF));
      const __m512 off = _mm512_set1_ps(dmin * (float)((t->mn[c] >> (8 * s)) & 0xFF));
      w0 = _mm512_fmsub_ps(q0, scale, off), w1 = _mm512_fmsub_ps(q1, scale, off);
    }
    _mm512_storeu_si512((void *)dst[i], (__m512i)_mm512_cvtne2ps_pbh(w1, w0));
  }
}

#include "bf16_panel.h"

// the panel chunk [kc, kc + len) of weight rows [n, n + 4 tiles): each row's sub-blocks dequantized to bfloat16 (the
// rows of missing tiles zero)
static inline __attribute__((always_inline)) void kpanel_fill(const KJob *j, int64_t n, int tiles, int64_t kc,
                                                              int64_t len, uint16_t *panel, const int fmt) {
  uint16_t pair[4][2][32] __attribute__((aligned(64)));
  memset(pair, 0, sizeof(pair));
  for (int64_t g = kc / QKK; g < (kc + len) / QKK; ++g) {
    KTileBlock t[4];
    for (int c = 0; c < tiles; ++c) kprep512(j, n + TILE_N * c, g, &t[c], fmt);
    for (int r = 0; r < TILE_N; ++r)
      for (int p = 0; p < 4; ++p) {
        for (int c = 0; c < tiles; ++c) {
          uint16_t *const dst[2] = {pair[c][0], pair[c][1]};
          kpair_bf16(&t[c], r, p, dst, fmt);
        }
        const int64_t kb = (g * QKK - kc) / 32 + 2 * p;
        for (int h = 0; h < 2; ++h) {
          __m512i v[4];
          for (int c = 0; c < 4; ++c) v[c] = _mm512_load_si512((const void *)pair[c][h]);
          panel_put4(panel, kb + h, r, v);
        }
      }
  }
}

#if defined(__AMX_BF16__)
// super-blocks [g0, g1) of weight rows [n, n + 4 tiles) as AMX tiles (amx_panel.h): k-block b of row r at
// panel + 512 b + 32 r, each row's sub-blocks dequantized to bfloat16
static inline __attribute__((always_inline)) void kamx_fill(const KJob *j, int64_t n, int tiles, int64_t g0,
                                                            int64_t g1, uint16_t *panel, const int fmt) {
  for (int64_t g = g0; g < g1; ++g) {
    KTileBlock t[4];
    for (int c = 0; c < tiles; ++c) kprep512(j, n + TILE_N * c, g, &t[c], fmt);
    for (int c = 0; c < tiles; ++c)
      for (int r = 0; r < TILE_N; ++r)
        for (int p = 0; p < 4; ++p) {
          uint16_t *at = panel + (g * QKK / 32 + 2 * p) * 512 + (TILE_N * c + r) * 32;
          uint16_t *const dst[2] = {at, at + 512};
          kpair_bf16(&t[c], r, p, dst, fmt);
        }
  }
}
#endif

// weight row `row`, as floats in wrow, against bfloat16 input rows [m0, m1): one dot per input row (a row past the
// last whole tile, any format)
static void many_bf16_row(const KJob *j, const uint16_t *xb, int64_t row, int64_t m0, int64_t m1, const float *wrow) {
  for (int64_t m = m0; m < m1; ++m) {
    float s = 0.f;
    for (int64_t i = 0; i < j->k; ++i) s += bf16_to_f32(xb[m * j->k + i]) * wrow[i];
    j->y[m * j->n + row] = s + (j->bias ? j->bias[row] : 0.f);
  }
}

// a weight row past the last whole tile against bfloat16 input rows [m0, m1)
static void kmany_bf16_tail(const KJob *j, const uint16_t *xb, int64_t row, int64_t m0, int64_t m1, float *wrow,
                            const int fmt) {
  kquant_rows(j->w, &row, 1, j->n, j->k, fmt, wrow);
  many_bf16_row(j, xb, row, m0, m1, wrow);
}
#define KMANY_BF16 1
#endif

// input rows from which a whole tile is decoded once into scratch (kmany) instead of once per few rows
#define KMANY_MIN_ROWS 8
// bytes of quantized input rows one pass over the weights takes (they stay in L2 while every tile passes them)
#define KMANY_BLOCK_BYTES (256 * 1024)

// weight rows [begin, end) against input rows [m0, m1) (all rows when scratch is NULL)
static inline __attribute__((always_inline)) void krun_rows(const KJob *j, int64_t begin, int64_t end, int64_t m0,
                                                           int64_t m1, char *scratch, const int fmt) {
  (void)scratch, (void)m0, (void)m1;  // the many-row path is built with AVX-512 only
  for (int64_t n = begin; n < end; n += TILE_N) {
    int64_t m = 0;
#ifdef KMANY
    if (n + TILE_N <= end && scratch) {
      kmany(j, n, m0, m1, scratch, fmt);
      continue;
    }
    if (scratch) {  // rows past the last whole tile, of this block of input rows
      for (m = m0; m < m1; ++m) ktile(j, n, (int)(end - n), 0, m, 1, fmt);
      continue;
    }
#endif
    if (n + TILE_N <= end) {
      for (; m + TILE_M_K <= j->m; m += TILE_M_K) KWHOLE_TILE(j, n, m, TILE_M_K, fmt);
      REST_ROWS(KWHOLE_TILE, j, n, m, TILE_M_K, fmt);
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
          const int q = (s % 2 ? byte >> 4 : byte & 0xF) | q6_high(&b, s, l) << 4;
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
