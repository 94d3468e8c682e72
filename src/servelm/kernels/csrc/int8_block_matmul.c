/* A small-batch matmul against int8-coded weights: y[M, N] = x[M, K] . W[N, K]^T for a few rows
   of x (a decode step of a few requests), reading the weights as int8 codes plus per-32 scales:

       W[n, k] = d[n, k / 32] * q[n, k]   (+ m[n, k / 32] when has_min)

   Product and sum are rounded separately (built with -ffp-contract=off), exactly as the float32
   weights were made from the same codes (servelm/models/compact_weights.py), so this is the
   float32 matmul reading under a third of the bytes. Threads split N; every output is one
   thread's sum in a fixed order, so results do not depend on the thread count.

   Shapes: x [M, K]; q [N, K]; d and m [N, K / 32]; y [M, N]; K a multiple of 32. m is read even
   without has_min (it is then d again: same shape). The Python wrapper (servelm/kernels/cpu.py)
   checks all of that before calling. */
#include <stdint.h>

#include "simd.h"

#ifdef SERVELM_HAVE_AVX2
/* Eight weights of one 32-block from their int8 codes: d * q (+ m for Q4_1), rounded as the
   checkpoint's float32 values were. */
static inline __m256 dequant8(const int8_t* q, __m256 vd, __m256 vm, int has_min) {
    const __m256 w = _mm256_mul_ps(vd, load_int8x8_ps(q));
    return has_min ? _mm256_add_ps(w, vm) : w;
}
#endif

void qgemm_small(const float* x, const int8_t* q, const float* d, const float* m, float* y,
                 int64_t M, int64_t N, int64_t K, int has_min, int num_threads) {
    const int64_t nb = K / 32;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t n = 0; n < N; n++) {
        const int8_t* qr = q + n * K;
        const float* dr = d + n * nb;
        const float* mr = m + n * nb;
        for (int64_t r0 = 0; r0 < M; r0 += 4) {
            const int64_t rows = M - r0 < 4 ? M - r0 : 4;
#ifdef SERVELM_HAVE_AVX2
            if (rows == 1) { /* one row: four independent FMA chains, one per group of 8 */
                const float* xr = x + r0 * K;
                __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
                for (int64_t j = 0; j < nb; j++) {
                    const __m256 vd = _mm256_set1_ps(dr[j]), vm = _mm256_set1_ps(mr[j]);
                    for (int g = 0; g < 4; g++) {
                        const __m256 w = dequant8(qr + j * 32 + g * 8, vd, vm, has_min);
                        a[g] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + j * 32 + g * 8), w, a[g]);
                    }
                }
                y[r0 * N + n] = sum_lanes8(_mm256_add_ps(_mm256_add_ps(a[0], a[2]), _mm256_add_ps(a[1], a[3])));
                continue;
            }
            __m256 acc[4][2];
            for (int r = 0; r < 4; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
            for (int64_t j = 0; j < nb; j++) {
                const __m256 vd = _mm256_set1_ps(dr[j]), vm = _mm256_set1_ps(mr[j]);
                for (int g = 0; g < 4; g++) {
                    const __m256 w = dequant8(qr + j * 32 + g * 8, vd, vm, has_min);
                    for (int64_t r = 0; r < rows; r++)
                        acc[r][g & 1] = _mm256_fmadd_ps(_mm256_loadu_ps(x + (r0 + r) * K + j * 32 + g * 8), w, acc[r][g & 1]);
                }
            }
            for (int64_t r = 0; r < rows; r++) y[(r0 + r) * N + n] = sum_lanes8(_mm256_add_ps(acc[r][0], acc[r][1]));
#else
            for (int64_t r = 0; r < rows; r++) {
                float acc = 0.f;
                for (int64_t k = 0; k < K; k++) {
                    float w = dr[k / 32] * (float)qr[k];
                    if (has_min) w = w + mr[k / 32];
                    acc += x[(r0 + r) * K + k] * w;
                }
                y[(r0 + r) * N + n] = acc;
            }
#endif
        }
    }
}
