// Many-row matmuls on a CPU with AMX tiles (AMX-BF16): one tdpbf16ps multiplies a 16 x 32 bfloat16 tile by a
// 32 x 16 one into a 16 x 16 tile of float sums, 16 times the work of an AVX-512 bfloat16 dot product, so the
// products cost less than decoding the weights. The weights are decoded to bfloat16 a panel at a time over the whole
// of K, as the first operand: k-block b's tile (16 rows x 32 weights, one block of each row) at panel + 512 b, so the
// decode stores each block as it comes out. The second operand takes pairs of k, so the input rows are
// laid out once per call: tile (i, b) row p holds, for input rows 16 i .. 16 i + 15, their values 2p and 2p + 1 of
// k-block b. A tile of sums is [weight row][input row], transposed on its way into y. Where the input rows fit one
// pass (at most 32), the panel is decoded a super-block at a time between the products (quant_linear.c
// amx_rows_of), so its tiles are loaded from L1 rather than L2.
// (included by quant_linear.c where the build has AMX; the OS must grant the tile state first: amx_ready)
#include <sys/syscall.h>
#include <unistd.h>

// A panel is 32 weight rows, two halves of 16 (half h's k-block b at panel + 16 h k + 512 b): two weight tiles and two
// input tiles make four tiles of sums, so each tile loaded feeds two products. A last panel of one half (N not a
// multiple of 32, rare: the models' widths are) runs the same, its second half's sums never stored.

typedef struct {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} AmxConfig;

// whether this process may use the tile registers: Linux grants their state on request, once per process
static int amx_ready(void) {
  static int ready = -1;
  if (ready < 0) ready = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ready;
}

// this thread's tiles 0-7 as 16 rows of 64 bytes (tile state is per thread)
static void amx_configure(void) {
  AmxConfig c;
  memset(&c, 0, sizeof(c));
  c.palette = 1;
  for (int t = 0; t < 8; ++t) c.rows[t] = 16, c.colsb[t] = 64;
  _tile_loadconfig(&c);
}

// r[c] = column c of the 16 x 16 matrix of 32-bit values whose row i is r[i]
static inline __attribute__((always_inline)) void transpose16(__m512i *r) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // u[4i + q]'s 128-bit lane L: column 4L + q of rows 4i .. 4i + 3
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int q = 0; q < 4; ++q) {  // then a 4 x 4 transpose of 128-bit lanes
    const __m512i a = _mm512_shuffle_i64x2(u[q], u[4 + q], 0x44), b = _mm512_shuffle_i64x2(u[q], u[4 + q], 0xEE);
    const __m512i c = _mm512_shuffle_i64x2(u[8 + q], u[12 + q], 0x44);
    const __m512i d = _mm512_shuffle_i64x2(u[8 + q], u[12 + q], 0xEE);
    r[q] = _mm512_shuffle_i64x2(a, c, 0x88), r[4 + q] = _mm512_shuffle_i64x2(a, c, 0xDD);
    r[8 + q] = _mm512_shuffle_i64x2(b, d, 0x88), r[12 + q] = _mm512_shuffle_i64x2(b, d, 0xDD);
  }
}

// input-row block i (rows 16 i .. 16 i + 15 of the bfloat16 rows xb, zero past m) as the second operand's tiles
static void amx_inputs(const uint16_t *xb, int64_t m, int64_t k, int64_t i, uint16_t *xv) {
  const int64_t kb = k / 32;
  for (int64_t b = 0; b < kb; ++b) {
    __m512i r[16];
    for (int e = 0; e < 16; ++e)
      r[e] = 16 * i + e < m ? _mm512_loadu_si512((const void *)(xb + (16 * i + e) * k + 32 * b))
                            : _mm512_setzero_si512();
    transpose16(r);
    uint16_t *tile = xv + (i * kb + b) * 512;
    for (int p = 0; p < 16; ++p) _mm512_store_si512((void *)(tile + 32 * p), r[p]);
  }
}

// a stored tile of sums (sums[weight row][input row]) into y: input rows 16 i .. (at most m), the outputs in mask
// (+ bias), a row every ldy
static inline void amx_put(const float *sums, int64_t i, int64_t m, float *y, int64_t ldy, const float *bias,
                           __mmask16 mask) {
  __m512i r[16];
  for (int e = 0; e < 16; ++e) r[e] = _mm512_load_si512((const void *)(sums + 16 * e));
  transpose16(r);
  const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
  for (int e = 0; e < 16 && 16 * i + e < m; ++e)
    _mm512_mask_storeu_ps(y + (16 * i + e) * ldy, mask, _mm512_add_ps(_mm512_castsi512_ps(r[e]), b));
}

#define AMX_PUT(acc, e, half)      \
  _tile_stored(acc, sums, 64);     \
  amx_put(sums, i + (e), m, y + 16 * (half), ldy, bias ? bias + 16 * (half) : NULL, mask[half])

// tiles 0-3 += the panel's k-blocks [b0, b1) (kb a half) times input-row block x (tiles 0, 2) and the next one (tiles
// 1, 3) where `two`
static inline __attribute__((always_inline)) void amx_dots(const uint16_t *x, int64_t kb, const uint16_t *panel,
                                                           int64_t b0, int64_t b1, int two) {
  const uint16_t *upper = panel + kb * 512;  // half 1, 16 rows x k later
  for (int64_t b = b0; b < b1; ++b) {
    _tile_loadd(4, panel + 512 * b, 64);
    _tile_loadd(5, upper + 512 * b, 64);
    _tile_loadd(6, x + 512 * b, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(2, 5, 6);
    if (two) {
      _tile_loadd(7, x + (kb + b) * 512, 64);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
}

// tiles 0-3 (input-row blocks i and, where `two`, i + 1) into y
static inline __attribute__((always_inline)) void amx_store(int64_t i, int two, int64_t m, float *y, int64_t ldy,
                                                            const float *bias, const __mmask16 *mask) {
  float sums[256] __attribute__((aligned(64)));
  AMX_PUT(0, 0, 0);
  AMX_PUT(2, 0, 1);
  if (two) {
    AMX_PUT(1, 1, 0);
    AMX_PUT(3, 1, 1);
  }
}

static inline __attribute__((always_inline)) void amx_zero(void) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

// a filled panel (kb k-blocks a half) against input-row blocks [i0, i1) (xv: amx_inputs' tiles), 2 blocks at a time,
// into y at the panel's first output column
static void amx_pass(const uint16_t *xv, int64_t kb, const uint16_t *panel, int64_t i0, int64_t i1, int64_t m,
                     float *y, int64_t ldy, const float *bias, const __mmask16 *mask) {
  for (int64_t i = i0; i < i1; i += 2) {
    const int two = i + 1 < i1;
    amx_zero();
    amx_dots(xv + i * kb * 512, kb, panel, 0, kb, two);
    amx_store(i, two, m, y, ldy, bias, mask);
  }
}
