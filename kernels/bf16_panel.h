// Many-row matmuls on a CPU with bfloat16 dot products (AVX512-BF16), over weights decoded to bfloat16 a panel of
// 16 rows at a time. vdpbf16ps multiplies pairs of values, so a panel vector holds, for 4 of its rows, 4 pairs each
// (8 consecutive weights of each row, one row per 128-bit lane), and an input row's matching 8 values are broadcast
// to all 4 lanes. 6 input rows x 4 such vectors of accumulators fill the registers, so each weight load feeds 6 dot
// products and each input load 4 (a dot-product layout, one weight row per vector, needs a horizontal sum per output:
// more work than the products themselves at K = 576). At the end an input row's 4 accumulators reduce to its 16
// outputs with 6 shuffles and adds. Sums round differently from the integer path's: batch-invariant calls never
// come here.
//
// Panel layout, 8 weights of k per group: group g's 4 vectors are 128 bf16 at panel + 128 g; vector t's 128-bit lane
// c holds row 4c + t's weights 8g .. 8g + 7. The reduction then puts row p's sum in lane p.
// (included by quant_linear.c where the CPU has AVX512-BF16)
#define PANEL_N 16     // weight rows per panel: 4 tiles of 4
#define PANEL_MR 6     // input rows per pass: 24 accumulators, 4 weight vectors and an input vector in 32 registers
#define PANEL_KC 1024  // weights of a row per decoded chunk: 16 rows x 1024 x 2 bytes = 32 KB, inside L1

#define PANEL_BLOCK_BYTES (512 * 1024)  // bfloat16 input rows per pass over the weights: they stay in L2
#define AMX_BLOCK_BYTES (1536 * 1024)  // the same for AMX, whose products outrun decoding the weights again each pass

// row 4c + t's 32 weights of 32-weight block kb of the chunk, for c = 0..3 (bfloat16, in v[c]), into their places in
// the panel: a 4 x 4 transpose of 128-bit lanes, so that group 4 kb + i's vector t gets lane i of each v[c]
static inline __attribute__((always_inline)) void panel_put4(uint16_t *panel, int64_t kb, int t, const __m512i *v) {
  const __m512i a = _mm512_shuffle_i64x2(v[0], v[1], 0x44), b = _mm512_shuffle_i64x2(v[0], v[1], 0xEE);
  const __m512i c = _mm512_shuffle_i64x2(v[2], v[3], 0x44), d = _mm512_shuffle_i64x2(v[2], v[3], 0xEE);
  uint16_t *at = panel + kb * 512 + t * 32;
  _mm512_storeu_si512((void *)at, _mm512_shuffle_i64x2(a, c, 0x88));
  _mm512_storeu_si512((void *)(at + 128), _mm512_shuffle_i64x2(a, c, 0xDD));
  _mm512_storeu_si512((void *)(at + 256), _mm512_shuffle_i64x2(b, d, 0x88));
  _mm512_storeu_si512((void *)(at + 384), _mm512_shuffle_i64x2(b, d, 0xDD));
}

// lane 4c + t: the sum of a[t]'s 4 lanes in 128-bit lane c
static inline __attribute__((always_inline)) __m512 panel_sum(const __m512 *a) {
  const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(a[0], a[1]), _mm512_unpackhi_ps(a[0], a[1]));
  const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(a[2], a[3]), _mm512_unpackhi_ps(a[2], a[3]));
  return _mm512_add_ps(_mm512_shuffle_ps(s01, s23, _MM_SHUFFLE(1, 0, 1, 0)),
                       _mm512_shuffle_ps(s01, s23, _MM_SHUFFLE(3, 2, 3, 2)));
}

// R input rows (xb, a row every ldx values, at the chunk's first column) against the panel's `groups` groups: each
// row's 16 outputs (those in `mask`) stored to y (a row every ldy), plus bias on the first chunk, plus what y holds
// on the others
static inline __attribute__((always_inline)) void panel_rows(const uint16_t *xb, int64_t ldx, const uint16_t *panel,
                                                             int64_t groups, float *y, int64_t ldy, const float *bias,
                                                             __mmask16 mask, int first, const int R) {
  __m512 acc[PANEL_MR][4];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < 4; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint16_t *w = panel + g * 128;
    __m512bh wv[4];
    for (int t = 0; t < 4; ++t) wv[t] = (__m512bh)_mm512_loadu_si512((const void *)(w + 32 * t));
    for (int r = 0; r < R; ++r) {
      const __m512bh xv =
          (__m512bh)_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(xb + r * ldx + 8 * g)));
      for (int t = 0; t < 4; ++t) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], wv[t], xv);
    }
  }
  for (int r = 0; r < R; ++r) {
    __m512 s = panel_sum(acc[r]);
    if (!first)
      s = _mm512_add_ps(s, _mm512_maskz_loadu_ps(mask, y + r * ldy));
    else if (bias)
      s = _mm512_add_ps(s, _mm512_maskz_loadu_ps(mask, bias));
    _mm512_mask_storeu_ps(y + r * ldy, mask, s);
  }
}

// input rows [m0, m1) against a filled panel chunk of `len` weights per row from column kc; y and bias at the panel's
// first output column
static void panel_pass(const uint16_t *xb, int64_t k, int64_t n, const uint16_t *panel, int64_t kc, int64_t len,
                       int64_t m0, int64_t m1, float *y, const float *bias, __mmask16 mask) {
  const int first = kc == 0;
  const int64_t groups = len / 8;
  int64_t m = m0;
  for (; m + PANEL_MR <= m1; m += PANEL_MR)
    panel_rows(xb + m * k + kc, k, panel, groups, y + m * n, n, bias, mask, first, PANEL_MR);
  const uint16_t *x = xb + m * k + kc;
  float *o = y + m * n;
  switch (m1 - m) {
    case 5: panel_rows(x, k, panel, groups, o, n, bias, mask, first, 5); break;
    case 4: panel_rows(x, k, panel, groups, o, n, bias, mask, first, 4); break;
    case 3: panel_rows(x, k, panel, groups, o, n, bias, mask, first, 3); break;
    case 2: panel_rows(x, k, panel, groups, o, n, bias, mask, first, 2); break;
    case 1: panel_rows(x, k, panel, groups, o, n, bias, mask, first, 1); break;
    default: break;
  }
}
