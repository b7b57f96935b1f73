// A decode step's whole stack of decoder layers in one call: the same kernels the Python layer loop calls
// (quant_linear with its fused prologues, rope_store, paged_attention, rms_norm), in the same order on the same
// inputs, so the result is the loop's bit for bit. At decode sizes a layer's kernels take tens of microseconds
// and the Python between them about as long; here nothing runs between them.
#include "quant_linear.c"
#include "paged_attention.c"
#include "fused_ops.c"

// one matmul weight in the kernel's layout: y [m, n] = x [m, k] W^T (+ bias)
typedef struct {
  const void *w;
  const float *bias;  // NULL: none
  int64_t n, k;
  int64_t fmt;  // Q8_0 .. Q6_K
  int64_t exact;  // int16 activations (quant_linear's exact path), else int8
} Mat;

// a projection: one weight, or up to three side by side in formats of their own (a Q4_K_M file's Q4_K q and k
// beside its Q6_K v: runtime/layers/quantization.py's MixedMethod), then `bias` over all of them
typedef struct {
  Mat part[3];
  int64_t parts;
  const float *bias;  // with several parts; NULL: none (one part carries its own)
} Proj;

// one layer's weights and KV (ctypes mirrors these in kernels/cpu_decode.py)
typedef struct {
  Proj qkv, gate_up;
  Mat o, down;
  const float *input_norm, *post_norm;
  const float *attn_out_norm, *mlp_out_norm;  // Gemma's norms after each sublayer; NULL: none
  void *k_pool, *v_pool;                      // [Hkv, S, D] each
  int64_t k_row, k_head, v_row, v_head;       // element strides of a slot and of a head
  int64_t window;                             // > 0: a sliding-window layer (sees its last `window` keys)
  int64_t slot_set;                           // which of the step's slot sets its K/V live in (0: full, 1: window)
  int64_t rope_set;                           // which of the step's rotary tables it rotates by (0: full, 1: local)
  float softcap;
  const float *q_norm, *k_norm;  // per-head RMS norms of q and k [head_dim] before RoPE; NULL: none
} Layer;

// a LoRA adapter's pair for one shard of a projection (q, k or v of qkv; gate or up; o; down): A [r, k] and
// (scaling * B)^T [r, n], added to the projection's output columns [off, off + n); a == NULL: none
typedef struct {
  const float *a, *bt;
  int64_t r, off, n;
} LoraPair;

#define LORA_PARTS 3  // shards per projection in the table

// the batch: `rows` decode tokens, one per request
typedef struct {
  int64_t rows, hidden, heads, kv_heads, head_dim;
  const float *cos[2], *sin[2];    // [rows, D] per rotary table
  const int64_t *out_slots[2];     // [rows]: where each token's K/V go, per slot set
  const int64_t *kv_slots[2];      // [rows, max_len]: each request's keys, per slot set
  const int64_t *kv_lens;          // [rows]
  int64_t max_len;
  int64_t kv_fmt, act;             // FMT_F32 / FMT_BF16; 0: SiLU, 1: GELU (tanh)
  float eps, scale;
  int64_t threads, invariant;
  // LoRA adapters (runtime/lora): lora[((layer * 4 + projection) * lora_k + adapter) * LORA_PARTS + shard] for
  // projections qkv, o, gate_up, down; lora_row[row]: the row's adapter (-1: none); NULL lora: the base model only
  const LoraPair *lora;
  const int64_t *lora_row;
  int64_t lora_k, lora_rmax;
} Step;

// y [m, n] += B (A in_r) for each row r run with an adapter that has pairs for this projection (`pairs`: the step's
// `count` adapters' LORA_PARTS shards for it): a segmented low-rank product. `order` lists the rows grouped by
// adapter, adapter a's from start[a] to start[a + 1], so each pair is read once for all its rows. Two loops shared
// by the threads, one barrier between them: A's rows of every (adapter, shard) into tmp [m, LORA_PARTS, rmax], then
// B^T's columns in runs of 64, each row adding them to its outputs in place.
static void lora_add(const LoraPair *pairs, int64_t count, const int64_t *order, const int64_t *start,
                     const float *in, int64_t k, float *y, int64_t n, float *tmp, int64_t rmax, int threads) {
  const int64_t chunks = (n + 63) / 64, stride = LORA_PARTS * rmax;
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int64_t w = 0; w < count * LORA_PARTS * rmax; ++w) {
      const int64_t ad = w / stride, part = w / rmax % LORA_PARTS, i = w % rmax;
      const LoraPair *p = &pairs[ad * LORA_PARTS + part];
      const int64_t first = start[ad], rows = start[ad + 1] - first;
      if (!p->a || i >= p->r) continue;
      const float *ar = p->a + i * k;
      for (int64_t c = 0; c < rows; ++c) {
        const float *xr = in + order[first + c] * k;
        float acc = 0.f;
#pragma omp simd reduction(+ : acc)
        for (int64_t j = 0; j < k; ++j) acc += ar[j] * xr[j];
        tmp[(first + c) * stride + part * rmax + i] = acc;
      }
    }
