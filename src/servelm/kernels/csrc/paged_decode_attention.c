/* Paged decode attention on CPU: reads each request's K/V straight from the block pool.

   A decode step of B requests must read every request's whole K/V once per layer. Gathering them
   into a padded [B, max_len] copy for SDPA touches the data three times (plus the padding); this
   walks each request's block table and reads each K/V row once:

       scores[b, h, l] = scale * q[b, h] . K[slot(b, l), h / G]        decode_scores
       probs           = softmax(scores) over l                        (torch, in the wrapper)
       out[b, h]       = sum_l probs[b, h, l] * V[slot(b, l), h / G]   decode_pv

       slot(b, l) = block_tables[b][l / bs] * bs + l % bs,   G = H / KVH

   Shapes: q [B, H, D]; pool [num_blocks, bs, KVH, D] (the K or the V half of one layer);
   block_tables [B, max_blocks]; seq_lens [B]; scores and probs [B, H, max_len]; out [B, H, D].

   The pool holds float32 values, or (--kv-cache-dtype int8) int8 codes with a float32 scale per
   (token, KV head), pool_scales [num_blocks, bs, KVH], value = code * scale. A NULL pool_scales
   means float32. With codes, a score is (q . codes) * (scale * row scale), and a V row's weight is
   probs * row scale: one multiply per row, the same byte reads as the values would need / 4.
   Work is split by request; a batch smaller than the thread count splits by KV head too.
   Rows are visited block by block: one table lookup per block, each K/V row read once for
   all the query heads that share it.

   The Python wrapper (servelm/kernels/cpu.py) checks dtypes, shapes and contiguity; decode_scores
   checks every length and used table entry before reading through them, so no read here can land
   outside the pool. */
#include <math.h>
#include <stdint.h>

#include "internal.h"
#include "simd.h"

#ifdef SERVELM_HAVE_AVX2
/* Sum each of 8 vectors' lanes: result lane r = sum of v[r]. */
static inline __m256 hsum8(__m256 v0, __m256 v1, __m256 v2, __m256 v3, __m256 v4, __m256 v5, __m256 v6, __m256 v7) {
    __m256 s01 = _mm256_hadd_ps(v0, v1), s23 = _mm256_hadd_ps(v2, v3);
    __m256 s45 = _mm256_hadd_ps(v4, v5), s67 = _mm256_hadd_ps(v6, v7);
    __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
    /* lanes: s0123 = [r0 r1 r2 r3 | r0 r1 r2 r3] halves of each sum, likewise s4567 for r4..r7 */
    __m256 lo = _mm256_permute2f128_ps(s0123, s4567, 0x20), hi = _mm256_permute2f128_ps(s0123, s4567, 0x31);
    return _mm256_add_ps(lo, hi);
}
#endif

/* Scores of query head h against n (<= bs) consecutive rows of one block. */
static inline void scores_rows(const float* qh, const float* rows, int64_t row_stride, int64_t n, int64_t D,
                               float scale, float* out) {
    int64_t o = 0;
#ifdef SERVELM_HAVE_AVX2
    if (D % 8 == 0) {
        const __m256 vscale = _mm256_set1_ps(scale);
        for (; o + 8 <= n; o += 8) {
            const float* r = rows + o * row_stride;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
            for (int64_t d = 0; d < D; d += 8) {
                const __m256 qv = _mm256_loadu_ps(qh + d);
                a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(r + 0 * row_stride + d), a0);
                a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(r + 1 * row_stride + d), a1);
                a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(r + 2 * row_stride + d), a2);
                a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(r + 3 * row_stride + d), a3);
                a4 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(r + 4 * row_stride + d), a4);
                a5 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(r + 5 * row_stride + d), a5);
                a6 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(r + 6 * row_stride + d), a6);
                a7 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(r + 7 * row_stride + d), a7);
            }
            _mm256_storeu_ps(out + o, _mm256_mul_ps(hsum8(a0, a1, a2, a3, a4, a5, a6, a7), vscale));
        }
    }
