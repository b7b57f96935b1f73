// Paged attention for CPU: each query attends to the first lens[i] keys of its slot row, read in
// place from the KV pool (no gather copy). Decode queries have one row each; prefill ("extend")
// tokens share their request's row and differ in how many keys they see, which is causal
// attention without a mask. One task per (query, kv head) covers that head's G grouped query
// heads, so each key row is read once for all of them; a query with more than PART_KEYS keys has one
// task per part of them, merged after (one decode stream's keys spread over the threads). q, out and
// the arithmetic are float32; K/V are float32, bfloat16 or float16 (widened on load). Threads take
// tasks dynamically.
//
// Batch- and cache-invariant: a query's scores, softmax and value sums run in an order fixed by
// its own key count alone, so its output is the same whatever else is in the batch, whether it
// is an extend token or a decode step, and wherever a cached prefix ends.
//
// Speed comes from keeping accumulators in registers: G is a compile-time constant in the
// specialised bodies (switch below), scores take four keys per pass, the value sum several
// output vectors per pass, and exp is a vector polynomial.
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "simd.h"
#include "simd_cvt.h"

typedef struct {
  const float *q;
  const void *k, *v;
  const int64_t *slots, *rows, *lens;
  float *out, *lse;
  int64_t heads, groups, dim, vdim, max_len, k_row, v_row, k_head, v_head;
  int64_t window;  // > 0: a query sees only its last `window` keys (sliding-window layers)
  float scale;
  float softcap;  // > 0: scores become softcap * tanh(score / softcap) (Gemma 2)
  int fmt;  // K/V storage format
} Args;

// a query's keys: its row from the first key its window lets it see (the row pointer moved on), and their count
static inline const int64_t *visible(const Args *a, int64_t qi, int64_t *n) {
  const int64_t *sl = a->slots + (a->rows ? a->rows[qi] : qi) * a->max_len;
  const int64_t first = a->window > 0 && a->lens[qi] > a->window ? a->lens[qi] - a->window : 0;
  *n = a->lens[qi] - first;
  return sl + first;
}

static inline void soft_cap(float *s, int64_t n, float cap) {
  const float inv = 1.f / cap;
  for (int64_t j = 0; j < n; ++j) s[j] = cap * tanhf(s[j] * inv);
}

// rows sit wherever their slots are: fetch a few ahead so the loads overlap the arithmetic
#define PREFETCH 16
#define VBLOCK 64  // value rows per block: 64 x 256 B (head size 64) stays in L1
#define ELEM(fmt) ((fmt) == FMT_F32 ? 4 : 2)
static inline void prefetch_row(const void *row, int64_t bytes) {
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch((const char *)row + i, 0, 1);
}

// the scalar path: any G, any head size
static inline __attribute__((always_inline)) void task_scalar(const Args *a, const int64_t *sl, int64_t n, int64_t h,
                                                             const float *qb, float *ob, float *lse, float *scores,
                                                             const int fmt) {
  const int64_t G = a->groups, D = a->dim, Dv = a->vdim;
  for (int64_t g = 0; g < G; ++g) {
    float mx = -INFINITY, sum = 0.f;
    for (int64_t j = 0; j < n; ++j) {
      const void *kr = at(a->k, h * a->k_head + sl[j] * a->k_row, fmt);
      float s = 0.f;
      for (int64_t d = 0; d < D; ++d) s += qb[g * D + d] * load1(kr, d, fmt);
      scores[j] = s * a->scale;
    }
    if (a->softcap > 0.f) soft_cap(scores, n, a->softcap);
    for (int64_t j = 0; j < n; ++j) mx = scores[j] > mx ? scores[j] : mx;
    for (int64_t j = 0; j < n; ++j) sum += (scores[j] = expf(scores[j] - mx));
    float *o = ob + g * Dv;
    memset(o, 0, sizeof(float) * (size_t)Dv);
    for (int64_t j = 0; j < n; ++j) {
      const void *vr = at(a->v, h * a->v_head + sl[j] * a->v_row, fmt);
      for (int64_t d = 0; d < Dv; ++d) o[d] += scores[j] * load1(vr, d, fmt);
    }
    for (int64_t d = 0; d < Dv; ++d) o[d] /= sum;
    lse[g] = mx + logf(sum);
  }
}

#ifdef __AVX2__
// scores[g * L + j] for j < n turned into softmax numerators in place, per query head g < G; each head's largest score
// and the numerators' sum
static inline void softmax_numerators(float *scores, int64_t L, int64_t n, int G, float *sums, float *maxs) {
  for (int g = 0; g < G; ++g) {
    float *s = scores + g * L;
    __m256 vmx = _mm256_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) vmx = _mm256_max_ps(vmx, _mm256_loadu_ps(s + i));
    float mx = hmax(vmx);
    for (; i < n; ++i) mx = s[i] > mx ? s[i] : mx;
    const __m256 m = _mm256_set1_ps(mx);
    __m256 tot = _mm256_setzero_ps();
    for (i = 0; i + 8 <= n; i += 8) {
      const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + i), m));
      _mm256_storeu_ps(s + i, e);
      tot = _mm256_add_ps(tot, e);
    }
    float sum = hsum(tot);
    for (; i < n; ++i) sum += (s[i] = expf(s[i] - mx));
    sums[g] = sum;
    maxs[g] = mx;
  }
}