#pragma omp for schedule(static)
    for (int64_t w = 0; w < count * LORA_PARTS * chunks; ++w) {
      const int64_t ad = w / (LORA_PARTS * chunks), part = w / chunks % LORA_PARTS, j0 = w % chunks * 64;
      const LoraPair *p = &pairs[ad * LORA_PARTS + part];
      const int64_t first = start[ad], rows = start[ad + 1] - first;
      if (!p->a || j0 >= p->n) continue;
      const int64_t width = p->n - j0 < 64 ? p->n - j0 : 64;
      for (int64_t c = 0; c < rows; ++c) {
        const float *t = tmp + (first + c) * stride + part * rmax;
        float acc[64] = {0.f};  // the run's sums in registers, added to the row once
        for (int64_t i = 0; i < p->r; ++i) {
          const float ti = t[i], *bt = p->bt + i * p->n + j0;
#pragma omp simd
          for (int64_t jj = 0; jj < width; ++jj) acc[jj] += ti * bt[jj];
        }
        float *yr = y + order[first + c] * n + p->off + j0;
#pragma omp simd
        for (int64_t jj = 0; jj < width; ++jj) yr[jj] += acc[jj];
      }
    }
  }
}

// the projection's output width: its parts' side by side
static int64_t proj_width(const Proj *p) {
  int64_t n = 0;
  for (int64_t i = 0; i < p->parts; ++i) n += p->part[i].n;
  return n;
}

// y [m, n] = prologue(x) [m, k] times the projection. Several parts take the prologue once, as MixedMethod does
// (fused_ops.c's rms_norm / add_rms_norm into `normed`), then each part as is into `part`, copied into its columns.
static void project(const Proj *p, float *x, int64_t m, int64_t k, int prologue, const float *norm_w, float eps,
                    const float *residual, float *y, float *normed, float *part, int threads, int invariant) {
  if (p->parts == 1) {
    const Mat *a = &p->part[0];
    quant_linear(x, a->w, a->bias, y, m, a->n, k, (int)a->fmt, prologue, norm_w, eps, residual, threads, invariant,
                 (int)a->exact);
    return;
  }
  float *in = x;
  if (prologue == RMS_NORM) {
    rms_norm(x, norm_w, normed, m, k, eps, threads);
    in = normed;
  } else if (prologue == ADD_RMS_NORM) {
    add_rms_norm(x, residual, norm_w, normed, m, k, eps, threads);
    in = normed;
  }
  const int64_t n = proj_width(p);
  int64_t off = 0;
  for (int64_t i = 0; i < p->parts; ++i) {
    const Mat *a = &p->part[i];
    quant_linear(in, a->w, a->bias, part, m, a->n, k, (int)a->fmt, AS_IS, NULL, 0.f, NULL, threads, invariant,
                 (int)a->exact);
    for (int64_t r = 0; r < m; ++r) memcpy(y + r * n + off, part + r * a->n, sizeof(float) * (size_t)a->n);
    off += a->n;
  }
  if (p->bias)
    for (int64_t r = 0; r < m; ++r)
      for (int64_t j = 0; j < n; ++j) y[r * n + j] += p->bias[j];
}

