// logits[b, t] = -inf where bit (t % 32) of bitmask[b, t / 32] is 0; float32, in place.
//
// Grammar masks are mostly all-ones words (inside a JSON string almost every token is allowed)
// or all-zeros words (after a key almost none is), so whole words are skipped or filled at once;
// only mixed words are walked bit by bit. Rows are independent: one OpenMP thread per row block.
#include <math.h>
#include <stdint.h>

void apply_token_bitmask(float *logits, const int32_t *bitmask, int64_t batch, int64_t vocab,
                         int64_t logits_stride, int64_t mask_stride) {
  const int64_t words = (vocab + 31) / 32;
#pragma omp parallel for if (batch > 4) schedule(static)
  for (int64_t b = 0; b < batch; ++b) {
    float *row = logits + b * logits_stride;
    const uint32_t *mask = (const uint32_t *)(bitmask + b * mask_stride);
    for (int64_t w = 0; w < words; ++w) {
      uint32_t bits = mask[w];
      if (bits == 0xFFFFFFFFu) continue;
      const int64_t base = w * 32;
      const int64_t n = vocab - base < 32 ? vocab - base : 32;
      if (bits == 0) {
        for (int64_t j = 0; j < n; ++j) row[base + j] = -INFINITY;
        continue;
      }
      for (int64_t j = 0; j < n; ++j)
        if (!((bits >> j) & 1u)) row[base + j] = -INFINITY;
    }
  }
}
