/* Attention of a prompt chunk after cached context on CPU, read straight from the block pool.

   A chunk of Q new tokens after C cached ones attends to C + Q keys, causally within its own Q.
   Torch's path gathers the context out of the pool into one [C + Q, KVH, D] copy per layer and
   runs SDPA over it; its flash kernel expands the KV heads for every query head and, for the small
   chunks a step-time bound makes deep in a long prompt (64-256 tokens after thousands), spends much
   of its time re-reading keys for few queries. This is flash attention over the pool:

       for each KV head kh and each tile of TQ chunk positions (its G = H / KVH query heads each:
       R = TQ * G rows that read the same keys):
           for each tile of KT keys (from the blocks, in order; none past the tile's last position):
               S = Qs . K^T                      scores, the query rows pre-scaled
               causal mask on the keys past a row's own position
               m' = max(m, rowmax S); P = e^(S - m'); l = l e^(m - m') + rowsum P
               O = O e^(m - m') + P . V
           out = O / l

   so every key and value row is read once per tile of R rows, never copied per query head, and the
   context is never gathered. The key tile is transposed into a small buffer once and then read by
   every row (scores: three rows by 32 keys per register block; P . V: three rows by 32 of D).

   Shapes: q [Q, H, D] float32; pools [num_blocks, bs, KVH, D] float32 (the K or the V half of one
   layer); blocks [num_table_blocks] int32, the request's blocks in order (position p in block
   blocks[p / bs], row p % bs); out [Q, H, D]. Query i sits at position C + i and sees keys 0..C + i.
   Work is split by (KV head, query tile). Needs AVX2 + FMA and D a multiple of 8 (D <= MAX_D);
   `chunk_attention_supported` says whether this build has it. The Python wrapper
   (servelm/kernels/cpu.py) checks dtypes, shapes and contiguity; every length and used block id is
   checked here before any read, so no read can land outside the pool. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "simd.h"

#define KT 32       /* keys per tile: two default blocks */
/* Query rows per item (positions x the query heads sharing a KV head): what one register block covers
   (6 vectors). Two blocks per key tile (96 rows, reading the pool half as often) measured slower: their
   queries and outputs no longer fit L1 beside the tile. */
#define MAX_ROWS 48
#define MAX_D 256

int chunk_attention_supported(void) {
#ifdef SERVELM_HAVE_AVX2
    return 1;
#else
    return 0;
#endif
}

/* -1 when every position the chunk reads lies in the table and every block id it uses in the pool;
   else -2 (lengths) or the index of the first bad table entry. */
static int64_t first_invalid_block(const int32_t* blocks, int64_t num_table_blocks, int64_t num_keys, int64_t bs,
                                   int64_t num_blocks) {
    if (num_keys < 1 || num_keys > num_table_blocks * bs) return -2;
    for (int64_t j = 0; j < (num_keys + bs - 1) / bs; j++)
        if (blocks[j] < 0 || blocks[j] >= num_blocks) return j;
    return -1;
}

#ifdef SERVELM_HAVE_AVX2
typedef struct {
    int64_t H, KVH, D, bs, context, Q;
    float scale;
} chunk_shape;

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* St[j][0:8 NV] = K_j . Qt[:, 0:8 NV] for keys j of the tile (pairs of keys: 2 x NV accumulators). */
ALWAYS_INLINE void tile_scores(const float* Qt, const float* const* krows, float* St, int64_t D, int64_t RP, int NV) {
    for (int64_t j = 0; j < KT; j += 2) {
        const float *k0 = krows[j], *k1 = krows[j + 1];
        __m256 a0[6], a1[6];
        for (int v = 0; v < NV; v++) a0[v] = a1[v] = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d++) {
            const __m256 b0 = _mm256_broadcast_ss(k0 + d), b1 = _mm256_broadcast_ss(k1 + d);
            const float* qt = Qt + d * RP;
            for (int v = 0; v < NV; v++) {
                const __m256 qv = _mm256_loadu_ps(qt + 8 * v);
                a0[v] = _mm256_fmadd_ps(b0, qv, a0[v]);
                a1[v] = _mm256_fmadd_ps(b1, qv, a1[v]);
            }
        }
        for (int v = 0; v < NV; v++) {
            _mm256_storeu_ps(St + j * RP + 8 * v, a0[v]);
            _mm256_storeu_ps(St + (j + 1) * RP + 8 * v, a1[v]);
        }
    }
}