#endif
    for (; o < n; o++) {
        const float* k = rows + o * row_stride;
        float acc = 0.f;
        for (int64_t d = 0; d < D; d++) acc += qh[d] * k[d];
        out[o] = acc * scale;
    }
}

/* scores_rows for int8 codes: row o's score is (q . codes_o) * (scale * row_scales[o * scale_stride]). */
static inline void scores_rows_q8(const float* qh, const int8_t* rows, const float* row_scales, int64_t row_stride,
                                  int64_t scale_stride, int64_t n, int64_t D, float scale, float* out) {
    int64_t o = 0;
#ifdef SERVELM_HAVE_AVX2
    if (D % 8 == 0) {
        const __m256 vscale = _mm256_set1_ps(scale);
        for (; o + 8 <= n; o += 8) {
            const int8_t* r = rows + o * row_stride;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
            for (int64_t d = 0; d < D; d += 8) {
                const __m256 qv = _mm256_loadu_ps(qh + d);
                a0 = _mm256_fmadd_ps(qv, load_int8x8_ps(r + 0 * row_stride + d), a0);
                a1 = _mm256_fmadd_ps(qv, load_int8x8_ps(r + 1 * row_stride + d), a1);
                a2 = _mm256_fmadd_ps(qv, load_int8x8_ps(r + 2 * row_stride + d), a2);
                a3 = _mm256_fmadd_ps(qv, load_int8x8_ps(r + 3 * row_stride + d), a3);
                a4 = _mm256_fmadd_ps(qv, load_int8x8_ps(r + 4 * row_stride + d), a4);
                a5 = _mm256_fmadd_ps(qv, load_int8x8_ps(r + 5 * row_stride + d), a5);
                a6 = _mm256_fmadd_ps(qv, load_int8x8_ps(r + 6 * row_stride + d), a6);
                a7 = _mm256_fmadd_ps(qv, load_int8x8_ps(r + 7 * row_stride + d), a7);
            }
            const float* sc = row_scales + o * scale_stride;
            const __m256 vrow = _mm256_setr_ps(sc[0], sc[scale_stride], sc[2 * scale_stride], sc[3 * scale_stride],
                                               sc[4 * scale_stride], sc[5 * scale_stride], sc[6 * scale_stride],
                                               sc[7 * scale_stride]);
            const __m256 sums = hsum8(a0, a1, a2, a3, a4, a5, a6, a7);
            _mm256_storeu_ps(out + o, _mm256_mul_ps(sums, _mm256_mul_ps(vscale, vrow)));
        }
    }
#endif
    for (; o < n; o++) {
        const int8_t* k = rows + o * row_stride;
        float acc = 0.f;
        for (int64_t d = 0; d < D; d++) acc += qh[d] * (float)k[d];
        out[o] = acc * (scale * row_scales[o * scale_stride]);
    }
}

/* out_h[0:D] += sum over n rows of p[o] * row_o. */
static inline void pv_rows(const float* p, const float* rows, int64_t row_stride, int64_t n, int64_t D, float* outh) {
    int64_t d = 0;
#ifdef SERVELM_HAVE_AVX2
    for (; d + 32 <= D; d += 32) {
        __m256 a0 = _mm256_loadu_ps(outh + d), a1 = _mm256_loadu_ps(outh + d + 8);
        __m256 a2 = _mm256_loadu_ps(outh + d + 16), a3 = _mm256_loadu_ps(outh + d + 24);
        for (int64_t o = 0; o < n; o++) {
            const float* v = rows + o * row_stride + d;
            const __m256 pv = _mm256_set1_ps(p[o]);
            a0 = _mm256_fmadd_ps(pv, _mm256_loadu_ps(v), a0);
            a1 = _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + 8), a1);
            a2 = _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + 16), a2);
            a3 = _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + 24), a3);
        }
        _mm256_storeu_ps(outh + d, a0); _mm256_storeu_ps(outh + d + 8, a1);
        _mm256_storeu_ps(outh + d + 16, a2); _mm256_storeu_ps(outh + d + 24, a3);
    }
#endif
    for (; d < D; d++) {
        float acc = outh[d];
        for (int64_t o = 0; o < n; o++) acc += p[o] * rows[o * row_stride + d];
        outh[d] = acc;
    }
}

