// The vector bodies of paged attention (paged_attention.c), written once for any vector width: the includer
// defines VEC (the vector type), W (its float lanes), VLOADF (W elements of a K/V row in storage format fmt, as
// float32), VLOADU, VSTOREU, VZERO, VSET1, VFMADD, VMUL, VSUM (the sum of the lanes), NV_OF(G) (output vectors per
// value pass for G query heads), and the names VALUE_PASS and TASK; this file defines the two functions and undefines
// them all, so it can be included once per width.
// ob[g, d0 : d0 + W NV] += sum over keys j0 <= i < j1 of p_gi v_i[d0 : d0 + W NV]; G and NV are compile-time
// constants at every call, so the accumulators stay in registers
static inline __attribute__((always_inline)) void VALUE_PASS(float *ob, const void *vb, const int64_t *sl,
                                                            int64_t vr, const float *scores, int64_t L, int64_t j0,
                                                            int64_t j1, int64_t n, int64_t Dv, int64_t d0,
                                                            const int G, const int NV, const int fmt) {
  VEC acc[8][4];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NV; ++c) acc[g][c] = VLOADU(ob + g * Dv + d0 + W * c);
  for (int64_t i = j0; i < j1; ++i) {
    const void *v0 = at(vb, sl[i] * vr + d0, fmt);
    if (d0 == 0 && i + PREFETCH < n) prefetch_row(at(vb, sl[i + PREFETCH] * vr, fmt), Dv * ELEM(fmt));
    VEC y[4];
    for (int c = 0; c < NV; ++c) y[c] = VLOADF(at(v0, W * c, fmt), fmt);
    for (int g = 0; g < G; ++g) {
      const VEC p = VSET1(scores[g * L + i]);
      for (int c = 0; c < NV; ++c) acc[g][c] = VFMADD(p, y[c], acc[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NV; ++c) VSTOREU(ob + g * Dv + d0 + W * c, acc[g][c]);
}

// one (query, kv head) task over keys sl[0 .. n) with G known at compile time; needs D % W == 0 and Dv % W == 0
static inline __attribute__((always_inline)) void TASK(const Args *a, const int64_t *sl, int64_t n, int64_t h,
                                                      const float *qb, float *ob, float *lse, float *scores,
                                                      const int G, const int fmt) {
  const int64_t D = a->dim, Dv = a->vdim, L = a->max_len;
  const void *kb = at(a->k, h * a->k_head, fmt), *vb = at(a->v, h * a->v_head, fmt);
  const int64_t kr = a->k_row, vr = a->v_row;
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {  // scores, four keys at a time
    const void *k0 = at(kb, sl[j] * kr, fmt), *k1 = at(kb, sl[j + 1] * kr, fmt), *k2 = at(kb, sl[j + 2] * kr, fmt),
               *k3 = at(kb, sl[j + 3] * kr, fmt);
    for (int64_t p = j + PREFETCH; p < j + PREFETCH + 4 && p < n; ++p) prefetch_row(at(kb, sl[p] * kr, fmt), D * ELEM(fmt));
    VEC acc[8][4];  // G <= 8; fixed size so it stays in registers
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < 4; ++c) acc[g][c] = VZERO();
    for (int64_t d = 0; d < D; d += W) {
      const VEC x0 = VLOADF(at(k0, d, fmt), fmt), x1 = VLOADF(at(k1, d, fmt), fmt),
                   x2 = VLOADF(at(k2, d, fmt), fmt), x3 = VLOADF(at(k3, d, fmt), fmt);
      for (int g = 0; g < G; ++g) {
        const VEC qv = VLOADU(qb + g * D + d);
        acc[g][0] = VFMADD(qv, x0, acc[g][0]);
        acc[g][1] = VFMADD(qv, x1, acc[g][1]);
        acc[g][2] = VFMADD(qv, x2, acc[g][2]);
        acc[g][3] = VFMADD(qv, x3, acc[g][3]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < 4; ++c) scores[g * L + j + c] = VSUM(acc[g][c]) * a->scale;
  }
  for (; j < n; ++j) {
    const void *k0 = at(kb, sl[j] * kr, fmt);
    VEC acc[8];
    for (int g = 0; g < G; ++g) acc[g] = VZERO();
    for (int64_t d = 0; d < D; d += W) {
      const VEC x0 = VLOADF(at(k0, d, fmt), fmt);
      for (int g = 0; g < G; ++g) acc[g] = VFMADD(VLOADU(qb + g * D + d), x0, acc[g]);
    }
    for (int g = 0; g < G; ++g) scores[g * L + j] = VSUM(acc[g]) * a->scale;
  }
  if (a->softcap > 0.f)
    for (int g = 0; g < G; ++g) soft_cap(scores + g * L, n, a->softcap);
  float sums[8], maxs[8];
  softmax_numerators(scores, L, n, G, sums, maxs);
  // out_g = sum_j p_gj v_j / sum_g: NV output vectors per pass over the keys (G * NV accumulators plus NV value
  // loads fit the vector registers); keys go in blocks small enough that the later passes over a block find its
  // value rows in L1
  const int NV = NV_OF(G);
  memset(ob, 0, sizeof(float) * (size_t)(G * Dv));
  for (int64_t j0 = 0; j0 < n; j0 += VBLOCK) {
    const int64_t j1 = j0 + VBLOCK < n ? j0 + VBLOCK : n;
    int64_t d0 = 0;
    for (; d0 + W * NV <= Dv; d0 += W * NV) VALUE_PASS(ob, vb, sl, vr, scores, L, j0, j1, n, Dv, d0, G, NV, fmt);
    for (; d0 < Dv; d0 += W) VALUE_PASS(ob, vb, sl, vr, scores, L, j0, j1, n, Dv, d0, G, 1, fmt);
  }
  for (int g = 0; g < G; ++g) {
    const VEC inv = VSET1(1.f / sums[g]);
    for (int64_t d = 0; d < Dv; d += W)
      VSTOREU(ob + g * Dv + d, VMUL(VLOADU(ob + g * Dv + d), inv));
  }
  for (int g = 0; g < G; ++g) lse[g] = maxs[g] + logf(sums[g]);
}
#undef VEC
#undef W
#undef VLOADF
#undef VLOADU
#undef VSTOREU
#undef VZERO
#undef VSET1
#undef VFMADD
#undef VMUL
#undef VSUM
#undef NV_OF
#undef VALUE_PASS
#undef TASK