/* Ot[d][r] = Ot[d][r] alpha[r] + sum_j V_j[d] Pt[j][r], two of D at a time (2 x NV accumulators). */
ALWAYS_INLINE void tile_pv(const float* Pt, const float* const* vrows, float* Ot, const float* alpha, int64_t D,
                           int64_t RP, int NV) {
    __m256 va[6];
    for (int v = 0; v < NV; v++) va[v] = _mm256_loadu_ps(alpha + 8 * v);
    for (int64_t d = 0; d < D; d += 2) {
        float *o0 = Ot + d * RP, *o1 = o0 + RP;
        __m256 a0[6], a1[6];
        for (int v = 0; v < NV; v++) {
            a0[v] = _mm256_mul_ps(_mm256_loadu_ps(o0 + 8 * v), va[v]);
            a1[v] = _mm256_mul_ps(_mm256_loadu_ps(o1 + 8 * v), va[v]);
        }
        for (int64_t j = 0; j < KT; j++) {
            const __m256 b0 = _mm256_broadcast_ss(vrows[j] + d), b1 = _mm256_broadcast_ss(vrows[j] + d + 1);
            const float* p = Pt + j * RP;
            for (int v = 0; v < NV; v++) {
                const __m256 pv = _mm256_loadu_ps(p + 8 * v);
                a0[v] = _mm256_fmadd_ps(b0, pv, a0[v]);
                a1[v] = _mm256_fmadd_ps(b1, pv, a1[v]);
            }
        }
        for (int v = 0; v < NV; v++) {
            _mm256_storeu_ps(o0 + 8 * v, a0[v]);
            _mm256_storeu_ps(o1 + 8 * v, a1[v]);
        }
    }
}

/* The online softmax over one tile, eight rows a vector: St becomes Pt = e^(S - m'), with keys past a
   row's position (key index > pos[r]) or past the tile's n keys at 0; m, l updated; alpha[r] =
   e^(m - m') for the output's rescale. */
ALWAYS_INLINE void tile_softmax(float* St, float* m, float* l, float* alpha, const float* pos, int64_t j0,
                                int64_t n, int masked, int64_t RP, int NV) {
    const __m256 minus_inf = _mm256_set1_ps(-INFINITY);
    for (int v = 0; v < NV; v++) {
        const __m256 vpos = _mm256_loadu_ps(pos + 8 * v);
        __m256 mx = minus_inf;
        for (int64_t j = 0; j < KT; j++) {
            __m256 s = _mm256_loadu_ps(St + j * RP + 8 * v);
            if (j >= n) {
                s = minus_inf;
            } else if (masked) {
                const __m256 hidden = _mm256_cmp_ps(_mm256_set1_ps((float)(j0 + j)), vpos, _CMP_GT_OQ);
                s = _mm256_blendv_ps(s, minus_inf, hidden);
            }
            _mm256_storeu_ps(St + j * RP + 8 * v, s);
            mx = _mm256_max_ps(mx, s);
        }
        const __m256 m_old = _mm256_loadu_ps(m + 8 * v);
        const __m256 m_new = _mm256_max_ps(m_old, mx); /* finite: key 0 is in every row's first tile */
        const __m256 a = exp8_ps(_mm256_sub_ps(m_old, m_new)); /* -inf - x clamps to 0 */
        __m256 sum = _mm256_setzero_ps();
        for (int64_t j = 0; j < KT; j++) {
            const __m256 e = exp8_ps(_mm256_sub_ps(_mm256_loadu_ps(St + j * RP + 8 * v), m_new));
            _mm256_storeu_ps(St + j * RP + 8 * v, e);
            sum = _mm256_add_ps(sum, e);
        }
        _mm256_storeu_ps(l + 8 * v, _mm256_fmadd_ps(_mm256_loadu_ps(l + 8 * v), a, sum));
        _mm256_storeu_ps(m + 8 * v, m_new);
        _mm256_storeu_ps(alpha + 8 * v, a);
    }
}