/* pv_rows for int8 codes: row o weighs p[o] * row_scales[o * scale_stride]. */
static inline void pv_rows_q8(const float* p, const int8_t* rows, const float* row_scales, int64_t row_stride,
                              int64_t scale_stride, int64_t n, int64_t D, float* outh) {
    int64_t d = 0;
#ifdef SERVELM_HAVE_AVX2
    for (; d + 32 <= D; d += 32) {
        __m256 a0 = _mm256_loadu_ps(outh + d), a1 = _mm256_loadu_ps(outh + d + 8);
        __m256 a2 = _mm256_loadu_ps(outh + d + 16), a3 = _mm256_loadu_ps(outh + d + 24);
        for (int64_t o = 0; o < n; o++) {
            const int8_t* v = rows + o * row_stride + d;
            const __m256 pv = _mm256_set1_ps(p[o] * row_scales[o * scale_stride]);
            a0 = _mm256_fmadd_ps(pv, load_int8x8_ps(v), a0);
            a1 = _mm256_fmadd_ps(pv, load_int8x8_ps(v + 8), a1);
            a2 = _mm256_fmadd_ps(pv, load_int8x8_ps(v + 16), a2);
            a3 = _mm256_fmadd_ps(pv, load_int8x8_ps(v + 24), a3);
        }
        _mm256_storeu_ps(outh + d, a0); _mm256_storeu_ps(outh + d + 8, a1);
        _mm256_storeu_ps(outh + d + 16, a2); _mm256_storeu_ps(outh + d + 24, a3);
    }
#endif
    for (; d < D; d++) {
        float acc = outh[d];
        for (int64_t o = 0; o < n; o++) acc += (p[o] * row_scales[o * scale_stride]) * (float)rows[o * row_stride + d];
        outh[d] = acc;
    }
}

/* Ask for the next block while this one is computed: blocks sit anywhere in the pool. */
static inline void prefetch_block(const char* block, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(block + i, 0, 3);
}

pool_half servelm_pool_half(const void* pool, const float* scales) {
    pool_half half = {(const char*)pool, scales, scales ? 1 : 4};
    return half;
}

/* The first byte (row 0, head 0) of `block` in the pool. */
static inline const char* block_start(pool_half pool, int32_t block, int64_t bs, int64_t KVH, int64_t D) {
    return pool.base + (int64_t)block * bs * KVH * D * pool.element_size;
}

void servelm_scores_one(const float* q, pool_half k_pool, const int32_t* bt, int64_t L, float* sb,
                       int64_t kh0, int64_t kh1, int64_t H, int64_t KVH, int64_t D, int64_t bs,
                       int64_t max_len, float scale) {
    const int64_t G = H / KVH, block_bytes = bs * KVH * D * k_pool.element_size;
    for (int64_t start = 0; start < L; start += bs) {
        const int64_t n = L - start < bs ? L - start : bs;
        const char* block = block_start(k_pool, bt[start / bs], bs, KVH, D);
        if (start + bs < L) prefetch_block(block_start(k_pool, bt[start / bs + 1], bs, KVH, D), block_bytes);
        for (int64_t h = kh0 * G; h < kh1 * G; h++) {
            float* out = sb + h * max_len + start;
            if (k_pool.scales) {
                const float* row_scales = k_pool.scales + (int64_t)bt[start / bs] * bs * KVH + h / G;
                scores_rows_q8(q + h * D, (const int8_t*)block + (h / G) * D, row_scales, KVH * D, KVH, n, D, scale,
                               out);
            } else {
                scores_rows(q + h * D, (const float*)block + (h / G) * D, KVH * D, n, D, scale, out);
            }
        }
    }
    for (int64_t h = kh0 * G; h < kh1 * G; h++)
        for (int64_t l = L; l < max_len; l++) sb[h * max_len + l] = -INFINITY;
}

