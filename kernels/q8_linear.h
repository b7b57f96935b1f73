// Integer dot products with int8 activations, llama.cpp's arithmetic: quant_linear's default path (`exact` = 0).
//
// Each input row is quantized once per call to int8 in blocks, alone (so a row's result never depends on its batch):
// blocks of 256 for the K formats (Q4_K, Q5_K, Q6_K: one scale per block, as llama.cpp's Q8_K), of 32 for Q8_0, Q4_1
// and Q5_0 (one scale per block, as its Q8_0/Q8_1); scale absmax / 127, values rounded to nearest even; with each
// block the exact integer sums of its values per 16 and per 32 (for the weights' minimums and offsets). A weight
// block's dot product with an input block is then exact in int32: pairs of u8 x s8 products summed into int16 lanes
// (`vpmaddubsw`: the weights' integers are the unsigned side, at most 63 x 127 x 2 < 2^15), then widened by the
// sub-block scales into int32 lanes (`vpmaddwd`) and summed over the block. One conversion and one float multiply-add
// by d_w d_x per block (per 32 weights for the 32-weight formats) follow. That is twice the products per instruction
// of the exact path's int16 activations (`vpmaddwd` on 16-bit pairs), and half the input bytes to read.
//
// The price is the activations' rounding: a relative error of about 1/254 per value (the exact path's is 1/65534),
// averaged over a block's products. Its effect on the model's next-token distributions is measured against float32
// by benchmarks/bench_models.py (mean KL divergence and top-1 agreement along real text).
//
// Every output is summed in one fixed order whatever the batch (the per-block integer sums are exact; the float steps
// and the final lane reduction are the same code for every row-tile size), and threads take whole 4-row weight tiles.
#pragma once
// (included by quant_linear.c after kquant.h: Block, block_in, KBlock, kblock_in, kscales64, half, load_u32, hsum,
// prepare_row, chunk_of, TILE_N)

// Input rows as int8 blocks: values, a scale per block (of 256 or 32), exact sums per 16 and per 32
typedef struct {
  const int8_t *q;
  const float *d;
  const int16_t *s16, *s32;
} X8;

// rows per pass over a tile's weights: the weights a block decodes are used for this many input rows at once
#define Q8_R 2

// x [k] as int8 blocks of `blk` (32 or 256): q, d [k / blk], s16 [k / 16], s32 [k / 32]
static void quantize_row_q8(const float *x, int64_t k, int64_t blk, int8_t *q, float *d, int16_t *s16,
                            int16_t *s32) {
  for (int64_t g = 0; g < k / blk; ++g) {
    const float *xb = x + g * blk;
    const float amax = abs_max(xb, blk), id = amax > 0.f ? 127.f / amax : 0.f;
    d[g] = amax / 127.f;
    int8_t *qb = q + g * blk;
#ifdef __AVX2__
    const __m256 vid = _mm256_set1_ps(id);
    for (int64_t i = 0; i < blk; i += 32) {  // rounded to nearest even (the default mode), packed in element order
      const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + i), vid));
      const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + i + 8), vid));
      const __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + i + 16), vid));
      const __m256i e = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + i + 24), vid));
      const __m256i ab = _mm256_packs_epi32(a, b), ce = _mm256_packs_epi32(c, e);  // lanes interleaved by 128 bits
      const __m256i v = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(ab, ce), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm256_storeu_si256((__m256i *)(qb + i), v);
    }
#else
    for (int64_t i = 0; i < blk; ++i) qb[i] = (int8_t)nearbyintf(xb[i] * id);
#endif
  }
  for (int64_t j = 0; j < k / 16; ++j) {
    int16_t sum = 0;
    for (int i = 0; i < 16; ++i) sum = (int16_t)(sum + q[j * 16 + i]);
    s16[j] = sum;
  }
  for (int64_t j = 0; j < k / 32; ++j) s32[j] = (int16_t)(s16[2 * j] + s16[2 * j + 1]);
}

typedef struct {
  const float *bias;
  X8 x;
  const uint8_t *w;
  float *y;
  int64_t m, n, k;
} Q8Job;