/* One (KV head, query tile) item: rows r = pi * G + g are position i0 + pi, query head kh * G + g;
   padded to RP = 8 NV rows (zero queries at the last real position, dropped at the end). Each
   key tile is read from the pool once for all rows. */
ALWAYS_INLINE void chunk_tile_nv(const float* q, const float* k_pool, const float* v_pool, const int32_t* blocks,
                                 float* out, chunk_shape sh, int64_t kh, int64_t i0, int64_t i1, float* work,
                                 const float* zeros, int NV) {
    /* RP a constant wherever NV is: every offset into the tile buffers folds at compile time */
    const int64_t G = sh.H / sh.KVH, D = sh.D, R = (i1 - i0) * G, RP = 8 * NV, row_stride = sh.KVH * D;
    float* Qt = work;                  /* [D][RP] */
    float* Ot = Qt + MAX_D * MAX_ROWS; /* [D][RP] */
    float* St = Ot + MAX_D * MAX_ROWS; /* [KT][RP] */
    float m[MAX_ROWS], l[MAX_ROWS], alpha[MAX_ROWS], pos[MAX_ROWS];
    const float* krows[KT];
    const float* vrows[KT];
    for (int64_t r = 0; r < RP; r++) {
        const int64_t pi = r < R ? r / G : (R - 1) / G;
        const float* src = q + ((i0 + pi) * sh.H + kh * G + (r < R ? r % G : 0)) * D;
        for (int64_t d = 0; d < D; d++) {
            Qt[d * RP + r] = r < R ? src[d] * sh.scale : 0.f;
            Ot[d * RP + r] = 0.f;
        }
        m[r] = -INFINITY;
        l[r] = 0.f;
        pos[r] = (float)(sh.context + i0 + pi);
    }
    const int64_t num_keys = sh.context + i1; /* the tile's last position sees keys 0..context + i1 - 1 */
    const int64_t first_masked = sh.context + i0 + 1; /* keys from here on are hidden from some row */
    for (int64_t j0 = 0; j0 < num_keys; j0 += KT) {
        const int64_t n = num_keys - j0 < KT ? num_keys - j0 : KT;
        for (int64_t j = 0; j < KT; j++) {
            if (j < n) {
                const int64_t p = j0 + j;
                const int64_t slot = (int64_t)blocks[p / sh.bs] * sh.bs + p % sh.bs;
                krows[j] = k_pool + slot * row_stride + kh * D;
                vrows[j] = v_pool + slot * row_stride + kh * D;
            } else {
                krows[j] = vrows[j] = zeros;
            }
        }
        /* The next tile's rows sit anywhere in the pool: ask for them while this one is computed. */
        for (int64_t p = j0 + KT; p < j0 + 2 * KT && p < num_keys; p++) {
            const int64_t slot = (int64_t)blocks[p / sh.bs] * sh.bs + p % sh.bs;
            const char* k = (const char*)(k_pool + slot * row_stride + kh * D);
            const char* v = (const char*)(v_pool + slot * row_stride + kh * D);
            for (int64_t b = 0; b < D * (int64_t)sizeof(float); b += 64) {
                __builtin_prefetch(k + b, 0, 3);
                __builtin_prefetch(v + b, 0, 3);
            }
        }
        const int masked = j0 + KT > first_masked;
        tile_scores(Qt, krows, St, D, RP, NV);
        tile_softmax(St, m, l, alpha, pos, j0, n, masked, RP, NV);
        tile_pv(St, vrows, Ot, alpha, D, RP, NV);
    }
    for (int64_t r = 0; r < R; r++) {
        float* dst = out + ((i0 + r / G) * sh.H + kh * G + r % G) * D;
        const float inv = 1.f / l[r];
        for (int64_t d = 0; d < D; d++) dst[d] = Ot[d * RP + r] * inv;
    }
}