// the vector bodies (attention_task.h) at eight lanes
#define VEC __m256
#define W 8
#define VLOADF load8
#define VLOADU _mm256_loadu_ps
#define VSTOREU _mm256_storeu_ps
#define VZERO _mm256_setzero_ps
#define VSET1 _mm256_set1_ps
#define VFMADD _mm256_fmadd_ps
#define VMUL _mm256_mul_ps
#define VSUM hsum
#define NV_OF(G) ((G) <= 2 ? 4 : ((G) <= 4 ? 2 : 1))  // within AVX2's 16 registers
#define VALUE_PASS value_pass
#define TASK task_vec
#include "attention_task.h"
#endif

#ifdef __AVX512F__
// the vector bodies at sixteen lanes: twice the multiply-adds an instruction, half the loads
#define VEC __m512
#define W 16
#define VLOADF load16
#define VLOADU _mm512_loadu_ps
#define VSTOREU _mm512_storeu_ps
#define VZERO _mm512_setzero_ps
#define VSET1 _mm512_set1_ps
#define VFMADD _mm512_fmadd_ps
#define VMUL _mm512_mul_ps
#define VSUM _mm512_reduce_add_ps
#define NV_OF(G) ((G) <= 4 ? 4 : 2)  // within AVX-512's 32 registers
#define VALUE_PASS value_pass512
#define TASK task_vec512
#include "attention_task.h"
#endif

// keys [j0, j0 + n) of one query's visible ones against kv head h: out [G, Dv] and lse [G], in storage format fmt (a
// compile-time constant at each call)
static inline __attribute__((always_inline)) void run_part_fmt(const Args *a, const int64_t *sl, int64_t n, int64_t qi,
                                                              int64_t h, float *ob, float *lse, float *scores,
                                                              const int fmt) {
  const float *qb = a->q + (qi * a->heads + h) * a->groups * a->dim;
// `task` specialised for the group size G (a compile-time constant in each case); G > 8 falls through
#define BY_GROUPS(task)                                                \
  switch (a->groups) {                                                 \
    case 1: task(a, sl, n, h, qb, ob, lse, scores, 1, fmt); return;    \
    case 2: task(a, sl, n, h, qb, ob, lse, scores, 2, fmt); return;    \
    case 3: task(a, sl, n, h, qb, ob, lse, scores, 3, fmt); return;    \
    case 4: task(a, sl, n, h, qb, ob, lse, scores, 4, fmt); return;    \
    case 5: task(a, sl, n, h, qb, ob, lse, scores, 5, fmt); return;    \
    case 6: task(a, sl, n, h, qb, ob, lse, scores, 6, fmt); return;    \
    case 7: task(a, sl, n, h, qb, ob, lse, scores, 7, fmt); return;    \
    case 8: task(a, sl, n, h, qb, ob, lse, scores, 8, fmt); return;    \
    default: break;                                                    \
  }
#ifdef __AVX512F__
  if (a->dim % 16 == 0 && a->vdim % 16 == 0) BY_GROUPS(task_vec512)
#endif
#ifdef __AVX2__
  if (a->dim % 8 == 0 && a->vdim % 8 == 0) BY_GROUPS(task_vec)
#endif
#undef BY_GROUPS
  task_scalar(a, sl, n, h, qb, ob, lse, scores, fmt);
}

static void run_part(const Args *a, const int64_t *sl, int64_t n, int64_t qi, int64_t h, float *ob, float *lse,
                     float *scores) {
  switch (a->fmt) {
    case FMT_BF16: run_part_fmt(a, sl, n, qi, h, ob, lse, scores, FMT_BF16); return;
    case FMT_F16: run_part_fmt(a, sl, n, qi, h, ob, lse, scores, FMT_F16); return;
    default: run_part_fmt(a, sl, n, qi, h, ob, lse, scores, FMT_F32); return;
  }
}

// A query that sees more than PART_KEYS keys attends to them in parts of PART_KEYS, each its own task, merged by
// their log-sum-exps in part order: the parts of one long row (a single decode stream) spread over the threads.
// Where the parts fall depends on the query's own key count alone, so the result stays batch-invariant.
#define PART_KEYS 256
// (query, head, part) tasks times keys below which a second thread costs more than it saves
#define MIN_KEYS_PER_THREAD 256

static inline int64_t parts_of(int64_t n) { return n > PART_KEYS ? (n + PART_KEYS - 1) / PART_KEYS : 1; }