// ---- portable: any weight row against one input row (rows past the last whole tile; builds without AVX2) ------
// weight element i of a K block as an integer (q, without its scale or offset)
static inline int kq(const KBlock *b, int i, const int fmt) {
  const int s = i / 32, l = i % 32, byte = b->qs[(s / 2) * 32 + l];
  int q = s % 2 ? byte >> 4 : byte & 0xF;
  if (fmt == Q6_K) {
    q |= ((load_u32(b->hi + 8 * s) >> l) & 1) << 4;
    q |= ((load_u32(b->hi + 8 * s + 4) >> l) & 1) << 5;
  } else if (fmt == Q5_K) {
    q |= ((load_u32(b->hi + 4 * s) >> l) & 1) << 4;
  }
  return q;
}

// y[m][n + c] for weight row n + c (whole: in a whole tile) against input row m
static float q8_dot_row(const Q8Job *j, int64_t n, const int whole, int c, int64_t m, const int fmt) {
  float acc = 0.f, mins = 0.f;
  if (fmt >= Q4_K) {
    const int64_t G = j->k / QKK;
    for (int64_t g = 0; g < G; ++g) {
      const KBlock b = kblock_in(j->w, j->k, n, whole, c, g, fmt);
      const int8_t *xq = j->x.q + m * j->k + g * QKK;
      int32_t dot = 0;
      if (fmt == Q6_K) {
        for (int i = 0; i < QKK; ++i) dot += (kq(&b, i, fmt) - 32) * (int8_t)b.sc[i / 16] * xq[i];
      } else {
        uint64_t sc, mn;
        kscales64(b.sc, &sc, &mn);
        int32_t msum = 0;
        for (int i = 0; i < QKK; ++i) dot += kq(&b, i, fmt) * (int)((sc >> (8 * (i / 32))) & 0xFF) * xq[i];
        for (int s = 0; s < 8; ++s) msum += (int)((mn >> (8 * s)) & 0xFF) * j->x.s32[m * (j->k / 32) + g * 8 + s];
        mins = fmaf(half(b.dmin) * j->x.d[m * G + g], (float)msum, mins);
      }
      acc = fmaf(half(b.d) * j->x.d[m * G + g], (float)dot, acc);
    }
    return acc - mins;
  }
  const int64_t G = j->k / QK;
  for (int64_t g = 0; g < G; ++g) {
    const Block b = block_in(j->w, j->k, n, whole, c, g, fmt);
    const int8_t *xq = j->x.q + m * j->k + g * QK;
    int32_t dot = 0;
    for (int i = 0; i < QK; ++i) {
      int w = fmt == Q8_0 ? (int8_t)b.q[i] : (i < 16 ? b.q[i] & 0xF : b.q[i - 16] >> 4);
      if (fmt == Q5_0) w += (int)((load_u32(b.m) >> i) & 1) * 16 - 16;
      dot += w * xq[i];
    }
    const float dx = j->x.d[m * G + g];
    acc = fmaf(half(b.d) * dx, (float)dot, acc);
    if (fmt == Q4_1) mins = fmaf(half(b.m) * dx, (float)j->x.s32[m * G + g], mins);
  }
  return acc + mins;
}

#if defined(__AVX2__)
// ---- AVX2: a whole tile (4 weight rows) against R <= Q8_R input rows -------------------------------------------
// 32 bytes of 0x10 (of `v`) where bit i of `bits` is set
static inline __attribute__((always_inline)) __m256i bit_bytes(uint32_t bits, const __m256i v) {
  const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits),
                                             _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2,
                                                              2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), v);
}

// the lane sums of y's accumulators: facc [R][4] of 8 floats, mins [R][4] of 4 (subtracted)
static inline __attribute__((always_inline)) void q8_store(const Q8Job *j, int64_t n, int64_t m, const int R,
                                                           float facc[][TILE_N][8], const __m128 mins[][TILE_N]) {
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < TILE_N; ++c) {
      __m128 mq = mins[r][c];
      mq = _mm_add_ps(mq, _mm_movehl_ps(mq, mq));
      mq = _mm_add_ss(mq, _mm_shuffle_ps(mq, mq, 1));
      j->y[(m + r) * j->n + n + c] = hsum(_mm256_load_ps(facc[r][c])) - _mm_cvtss_f32(mq) + (j->bias ? j->bias[n + c] : 0.f);
    }
}