static void chunk_tile(const float* q, const float* k_pool, const float* v_pool, const int32_t* blocks, float* out,
                       chunk_shape sh, int64_t kh, int64_t i0, int64_t i1, float* work, const float* zeros) {
    switch (((i1 - i0) * (sh.H / sh.KVH) + 7) / 8) { /* a constant vector count: accumulators in registers */
#define TILE_CASE(NV) \
    case NV: chunk_tile_nv(q, k_pool, v_pool, blocks, out, sh, kh, i0, i1, work, zeros, NV); break;
        TILE_CASE(1) TILE_CASE(2) TILE_CASE(3) TILE_CASE(4) TILE_CASE(5)
        default: chunk_tile_nv(q, k_pool, v_pool, blocks, out, sh, kh, i0, i1, work, zeros, 6); break;
#undef TILE_CASE
    }
}
#endif

/* Returns -1 after writing out; -2 when context + Q keys exceed the table (or Q < 1), the index of
   the first table entry outside [0, num_blocks), or -3 when this build or these shapes are not
   supported (G > MAX_ROWS, D not a multiple of 8 or over MAX_D): then nothing is read or written. */
int64_t chunk_attention(const float* q, const float* k_pool, const float* v_pool, const int32_t* blocks, float* out,
                        int64_t num_table_blocks, int64_t num_blocks, int64_t Q, int64_t context, int64_t H,
                        int64_t KVH, int64_t D, int64_t bs, float scale, int num_threads) {
#ifdef SERVELM_HAVE_AVX2
    if (Q < 1 || context < 0) return -2;
    if (KVH < 1 || H % KVH || H / KVH > MAX_ROWS || D % 8 || D > MAX_D || bs < 1) return -3;
    const int64_t bad = first_invalid_block(blocks, num_table_blocks, context + Q, bs, num_blocks);
    if (bad != -1) return bad;
    /* Positions per item: as many as MAX_ROWS rows hold, fewer when that would leave a thread
       without work (a short chunk: at least two items a thread). */
    const int64_t G = H / KVH, threads = num_threads > 1 ? num_threads : 1;
    const int64_t tiles_wanted = (2 * threads + KVH - 1) / KVH;
    int64_t TQ = (Q + tiles_wanted - 1) / tiles_wanted;
    if (TQ > MAX_ROWS / G) TQ = MAX_ROWS / G;
    const int64_t tiles = (Q + TQ - 1) / TQ;
    const chunk_shape sh = {H, KVH, D, bs, context, Q, scale};
    const size_t work_floats = (size_t)(2 * MAX_D * MAX_ROWS + KT * MAX_ROWS + MAX_D);
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float* work = (float*)aligned_alloc(64, ((work_floats * sizeof(float) + 63) / 64) * 64);
        if (!work) {
#pragma omp atomic write
            failed = 1;
        }
        float* zeros = work ? work + 2 * MAX_D * MAX_ROWS + KT * MAX_ROWS : NULL; /* [MAX_D]: a key row past the tile */
        if (zeros)
            for (int64_t d = 0; d < MAX_D; d++) zeros[d] = 0.f;
        /* Later tiles see more keys: the largest first balances the threads' shares. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < KVH * tiles; item++) {
            if (!work) continue;
            const int64_t tile = tiles - 1 - item / KVH, kh = item % KVH;
            const int64_t i0 = tile * TQ, i1 = i0 + TQ < Q ? i0 + TQ : Q;
            chunk_tile(q, k_pool, v_pool, blocks, out, sh, kh, i0, i1, work, zeros);
        }
        free(work);
    }
    return failed ? -4 : -1;
#else
    (void)q; (void)k_pool; (void)v_pool; (void)blocks; (void)out; (void)num_table_blocks; (void)num_blocks;
    (void)Q; (void)context; (void)H; (void)KVH; (void)D; (void)bs; (void)scale; (void)num_threads;
    return -3;
#endif
}