// x [rows, hidden], the residual stream, carried through `count` layers in place. Returns 0, or -1 when scratch
// memory could not be had (x is then unchanged only if the first allocation failed; the caller raises).
int decode_layers(const Layer *layers, int64_t count, const Step *s, float *x) {
  const int64_t m = s->rows, h = s->hidden, d = s->head_dim, hq = s->heads, hkv = s->kv_heads;
  int64_t widest = 0;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t a = proj_width(&layers[i].qkv), b = proj_width(&layers[i].gate_up);
    widest = a > widest ? a : widest;
    widest = b > widest ? b : widest;
  }
  // wide: qkv or gate | up (part: one part of it); q: rotated queries; attn: attention output; y: o_proj /
  // down_proj output; normed: a normed input; post: a sublayer's output normed (Gemma)
  const int64_t rmax = s->lora ? s->lora_rmax : 0;
  float *buf = (float *)malloc(sizeof(float) * (size_t)(m * (2 * widest + 2 * hq * d + hq + 3 * h + LORA_PARTS * rmax)));
  if (!buf) return -1;
  float *wide = buf, *part = wide + m * widest, *q = part + m * widest, *attn = q + m * hq * d;
  float *lse = attn + m * hq * d, *y = lse + m * hq, *normed = y + m * h, *post = normed + m * h;
  float *lora_tmp = post + m * h;
  const int threads = (int)s->threads, invariant = (int)s->invariant;
  // with adapters: the rows grouped by adapter (the same for every layer), and each projection's input made whole
  // (the kernels fuse it into their matmul otherwise)
  int64_t *order = NULL, *start = NULL;
  if (s->lora) {
    order = (int64_t *)malloc(sizeof(int64_t) * (size_t)(m + s->lora_k + 1));
    if (!order) {
      free(buf);
      return -1;
    }
    start = order + m;
    int64_t at = 0;
    for (int64_t ad = 0; ad < s->lora_k; ++ad) {
      start[ad] = at;
      for (int64_t r = 0; r < m; ++r)
        if (s->lora_row[r] == ad) order[at++] = r;
    }
    start[s->lora_k] = at;
  }
#define LORA(proj, in, k, out, n) \
  lora_add(s->lora + (i * 4 + (proj)) * s->lora_k * LORA_PARTS, s->lora_k, order, start, in, k, out, n, lora_tmp, \
           rmax, threads)
  for (int64_t i = 0; i < count; ++i) {
    const Layer *l = &layers[i];
    // a window layer's slots are the window set where the batch has one (the pool keeps every token otherwise)
    const int64_t set = l->slot_set && s->out_slots[1] ? 1 : 0, rs = l->rope_set;
    project(&l->qkv, x, m, h, RMS_NORM, l->input_norm, s->eps, NULL, wide, normed, part, threads, invariant);
    if (s->lora) {
      rms_norm(x, l->input_norm, normed, m, h, s->eps, threads);
      LORA(0, normed, h, wide, proj_width(&l->qkv));
    }
    if (l->q_norm) {
      const int64_t width = (hq + 2 * hkv) * d;
      head_rms_norm(wide, m, width, hq, d, l->q_norm, s->eps, threads);
      head_rms_norm(wide + hq * d, m, width, hkv, d, l->k_norm, s->eps, threads);
    }
    rope_store(wide, s->cos[rs], s->sin[rs], q, l->k_pool, l->v_pool, s->out_slots[set], m, hq, hkv, d, l->k_row,
               l->k_head, l->v_row, l->v_head, (int)s->kv_fmt, threads);
    paged_attention(q, l->k_pool, l->v_pool, s->kv_slots[set], NULL, s->kv_lens, attn, lse, m, hkv, hq / hkv, d, d,
                    s->max_len, l->k_row, l->v_row, l->k_head, l->v_head, l->window, s->scale, l->softcap,
                    (int)s->kv_fmt, threads);
    quant_linear(attn, l->o.w, l->o.bias, y, m, h, hq * d, (int)l->o.fmt, AS_IS, NULL, 0.f, NULL, threads, invariant,
                 (int)l->o.exact);
    if (s->lora) LORA(1, attn, hq * d, y, h);
    const float *residual = y;
    if (l->attn_out_norm) {
      rms_norm(y, l->attn_out_norm, post, m, h, s->eps, threads);
      residual = post;
    }
    // x += residual, then gate | up of its norm
    project(&l->gate_up, x, m, h, ADD_RMS_NORM, l->post_norm, s->eps, residual, wide, normed, part, threads,
            invariant);
    if (s->lora) {  // x now holds the sum
      rms_norm(x, l->post_norm, normed, m, h, s->eps, threads);
      LORA(2, normed, h, wide, proj_width(&l->gate_up));
    }
    quant_linear(wide, l->down.w, l->down.bias, y, m, h, l->down.k, (int)l->down.fmt, s->act ? GELU_MUL : SILU_MUL,
                 NULL, 0.f, NULL, threads, invariant, (int)l->down.exact);
    if (s->lora) {
      (s->act ? gelu_mul : silu_mul)(wide, part, m, l->down.k, threads);
      LORA(3, part, l->down.k, y, h);
    }
    const float *mlp = y;
    if (l->mlp_out_norm) {
      rms_norm(y, l->mlp_out_norm, post, m, h, s->eps, threads);
      mlp = post;
    }
#pragma omp simd
    for (int64_t j = 0; j < m * h; ++j) x[j] += mlp[j];
  }
#undef LORA
  free(order);
  free(buf);
  return 0;
}