// K formats: per block, each weight row's sub-block pairs (64 weights: the low nibbles are sub-block 2p, the high ones
// 2p + 1) against each input row's, summed in int32 over the block; then d_w d_x (and dmin_w d_x times the minimums
// against the input's sums per 32; Q6_K: its offset of 32 against the sums per 16)
static inline __attribute__((always_inline)) void q8k_tile(const Q8Job *j, int64_t n, int64_t m, const int R,
                                                           const int fmt) {
  const int64_t G = j->k / QKK, bb = kblock_bytes(fmt);
  float facc[Q8_R][TILE_N][8] __attribute__((aligned(32)));
  __m128 mins[Q8_R][TILE_N];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < TILE_N; ++c) _mm256_store_ps(facc[r][c], _mm256_setzero_ps()), mins[r][c] = _mm_setzero_ps();
  const __m256i m4 = _mm256_set1_epi8(0xF);
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t *tb = j->w + (n * G + g * TILE_N) * bb;
    for (int64_t o = 0; o < TILE_N * bb; o += 64) __builtin_prefetch(tb + PREFETCH_BYTES + o);
    KBlock b[TILE_N];
    int16_t sc[TILE_N][16] __attribute__((aligned(32)));  // Q4_K/Q5_K: 8 scales, then 8 minimums; Q6_K: 16 scales
    for (int c = 0; c < TILE_N; ++c) {
      b[c] = kblock_in(j->w, j->k, n, 1, c, g, fmt);
      if (fmt == Q6_K) {
        _mm256_store_si256((__m256i *)sc[c], _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)b[c].sc)));
      } else {
        uint64_t s, mn;
        kscales64(b[c].sc, &s, &mn);
        _mm256_store_si256((__m256i *)sc[c], _mm256_cvtepu8_epi16(_mm_set_epi64x((long long)mn, (long long)s)));
      }
    }
    __m256i acc[Q8_R][TILE_N];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < TILE_N; ++c) acc[r][c] = _mm256_setzero_si256();
    for (int p = 0; p < 4; ++p) {
      __m256i xl[Q8_R], xh[Q8_R];
      for (int r = 0; r < R; ++r) {
        const int8_t *x = j->x.q + (m + r) * j->k + g * QKK + 64 * p;
        xl[r] = _mm256_loadu_si256((const __m256i *)x), xh[r] = _mm256_loadu_si256((const __m256i *)(x + 32));
      }
      for (int c = 0; c < TILE_N; ++c) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(b[c].qs + 32 * p));
        __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
        __m256i sl, sh;
        if (fmt == Q6_K) {  // bits 4 and 5 from the planes; the scales per 16: [2s] for lanes 0-7, [2s + 1] for 8-15
          lo = _mm256_or_si256(lo, _mm256_or_si256(bit_bytes(load_u32(b[c].hi + 16 * p), _mm256_set1_epi8(16)),
                                                   bit_bytes(load_u32(b[c].hi + 16 * p + 4), _mm256_set1_epi8(32))));
          hi = _mm256_or_si256(hi, _mm256_or_si256(bit_bytes(load_u32(b[c].hi + 16 * p + 8), _mm256_set1_epi8(16)),
                                                   bit_bytes(load_u32(b[c].hi + 16 * p + 12), _mm256_set1_epi8(32))));
          sl = _mm256_set_m128i(_mm_set1_epi16(sc[c][4 * p + 1]), _mm_set1_epi16(sc[c][4 * p]));
          sh = _mm256_set_m128i(_mm_set1_epi16(sc[c][4 * p + 3]), _mm_set1_epi16(sc[c][4 * p + 2]));
        } else {
          if (fmt == Q5_K) {
            lo = _mm256_or_si256(lo, bit_bytes(load_u32(b[c].hi + 8 * p), _mm256_set1_epi8(16)));
            hi = _mm256_or_si256(hi, bit_bytes(load_u32(b[c].hi + 8 * p + 4), _mm256_set1_epi8(16)));
          }
          sl = _mm256_set1_epi16(sc[c][2 * p]), sh = _mm256_set1_epi16(sc[c][2 * p + 1]);
        }
        for (int r = 0; r < R; ++r)
          acc[r][c] = _mm256_add_epi32(acc[r][c], _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(lo, xl[r]), sl),
                                                                   _mm256_madd_epi16(_mm256_maddubs_epi16(hi, xh[r]), sh)));
      }
    }
    for (int r = 0; r < R; ++r) {
      const float dx = j->x.d[(m + r) * G + g];
      if (fmt == Q6_K) {  // q - 32: less 32 times each scale's group sum
        const __m256i s16 = _mm256_loadu_si256((const __m256i *)(j->x.s16 + (m + r) * (j->k / 16) + g * 16));
        for (int c = 0; c < TILE_N; ++c)
          acc[r][c] = _mm256_sub_epi32(acc[r][c], _mm256_slli_epi32(_mm256_madd_epi16(_mm256_load_si256((const __m256i *)sc[c]), s16), 5));
      } else {
        const __m128i s32 = _mm_loadu_si128((const __m128i *)(j->x.s32 + (m + r) * (j->k / 32) + g * 8));
        for (int c = 0; c < TILE_N; ++c)
          mins[r][c] = _mm_fmadd_ps(_mm_cvtepi32_ps(_mm_madd_epi16(_mm_load_si128((const __m128i *)(sc[c] + 8)), s32)),
                                    _mm_set1_ps(half(b[c].dmin) * dx), mins[r][c]);
      }
      for (int c = 0; c < TILE_N; ++c)
        _mm256_store_ps(facc[r][c], _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][c]), _mm256_set1_ps(half(b[c].d) * dx),
                                                    _mm256_load_ps(facc[r][c])));
    }
  }
  q8_store(j, n, m, R, facc, mins);
}

