/* Batched LoRA, one row at a time (Punica's BGMV): every row of a forward adds its own adapter's
   delta, in one call for the whole batch whatever the number of adapters in it.

   For each row t whose slot s = row_slots[t] is >= 0 (negative: a base-model row, untouched):
       h[:w]    = A[s, :w] . x[t]                  A  [slots, W, in]: w dots over `in`
       out[t]  += sum_j h[j] * Bt[s, j]            Bt [slots, W, out]: w AXPYs over `out`
   with w = widths[s] (the columns the slot's adapter uses) and the scaling folded into Bt. Only the
   columns a row's adapter uses are computed: what the adapters need, nothing for the other slots
   (servelm/lora/layers.py keeps a per-segment torch path for long prompts). Rows are independent:
   threads split them. A dot accumulates in eight lanes summed in a fixed order, so a row's result
   never depends on the batch it came in or the thread count. */
#include <stdint.h>

#include "internal.h"
#include "simd.h"

static float lora_dot(const float* a, const float* b, int64_t n) {
    int64_t i = 0;
    float sum = 0.f;
#ifdef SERVELM_HAVE_AVX2
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    sum = sum_lanes8(acc);
#endif
    for (; i < n; i++) sum += a[i] * b[i];
    return sum;
}

/* y[:n] += alpha * x[:n] */
static void lora_axpy(float* y, const float* x, float alpha, int64_t n) {
    int64_t i = 0;
#ifdef SERVELM_HAVE_AVX2
    const __m256 va = _mm256_set1_ps(alpha);
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
#endif
    for (; i < n; i++) y[i] += alpha * x[i];
}

void servelm_lora_row(const float* x, float* y, const float* a, const float* bt, int64_t w, int64_t in, int64_t out,
                      float* h) {
    for (int64_t j = 0; j < w; j++) h[j] = lora_dot(a + j * in, x, in);
    for (int64_t j = 0; j < w; j++) lora_axpy(y, bt + j * out, h[j], out);
}

/* h [T, W] is the caller's scratch. */
void lora_bgmv(const float* x, float* out, const float* a, const float* bt, const int64_t* row_slots,
               const int64_t* widths, float* h, int64_t T, int64_t in, int64_t out_features, int64_t W,
               int num_threads) {
    const int threads = T < num_threads ? (int)(T > 0 ? T : 1) : num_threads;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < T; t++) {
        const int64_t s = row_slots[t];
        if (s < 0) continue;
        servelm_lora_row(x + t * in, out + t * out_features, a + s * W * in, bt + s * W * out_features, widths[s], in,
                         out_features, h + t * W);
    }
}
