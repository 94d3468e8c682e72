/* Batched LoRA, row by row (Punica's BGMV): every row of a forward adds its own adapter's delta, in
   one call for the whole batch whatever the number of adapters in it.

   For each row t whose slot s = row_slots[t] is >= 0 (negative: a base-model row, untouched):
       h[:w]    = A[s, :w] . x[t]                  A  [slots, W, in]: w dots over `in`
       out[t]  += sum_j h[j] * Bt[s, j]            Bt [slots, W, out]: w AXPYs over `out`
   with w = widths[s] (the columns the slot's adapter uses) and the scaling folded into Bt. Only the
   columns a row's adapter uses are computed: what the adapters need, nothing for the other slots
   (servelm/lora/layers.py keeps a per-segment torch path for long prompts). Rows are independent:
   threads split them, SERVELM_LORA_ROWS_PER_TASK at a time, and a run of four rows of one adapter
   shares each load of its weights. A dot accumulates in eight lanes summed in a fixed order, so a
   row's result never depends on the batch it came in, the run it fell in or the thread count. */
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

/* h[j] = A[j] . x for the w columns: eight columns at a time share each load of x, each column
   keeping its own eight-lane accumulator (eight independent FMA chains instead of one), summed as
   lora_dot always did, so a column's value is the same whichever group it falls in. */
static void lora_dots(const float* a, const float* x, float* h, int64_t w, int64_t n) {
    int64_t j = 0;
#ifdef SERVELM_HAVE_AVX2
    for (; j + 8 <= w; j += 8) {
        const float* rows = a + j * n;
        __m256 acc[8];
        for (int c = 0; c < 8; c++) acc[c] = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 8 <= n; i += 8) {
            const __m256 xv = _mm256_loadu_ps(x + i);
            for (int c = 0; c < 8; c++) acc[c] = _mm256_fmadd_ps(_mm256_loadu_ps(rows + c * n + i), xv, acc[c]);
        }
        for (int c = 0; c < 8; c++) {
            float sum = sum_lanes8(acc[c]);
            for (int64_t k = i; k < n; k++) sum += rows[c * n + k] * x[k];
            h[j + c] = sum;
        }
    }
#endif
    for (; j < w; j++) h[j] = lora_dot(a + j * n, x, n);
}

/* y[:n] += sum_j h[j] * bt[j * ld :][:n], j in order: a block of y stays in registers across the w
   columns (one load and one store of y instead of w), each element summed in the same order as w
   AXPYs. `ld`: Bt's row stride (n for a whole row; more for the tail of one). */
static void lora_axpys(float* y, const float* bt, int64_t ld, const float* h, int64_t w, int64_t n) {
    int64_t i = 0;
#ifdef SERVELM_HAVE_AVX2
    for (; i + 32 <= n; i += 32) {
        __m256 y0 = _mm256_loadu_ps(y + i), y1 = _mm256_loadu_ps(y + i + 8);
        __m256 y2 = _mm256_loadu_ps(y + i + 16), y3 = _mm256_loadu_ps(y + i + 24);
        for (int64_t j = 0; j < w; j++) {
            const __m256 hj = _mm256_set1_ps(h[j]);
            const float* b = bt + j * ld + i;
            y0 = _mm256_fmadd_ps(hj, _mm256_loadu_ps(b), y0);
            y1 = _mm256_fmadd_ps(hj, _mm256_loadu_ps(b + 8), y1);
            y2 = _mm256_fmadd_ps(hj, _mm256_loadu_ps(b + 16), y2);
            y3 = _mm256_fmadd_ps(hj, _mm256_loadu_ps(b + 24), y3);
        }
        _mm256_storeu_ps(y + i, y0);
        _mm256_storeu_ps(y + i + 8, y1);
        _mm256_storeu_ps(y + i + 16, y2);
        _mm256_storeu_ps(y + i + 24, y3);
    }
    for (; i + 8 <= n; i += 8) {
        __m256 yv = _mm256_loadu_ps(y + i);
        for (int64_t j = 0; j < w; j++) yv = _mm256_fmadd_ps(_mm256_set1_ps(h[j]), _mm256_loadu_ps(bt + j * ld + i), yv);
        _mm256_storeu_ps(y + i, yv);
    }
#endif
    for (; i < n; i++) {
        float v = y[i];
        for (int64_t j = 0; j < w; j++) v += h[j] * bt[j * ld + i];
        y[i] = v;
    }
}

#ifdef SERVELM_HAVE_AVX2
/* Four rows of one adapter at once: each load of A or Bt serves the four rows (one row at a time,
   8 decode rows re-read the slot's 0.65 MB per layer from L2 eight times over; per row and column
   the sums are the one-row kernel's, in its order, so grouping never changes a value). x and y rows
   are `in` and `out` apart; h rows `hs` apart. */