// Q8_0 / Q4_1 / Q5_0: per 32-weight block, each weight row's 32 integers against each input row's (Q8_0: |w| against x
// signed by w, as vpmaddubsw takes one side unsigned; Q5_0: q + 16 in 0..31), converted per block and scaled by d_w d_x;
// then Q4_1's minimum times d_x times the input block's sum added, Q5_0's 16 d_w d_x times that sum taken off
static inline __attribute__((always_inline)) void q8_tile(const Q8Job *j, int64_t n, int64_t m, const int R,
                                                          const int fmt) {
  const int64_t G = j->k / QK, qbytes = block_bytes(fmt) - head_bytes(fmt);
  __m256 facc[Q8_R][TILE_N];
  __m128 mins[Q8_R];  // the 4 rows' min_w d_x sum(x_q) (Q4_1), -16 d_w d_x sum(x_q) (Q5_0)
  for (int r = 0; r < R; ++r) {
    mins[r] = _mm_setzero_ps();
    for (int c = 0; c < TILE_N; ++c) facc[r][c] = _mm256_setzero_ps();
  }
  const __m256i m4 = _mm256_set1_epi8(0xF), ones = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < G; ++g) {
    const Block b = block_in(j->w, j->k, n, 1, 0, g, fmt);
    prefetch_tile_block(b, fmt);
    const __m128 dw = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)b.d));  // the 4 rows' scales
    __m256i w[TILE_N];
    for (int c = 0; c < TILE_N; ++c) {
      const uint8_t *q = b.q + c * qbytes;
      if (fmt == Q8_0) {
        w[c] = _mm256_loadu_si256((const __m256i *)q);
      } else {
        const __m128i v = _mm_loadu_si128((const __m128i *)q);  // element e: low nibble of byte e, e + 16: high
        w[c] = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), m4);
        if (fmt == Q5_0) w[c] = _mm256_or_si256(w[c], bit_bytes(load_u32(b.m + 4 * c), _mm256_set1_epi8(16)));
      }
    }
    for (int r = 0; r < R; ++r) {
      const int64_t xb = (m + r) * G + g;
      const __m256i x = _mm256_loadu_si256((const __m256i *)(j->x.q + xb * QK));
      float s[TILE_N] __attribute__((aligned(16)));
      _mm_store_ps(s, _mm_mul_ps(dw, _mm_set1_ps(j->x.d[xb])));
      for (int c = 0; c < TILE_N; ++c) {
        const __m256i p = fmt == Q8_0 ? _mm256_maddubs_epi16(_mm256_abs_epi8(w[c]), _mm256_sign_epi8(x, w[c]))
                                      : _mm256_maddubs_epi16(w[c], x);
        facc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones)), _mm256_broadcast_ss(s + c), facc[r][c]);
      }
      if (fmt == Q4_1)  // + min_w d_x sum(x_q)
        mins[r] = _mm_fmadd_ps(_mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)b.m)),
                               _mm_set1_ps(j->x.d[xb] * (float)j->x.s32[xb]), mins[r]);
      else if (fmt == Q5_0)  // - 16 d_w d_x sum(x_q)
        mins[r] = _mm_fmadd_ps(dw, _mm_set1_ps(j->x.d[xb] * (float)(-16 * j->x.s32[xb])), mins[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float mn[TILE_N];
    _mm_storeu_ps(mn, mins[r]);
    for (int c = 0; c < TILE_N; ++c)
      j->y[(m + r) * j->n + n + c] = hsum(facc[r][c]) + mn[c] + (j->bias ? j->bias[n + c] : 0.f);
  }
}
#endif

