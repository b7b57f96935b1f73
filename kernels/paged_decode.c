// Paged decode attention for CPU: each query attends to its request's keys where they lie in the
// KV pool (slot indices), with no gather copy. One task per (request, kv head) covers that head's
// grouped queries, so each key row is read once for all of them. Float32; threads split the tasks.
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "simd.h"

typedef struct {
  const float *q, *k, *v;
  const int64_t *slots, *lens;
  float *out, *lse;
  int64_t heads, groups, dim, vdim, max_len, k_row, v_row;
  float scale;
  int64_t begin, end;
} Task;

// rows sit wherever their slots are: fetch a few ahead so the loads overlap the arithmetic
#define PREFETCH 4
static inline void prefetch_row(const float *row, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) __builtin_prefetch(row + i, 0, 1);
}

static void run(const Task *t) {
  const int64_t G = t->groups, D = t->dim, Dv = t->vdim, L = t->max_len;
  float *scores = (float *)malloc(sizeof(float) * (size_t)(G * (L > 0 ? L : 1)));
  float *maxs = (float *)malloc(sizeof(float) * (size_t)G);
  float *sums = (float *)malloc(sizeof(float) * (size_t)G);
  for (int64_t bh = t->begin; bh < t->end; ++bh) {
    const int64_t b = bh / t->heads, h = bh % t->heads;
    const int64_t n = t->lens[b];
    const int64_t *sl = t->slots + b * L;
    const float *qb = t->q + bh * G * D;
    for (int64_t g = 0; g < G; ++g) maxs[g] = -INFINITY;
    for (int64_t j = 0; j < n; ++j) {
      const float *kr = t->k + sl[j] * t->k_row + h * D;
      if (j + PREFETCH < n) prefetch_row(t->k + sl[j + PREFETCH] * t->k_row + h * D, D);
#ifdef __AVX2__
      if (D % 8 == 0 && G <= 8) {  // the key row is loaded once for all G queries, G independent FMA chains
        __m256 acc[8];
        for (int64_t g = 0; g < G; ++g) acc[g] = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8) {
          const __m256 kv = _mm256_loadu_ps(kr + d);
          for (int64_t g = 0; g < G; ++g) acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qb + g * D + d), kv, acc[g]);
        }
        for (int64_t g = 0; g < G; ++g) {
          const float s = hsum(acc[g]) * t->scale;
          scores[g * L + j] = s;
          if (s > maxs[g]) maxs[g] = s;
        }
        continue;
      }
#endif
      for (int64_t g = 0; g < G; ++g) {
        const float *qg = qb + g * D;
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int64_t d = 0; d < D; ++d) s += qg[d] * kr[d];
        s *= t->scale;
        scores[g * L + j] = s;
        if (s > maxs[g]) maxs[g] = s;
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      float sum = 0.f;
      for (int64_t j = 0; j < n; ++j) {
        const float p = expf(scores[g * L + j] - maxs[g]);
        scores[g * L + j] = p;
        sum += p;
      }
      sums[g] = sum;
    }
    float *ob = t->out + bh * G * Dv;
    memset(ob, 0, sizeof(float) * (size_t)(G * Dv));
    for (int64_t j = 0; j < n; ++j) {
      const float *vr = t->v + sl[j] * t->v_row + h * Dv;
      if (j + PREFETCH < n) prefetch_row(t->v + sl[j + PREFETCH] * t->v_row + h * Dv, Dv);
      for (int64_t g = 0; g < G; ++g) {
        const float p = scores[g * L + j];
        float *o = ob + g * Dv;
#pragma omp simd
        for (int64_t d = 0; d < Dv; ++d) o[d] += p * vr[d];
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      const float inv = 1.f / sums[g];
      float *o = ob + g * Dv;
      for (int64_t d = 0; d < Dv; ++d) o[d] *= inv;
      t->lse[bh * G + g] = maxs[g] + logf(sums[g]);
    }
  }
  free(scores);
  free(maxs);
  free(sums);
}

// q [B, H, G, D]; k [S, H, D] and v [S, H, Dv] (rows k_row / v_row floats apart); slots [B, L];
// lens [B] (>= 1 each); out [B, H, G, Dv]; lse [B, H, G].
void paged_decode_attention(const float *q, const float *k, const float *v, const int64_t *slots,
                            const int64_t *lens, float *out, float *lse, int64_t batch, int64_t heads,
                            int64_t groups, int64_t dim, int64_t vdim, int64_t max_len, int64_t k_row,
                            int64_t v_row, float scale, int threads) {
  const int64_t tasks = batch * heads;
  if (threads < 1) threads = 1;
  if (threads > tasks) threads = (int)tasks;
  // torch's OpenMP runtime (same soname, already loaded): its threads, not new ones per call
#pragma omp parallel num_threads(threads)
  {
    const int parts = omp_get_num_threads(), part = omp_get_thread_num();
    Task t = {q, k, v, slots, lens, out, lse, heads, groups, dim, vdim, max_len, k_row, v_row, scale,
              tasks * part / parts, tasks * (part + 1) / parts};
    run(&t);
  }
}