void servelm_pv_one(const float* pb, pool_half v_pool, const int32_t* bt, int64_t L, float* ob,
                   int64_t kh0, int64_t kh1, int64_t H, int64_t KVH, int64_t D, int64_t bs, int64_t max_len) {
    const int64_t G = H / KVH, block_bytes = bs * KVH * D * v_pool.element_size;
    for (int64_t i = kh0 * G * D; i < kh1 * G * D; i++) ob[i] = 0.f;
    for (int64_t start = 0; start < L; start += bs) {
        const int64_t n = L - start < bs ? L - start : bs;
        const char* block = block_start(v_pool, bt[start / bs], bs, KVH, D);
        if (start + bs < L) prefetch_block(block_start(v_pool, bt[start / bs + 1], bs, KVH, D), block_bytes);
        for (int64_t h = kh0 * G; h < kh1 * G; h++) {
            const float* p = pb + h * max_len + start;
            if (v_pool.scales) {
                const float* row_scales = v_pool.scales + (int64_t)bt[start / bs] * bs * KVH + h / G;
                pv_rows_q8(p, (const int8_t*)block + (h / G) * D, row_scales, KVH * D, KVH, n, D, ob + h * D);
            } else {
                pv_rows(p, (const float*)block + (h / G) * D, KVH * D, n, D, ob + h * D);
            }
        }
    }
}

/* The first request b whose decode would read outside the pool, or -1 when none would:
   every request needs 1 <= seq_lens[b] <= min(max_len, max_blocks * bs) and, for the
   ceil(seq_lens[b] / bs) blocks it reads, 0 <= block_tables[b][j] < num_blocks. */
int64_t servelm_first_invalid_request(const int32_t* block_tables, const int32_t* seq_lens, int64_t B,
                                     int64_t max_blocks, int64_t bs, int64_t max_len, int64_t num_blocks) {
    for (int64_t b = 0; b < B; b++) {
        const int64_t L = seq_lens[b];
        if (L < 1 || L > max_len || L > max_blocks * bs) return b;
        for (int64_t j = 0; j < (L + bs - 1) / bs; j++) {
            const int32_t block = block_tables[b * max_blocks + j];
            if (block < 0 || block >= num_blocks) return b;
        }
    }
    return -1;
}

/* Returns -1 after filling scores, or (reading nothing else, writing nothing) the first request
   whose seq_len or block ids fall outside the pool: decode_pv may then run on the same tables. */
int64_t decode_scores(const float* q, const void* k_pool, const float* k_scales, const int32_t* block_tables,
                      const int32_t* seq_lens,
                      float* scores, int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t bs,
                      int64_t max_blocks, int64_t max_len, int64_t num_blocks, float scale, int num_threads) {
    const int64_t bad = servelm_first_invalid_request(block_tables, seq_lens, B, max_blocks, bs, max_len, num_blocks);
    if (bad >= 0) return bad;
    const pool_half pool = servelm_pool_half(k_pool, k_scales);
    const int64_t split = B < num_threads ? KVH : 1; /* pieces per request */
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t item = 0; item < B * split; item++) {
        const int64_t b = item / split, piece = item % split;
        const int64_t kh0 = piece * KVH / split, kh1 = (piece + 1) * KVH / split;
        servelm_scores_one(q + b * H * D, pool, block_tables + b * max_blocks, seq_lens[b], scores + b * H * max_len,
                   kh0, kh1, H, KVH, D, bs, max_len, scale);
    }
    return -1;
}

void decode_pv(const float* probs, const void* v_pool, const float* v_scales, const int32_t* block_tables,
               const int32_t* seq_lens, float* out, int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t bs,
               int64_t max_blocks, int64_t max_len, int num_threads) {
    const pool_half pool = servelm_pool_half(v_pool, v_scales);
    const int64_t split = B < num_threads ? KVH : 1;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t item = 0; item < B * split; item++) {
        const int64_t b = item / split, piece = item % split;
        const int64_t kh0 = piece * KVH / split, kh1 = (piece + 1) * KVH / split;
        servelm_pv_one(probs + b * H * max_len, pool, block_tables + b * max_blocks, seq_lens[b], out + b * H * D,
               kh0, kh1, H, KVH, D, bs, max_len);
    }
}