// q [Nq, H, G, D]; k [H, S, D] and v [H, S, Dv] in format kv_fmt (slots k_row / v_row elements apart,
// heads k_head / v_head; head-major pools put one head's consecutive slots in one contiguous run); slots [R, L];
// rows [Nq] (query i reads slot row rows[i]; NULL: row i); lens [Nq] (>= 1 each); a query attends to its
// row's first lens[i] keys, the last `window` of them where window > 0, with scores soft-capped where softcap > 0;
// out [Nq, H, G, Dv]; lse [Nq, H, G].
void paged_attention(const float *q, const void *k, const void *v, const int64_t *slots, const int64_t *rows,
                     const int64_t *lens, float *out, float *lse, int64_t num_queries, int64_t heads,
                     int64_t groups, int64_t dim, int64_t vdim, int64_t max_len, int64_t k_row, int64_t v_row,
                     int64_t k_head, int64_t v_head, int64_t window, float scale, float softcap, int kv_fmt,
                     int threads) {
  const Args a = {q, k, v, slots, rows, lens, out, lse, heads, groups, dim, vdim, max_len, k_row, v_row, k_head,
                  v_head, window, scale, softcap, kv_fmt};
  // first[i]: query i's first part; parts [first[i], first[i + 1])
  int64_t *first = (int64_t *)malloc(sizeof(int64_t) * (size_t)(num_queries + 1)), keys = 0;
  if (!first) return;
  first[0] = 0;
  for (int64_t i = 0; i < num_queries; ++i) {
    int64_t n;
    visible(&a, i, &n);
    keys += n;
    first[i + 1] = first[i] + parts_of(n);
  }
  const int64_t parts = first[num_queries], tasks = parts * heads, G = groups;
  // a split query's parts land here before the merge: out [parts, H, G, Dv], lse [parts, H, G]
  float *part_out = NULL, *part_lse = NULL;
  if (parts > num_queries) {
    part_out = (float *)malloc(sizeof(float) * (size_t)(tasks * G * (vdim + 1)));
    if (!part_out) {
      free(first);
      return;
    }
    part_lse = part_out + tasks * G * vdim;
  }
  if (threads < 1) threads = 1;
  if (threads > tasks) threads = (int)tasks;
  if (keys * heads < (int64_t)threads * MIN_KEYS_PER_THREAD) threads = 1;
  // torch's OpenMP runtime (same soname, already loaded): its threads, not new ones per call.
  // Dynamic chunks (causal prefill tasks grow with the token's position), about eight a thread: a few tasks (one
  // decode stream's heads and parts) one at a time
  const int64_t chunk = tasks / (8 * threads) > 1 ? tasks / (8 * threads) : 1;
#pragma omp parallel num_threads(threads)
  {
    float *scores = (float *)malloc(sizeof(float) * (size_t)(groups * (max_len > 0 ? max_len : 1)));
#pragma omp for schedule(dynamic, chunk)
    for (int64_t t = 0; t < tasks; ++t) {
      const int64_t p = t / heads, h = t % heads;
      int64_t lo = 0, hi = num_queries;  // the query whose parts hold p
      while (hi - lo > 1) {
        const int64_t mid = (lo + hi) / 2;
        if (first[mid] <= p) lo = mid; else hi = mid;
      }
      const int64_t qi = lo, c = p - first[qi];
      int64_t n;
      const int64_t *sl = visible(&a, qi, &n);
      if (first[qi + 1] - first[qi] == 1) {
        run_part(&a, sl, n, qi, h, out + (qi * heads + h) * G * vdim, lse + (qi * heads + h) * G, scores);
      } else {
        const int64_t j0 = c * PART_KEYS, m = n - j0 < PART_KEYS ? n - j0 : PART_KEYS;
        run_part(&a, sl + j0, m, qi, h, part_out + t * G * vdim, part_lse + t * G, scores);
      }
    }
    free(scores);
    // each split query's parts merged, in part order: out = sum_c e^(lse_c - lse) out_c, lse = log sum_c e^lse_c
#pragma omp for schedule(static)
    for (int64_t t = 0; t < num_queries * heads; ++t) {
      const int64_t qi = t / heads, h = t % heads, p0 = first[qi], np = first[qi + 1] - p0;
      if (np == 1) continue;
      for (int64_t g = 0; g < G; ++g) {
        float mx = -INFINITY, sum = 0.f;
        for (int64_t c = 0; c < np; ++c) {
          const float l = part_lse[((p0 + c) * heads + h) * G + g];
          mx = l > mx ? l : mx;
        }
        float *o = out + ((qi * heads + h) * G + g) * vdim;
        memset(o, 0, sizeof(float) * (size_t)vdim);
        for (int64_t c = 0; c < np; ++c) {
          const int64_t pt = (p0 + c) * heads + h;
          const float w = expf(part_lse[pt * G + g] - mx);
          const float *oc = part_out + (pt * G + g) * vdim;
          sum += w;
          for (int64_t d = 0; d < vdim; ++d) o[d] += w * oc[d];
        }
        const float inv = 1.f / sum;
        for (int64_t d = 0; d < vdim; ++d) o[d] *= inv;
        lse[(qi * heads + h) * G + g] = mx + logf(sum);
      }
    }
  }
  free(part_out);
  free(first);
}
