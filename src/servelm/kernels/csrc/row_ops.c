/* Row-wise float32 ops of a Llama layer: RMSNorm (alone or after the residual add), rotary, SiLU(gate)
   * up, softmax. The `servelm_*_row` functions are what decode_layers.c runs inside its region; the
   `*_rows` entry points run them over T rows from Python (models/fused_ops.py's CPU set), the rows
   split over the threads, one pass over each row where torch makes several.

   Numerics against torch's float32 ops: rotary has apply_rotary's roundings exactly (four products,
   a difference and a sum); RMSNorm is x * (1 / sqrt(mean(x^2) + eps)) * w with the sum of squares in
   eight lanes; SiLU and softmax use simd.h's exp8_ps (within 2 ulp of expf) where torch uses its own
   vectorised exp; so those three may differ from torch's in the last bits. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "internal.h"
#include "simd.h"

void servelm_rms_norm_row(const float* x, const float* w, float* out, int64_t n, float eps) {
    float sum = 0.f;
    int64_t i = 0;
#ifdef SERVELM_HAVE_AVX2
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
    }
    sum = sum_lanes8(acc);
#endif
    for (; i < n; i++) sum += x[i] * x[i];
    const float inv = 1.f / sqrtf(sum / (float)n + eps);
    i = 0;
#ifdef SERVELM_HAVE_AVX2
    const __m256 vinv = _mm256_set1_ps(inv);
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), vinv), _mm256_loadu_ps(w + i)));
#endif
    for (; i < n; i++) out[i] = (x[i] * inv) * w[i];
}

void servelm_rotate_head(float* x, const float* cos, const float* sin, int64_t half) {
    for (int64_t i = 0; i < half; i++) {
        const float x1 = x[i], x2 = x[i + half];
        const float a = x1 * cos[i], b = x2 * sin[i], c = x2 * cos[i], d = x1 * sin[i];
        x[i] = a - b;
        x[i + half] = c + d;
    }
}

void servelm_softmax_row(float* x, int64_t n) {
    float max = -INFINITY;
    for (int64_t i = 0; i < n; i++) max = x[i] > max ? x[i] : max;
    float sum = 0.f;
    int64_t i = 0;
#ifdef SERVELM_HAVE_AVX2
    const __m256 vmax = _mm256_set1_ps(max);
    __m256 vsum = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        const __m256 e = exp8_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), vmax));
        _mm256_storeu_ps(x + i, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    sum = sum_lanes8(vsum);
#endif
    for (; i < n; i++) {
        x[i] = expf(x[i] - max);
        sum += x[i];
    }
    const float inv = 1.f / sum;
    for (i = 0; i < n; i++) x[i] *= inv;
}

void servelm_silu_mul_row(const float* gate, const float* up, float* act, int64_t n) {
    int64_t i = 0;
#ifdef SERVELM_HAVE_AVX2
    const __m256 one = _mm256_set1_ps(1.f);
    for (; i + 8 <= n; i += 8) {
        const __m256 g = _mm256_loadu_ps(gate + i);
        const __m256 e = exp8_ps(_mm256_sub_ps(_mm256_setzero_ps(), g));
        _mm256_storeu_ps(act + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), _mm256_loadu_ps(up + i)));
    }
#endif
    for (; i < n; i++) act[i] = (gate[i] / (1.f + expf(-gate[i]))) * up[i];
}

/* Rows per thread task: below this a row op is too small to be worth a second thread's wake-up. */
#define MIN_ROWS_PER_TASK 8

static int threads_for(int64_t rows, int num_threads) {
    const int64_t useful = (rows + MIN_ROWS_PER_TASK - 1) / MIN_ROWS_PER_TASK;
    return useful < num_threads ? (int)(useful > 0 ? useful : 1) : num_threads;
}

/* out[t] = rmsnorm(x[t] (+ residual[t])) * w for T rows of n; with residual, sum_out[t] = x[t] + residual[t]
   (may be residual itself: each row is read before it is written). */
void rms_norm_rows(const float* x, const float* residual, const float* w, float* out, float* sum_out, int64_t T,
                   int64_t n, float eps, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(threads_for(T, num_threads))
    for (int64_t t = 0; t < T; t++) {
        const float* row = x + t * n;
        if (residual) {
            float* s = sum_out + t * n;
            for (int64_t i = 0; i < n; i++) s[i] = row[i] + residual[t * n + i];
            row = s;
        }
        servelm_rms_norm_row(row, w, out + t * n, n, eps);
    }
}

/* act[t] = silu(gate_up[t, :I]) * gate_up[t, I:] for T rows. */
void silu_mul_rows(const float* gate_up, float* act, int64_t T, int64_t I, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(threads_for(T, num_threads))
    for (int64_t t = 0; t < T; t++) servelm_silu_mul_row(gate_up + t * 2 * I, gate_up + t * 2 * I + I, act + t * I, I);
}

/* Rotates, in place, `heads` heads of D at the start of each of T rows (row stride `stride` floats) by
   that row's cos / sin [T, D/2]. */
void rotate_rows(float* x, int64_t T, int64_t heads, int64_t D, int64_t stride, const float* cos, const float* sin,
                 int num_threads) {
#pragma omp parallel for schedule(static) num_threads(threads_for(T, num_threads))
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < heads; h++) servelm_rotate_head(x + t * stride + h * D, cos + t * D / 2, sin + t * D / 2, D / 2);
}