#define QUAD 4
static void lora_dots4(const float* a, const float* x, float* h, int64_t hs, int64_t w, int64_t n) {
    int64_t j = 0;
    for (; j + 2 <= w; j += 2) {
        const float* a0 = a + j * n;
        const float* a1 = a0 + n;
        __m256 acc[QUAD][2];
        for (int r = 0; r < QUAD; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 8 <= n; i += 8) {
            const __m256 va0 = _mm256_loadu_ps(a0 + i), va1 = _mm256_loadu_ps(a1 + i);
            for (int r = 0; r < QUAD; r++) {
                const __m256 xv = _mm256_loadu_ps(x + r * n + i);
                acc[r][0] = _mm256_fmadd_ps(va0, xv, acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(va1, xv, acc[r][1]);
            }
        }
        for (int r = 0; r < QUAD; r++) {
            const float* xr = x + r * n;
            float s0 = sum_lanes8(acc[r][0]), s1 = sum_lanes8(acc[r][1]);
            for (int64_t k = i; k < n; k++) s0 += a0[k] * xr[k];
            for (int64_t k = i; k < n; k++) s1 += a1[k] * xr[k];
            h[r * hs + j] = s0;
            h[r * hs + j + 1] = s1;
        }
    }
    for (; j < w; j++)
        for (int r = 0; r < QUAD; r++) h[r * hs + j] = lora_dot(a + j * n, x + r * n, n);
}

static void lora_axpys4(float* y, const float* bt, const float* h, int64_t hs, int64_t w, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256 acc[QUAD][2];
        for (int r = 0; r < QUAD; r++) {
            acc[r][0] = _mm256_loadu_ps(y + r * n + i);
            acc[r][1] = _mm256_loadu_ps(y + r * n + i + 8);
        }
        for (int64_t j = 0; j < w; j++) {
            const __m256 b0 = _mm256_loadu_ps(bt + j * n + i), b1 = _mm256_loadu_ps(bt + j * n + i + 8);
            for (int r = 0; r < QUAD; r++) {
                const __m256 hj = _mm256_set1_ps(h[r * hs + j]);
                acc[r][0] = _mm256_fmadd_ps(hj, b0, acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(hj, b1, acc[r][1]);
            }
        }
        for (int r = 0; r < QUAD; r++) {
            _mm256_storeu_ps(y + r * n + i, acc[r][0]);
            _mm256_storeu_ps(y + r * n + i + 8, acc[r][1]);
        }
    }
    if (i < n)  /* the rest of each row as the one-row kernel takes it: same per-element order */
        for (int r = 0; r < QUAD; r++) lora_axpys(y + r * n + i, bt + i, n, h + r * hs, w, n - i);
}
#endif

/* One row's delta, y[:out] += sum_j (A[j] . x) * Bt[j] over the w columns its adapter uses; h [w] is
   scratch. */
static void lora_row(const float* x, float* y, const float* a, const float* bt, int64_t w, int64_t in, int64_t out,
                     float* h) {
    lora_dots(a, x, h, w, in);
    lora_axpys(y, bt, out, h, w, out);
}

void servelm_lora_task(const float* x, float* y, const float* a, const float* bt, const int64_t* row_slots,
                       const int64_t* widths, int64_t W, int64_t in, int64_t out, float* h, int64_t hs, int64_t task,
                       int64_t num_rows) {
    const int64_t b0 = task * SERVELM_LORA_ROWS_PER_TASK;
    const int64_t b1 = b0 + SERVELM_LORA_ROWS_PER_TASK < num_rows ? b0 + SERVELM_LORA_ROWS_PER_TASK : num_rows;
    int64_t b = b0;
    while (b < b1) {
        const int64_t slot = row_slots[b];
        if (slot < 0) {
            b++;
            continue;
        }
        const float* sa = a + slot * W * in;
        const float* sb = bt + slot * W * out;
#ifdef SERVELM_HAVE_AVX2
        if (b + QUAD <= b1 && row_slots[b + 1] == slot && row_slots[b + 2] == slot && row_slots[b + 3] == slot) {
            lora_dots4(sa, x + b * in, h + b * hs, hs, widths[slot], in);
            lora_axpys4(y + b * out, sb, h + b * hs, hs, widths[slot], out);
            b += QUAD;
            continue;
        }
#endif
        lora_row(x + b * in, y + b * out, sa, sb, widths[slot], in, out, h + b * hs);
        b++;
    }
}

/* h [T, W] is the caller's scratch. Threads take SERVELM_LORA_ROWS_PER_TASK consecutive rows each. */
void lora_bgmv(const float* x, float* out, const float* a, const float* bt, const int64_t* row_slots,
               const int64_t* widths, float* h, int64_t T, int64_t in, int64_t out_features, int64_t W,
               int num_threads) {
    const int64_t tasks = SERVELM_LORA_TASKS(T);
    const int threads = tasks < num_threads ? (int)(tasks > 0 ? tasks : 1) : num_threads;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < tasks; t++) servelm_lora_task(x, out, a, bt, row_slots, widths, W, in, out_features, h, W, t, T);
}