// weight rows [begin, end) against input rows [m0, m1)
static void q8_run_rows(const Q8Job *j, int64_t begin, int64_t end, int64_t m0, int64_t m1, const int fmt) {
  for (int64_t n = begin; n < end; n += TILE_N) {
    if (n + TILE_N > end) {  // rows past the last whole tile: plain blocks, one dot at a time
      for (int64_t m = m0; m < m1; ++m)
        for (int c = 0; c < end - n; ++c)
          j->y[m * j->n + n + c] = q8_dot_row(j, n, 0, c, m, fmt) + (j->bias ? j->bias[n + c] : 0.f);
      continue;
    }
#if defined(__AVX2__)
    int64_t m = m0;  // the row count a constant in each call, so the accumulators stay in registers
    if (fmt >= Q4_K) {
      for (; m + Q8_R <= m1; m += Q8_R) q8k_tile(j, n, m, Q8_R, fmt);
      if (m < m1) q8k_tile(j, n, m, 1, fmt);
    } else {
      for (; m + Q8_R <= m1; m += Q8_R) q8_tile(j, n, m, Q8_R, fmt);
      if (m < m1) q8_tile(j, n, m, 1, fmt);
    }
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
  int8_t *q = (int8_t *)malloc((size_t)(m * k + m * (k / blk) * (int64_t)sizeof(float) + m * (k / 16 + k / 32) * 2));
  if (!q) return;
  float *d = (float *)(q + m * k);
  int16_t *s16 = (int16_t *)(d + m * (k / blk)), *s32 = s16 + m * (k / 16);
  const Q8Job j = {bias, {q, d, s16, s32}, (const uint8_t *)w, y, m, n, k};
  const int64_t chunk = chunk_of(tiles, &threads);
  int64_t block = Q8_BLOCK_BYTES / k;
  block = block < Q8_R ? Q8_R : block;
#pragma omp parallel num_threads(m >= Q8_PARALLEL_ROWS || threads == 1 ? threads : 1)
  {
    float *row = (float *)malloc((size_t)(k * (int64_t)sizeof(float)));  // one transformed input row
#pragma omp for schedule(static)
    for (int64_t r = 0; r < m; ++r)
      quantize_row_q8(prepare_row(x, r, k, prologue, norm_w, eps, residual, row), k, blk, q + r * k,
                      d + r * (k / blk), s16 + r * (k / 16), s32 + r * (k / 32));
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
