/* A mixture-of-experts layer's routed experts for a few tokens (decode steps), float32 weights, in one
   call: what models/moe.py's loop does per expert (gather its tokens, gate|up GEMM, SiLU, down GEMM,
   weight, index_add), without ~5 torch ops and a Python iteration per expert. At batch 16 with 64
   experts top-2 a step touches ~26 experts per layer, each for a row or two: the loop's dispatch,
   not its FLOPs, was what made the MoE step 3.1-3.5x the dense one (benchmarks/moe.py, AMD Zen 4).

   The (token, expert) pairs come sorted by expert: pair p is token pair_token[p] with routing weight
   pair_weight[p], and local expert e's pairs are [offsets[e], offsets[e + 1]). Two phases, each one
   parallel loop, every weight row read once and used for all of its expert's pairs:

       act[p, i] = silu(gate_e[i] . x[t]) * (up_e[i] . x[t])      tasks: (expert, 16 rows of I)
       out[t, h] += w_p * (down_e[h] . act[p])                     tasks: 16 rows of H, every expert

   Phase 2 gives each thread whole output columns for every token, so no two threads add into one
   value, and a value's terms are added in expert order, pair order: the result never depends on
   the thread count. `out` [T, H] is accumulated into (the caller zeroes it). gate_up [E, 2I, H]
   (gate rows, then up rows), down [E, H, I]; scratch gate_up_rows [P, 2I], act [P, I]. */
#include <stdint.h>
#include <stdlib.h>

#include "internal.h"
#include "simd.h"

#define MOE_ROWS_PER_TASK 16

/* Four accumulators: a GEMV row streams from memory, and one FMA chain would stall on its latency. */
static float moe_dot(const float* a, const float* b, int64_t n) {
    int64_t i = 0;
    float sum = 0.f;
#ifdef SERVELM_HAVE_AVX2
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps(), acc2 = _mm256_setzero_ps(),
           acc3 = _mm256_setzero_ps();
    for (; i + 32 <= n; i += 32) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
        acc2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 16), _mm256_loadu_ps(b + i + 16), acc2);
        acc3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 24), _mm256_loadu_ps(b + i + 24), acc3);
    }
    for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    sum = sum_lanes8(_mm256_add_ps(_mm256_add_ps(acc0, acc1), _mm256_add_ps(acc2, acc3)));
#endif
    for (; i < n; i++) sum += a[i] * b[i];
    return sum;
}

/* Returns -1, or (having written nothing) the first pair whose token is outside [0, T), or -2 when
   the offsets do not rise from 0. */
int64_t moe_experts(const float* x, const float* gate_up, const float* down, const int64_t* pair_token,
                    const float* pair_weight, const int64_t* offsets, float* out, float* gate_up_rows, float* act,
                    int64_t T, int64_t H, int64_t I, int64_t E, int num_threads) {
    if (offsets[0] != 0) return -2;
    for (int64_t e = 0; e < E; e++)
        if (offsets[e + 1] < offsets[e]) return -2;
    const int64_t P = offsets[E];
    for (int64_t p = 0; p < P; p++)
        if (pair_token[p] < 0 || pair_token[p] >= T) return p;
    int64_t* active = malloc((size_t)(E > 0 ? E : 1) * sizeof(int64_t)); /* experts with pairs, in id order */
    if (active == NULL) return -3;
    int64_t num_active = 0;
    for (int64_t e = 0; e < E; e++)
        if (offsets[e + 1] > offsets[e]) active[num_active++] = e;
    const int64_t i_tasks = (I + MOE_ROWS_PER_TASK - 1) / MOE_ROWS_PER_TASK;
    const int64_t h_tasks = (H + MOE_ROWS_PER_TASK - 1) / MOE_ROWS_PER_TASK;
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t task = 0; task < num_active * i_tasks; task++) {
            const int64_t e = active[task / i_tasks], i0 = (task % i_tasks) * MOE_ROWS_PER_TASK;
            const int64_t i1 = i0 + MOE_ROWS_PER_TASK < I ? i0 + MOE_ROWS_PER_TASK : I;
            const float* w = gate_up + e * 2 * I * H;
            for (int64_t i = i0; i < i1; i++) {
                for (int64_t p = offsets[e]; p < offsets[e + 1]; p++) {
                    const float* xt = x + pair_token[p] * H;
                    gate_up_rows[p * 2 * I + i] = moe_dot(w + i * H, xt, H);
                    gate_up_rows[p * 2 * I + I + i] = moe_dot(w + (I + i) * H, xt, H);
                }
            }
            for (int64_t p = offsets[e]; p < offsets[e + 1]; p++)
                servelm_silu_mul_row(gate_up_rows + p * 2 * I + i0, gate_up_rows + p * 2 * I + I + i0, act + p * I + i0,
                                     i1 - i0);
        }
#pragma omp for schedule(static)
        for (int64_t task = 0; task < h_tasks; task++) {
            const int64_t h0 = task * MOE_ROWS_PER_TASK, h1 = h0 + MOE_ROWS_PER_TASK < H ? h0 + MOE_ROWS_PER_TASK : H;
            for (int64_t a = 0; a < num_active; a++) {
                const int64_t e = active[a];
                const float* w = down + e * H * I;
                for (int64_t p = offsets[e]; p < offsets[e + 1]; p++) {
                    float* o = out + pair_token[p] * H;
                    for (int64_t h = h0; h < h1; h++) o[h] += pair_weight[p] * moe_dot(w + h * I, act + p * I, I);
                }
            }
        }
    }
    free(active);
    return -1;
}
