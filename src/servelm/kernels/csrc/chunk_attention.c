/* Attention of a prompt chunk after cached context on CPU, read straight from the block pool.

   A chunk of Q new tokens after C cached ones attends to C + Q keys, causally within its own Q.
   Torch's path gathers the context out of the pool into one [C + Q, KVH, D] copy per layer and
   runs SDPA over it; its flash kernel expands the KV heads for every query head and, for the small
   chunks a step-time bound makes deep in a long prompt (64-256 tokens after thousands), spends much
   of its time re-reading keys for few queries. This is flash attention over the pool:

       for each KV head kh and each tile of TQ chunk positions (its G = H / KVH query heads each:
       R = TQ * G rows that read the same keys):
           for each tile of KT keys (from the blocks, in order; none past the tile's last position):
               S = K . Q^T                       scores, the query rows pre-scaled
               causal mask on the keys past a row's own position
               m' = max(m, rowmax S); P = e^(S - m'); l = l e^(m - m') + rowsum P
               O = O e^(m - m') + P . V
           out = O / l

   so every key and value row is read once per tile of R rows, never copied per query head, and the
   context is never gathered. The rows are the vector lanes: queries, scores and outputs are held
   transposed ([D][R], [KT][R], [D][R]), so a key or value element is broadcast against eight rows at
   once (register blocks of two keys or two of D by up to six vectors of rows) and the softmax runs
   eight rows a vector, with no horizontal sums.

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

#include "internal.h"
#include "simd.h"

#define KT 32       /* keys per tile: two default blocks */
#define MAX_D 256
/* Query rows (positions x the query heads sharing a KV head) one register block covers: 6 vectors. */
#define GROUP_ROWS 48
/* Query rows per item: two groups take each key tile in turn, so the pool is read half as often as
   with one (deep in a long prompt the reads of the context, not the arithmetic, set the pace). */
#define MAX_ROWS 96
#define GROUP_FLOATS (2 * MAX_D * GROUP_ROWS + KT * GROUP_ROWS)

int chunk_attention_supported(void) {
#ifdef SERVELM_HAVE_AVX2
    return 1;
#else
    return 0;
#endif
}

#ifdef SERVELM_HAVE_AVX2
typedef struct {
    int64_t H, KVH, D, bs, context;
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

/* Rows [r0, r0 + R) of an item (at most GROUP_ROWS: one register block), with their own buffers and
   softmax state: queries and outputs transposed ([D][RP]), a tile's scores ([KT][RP]). */
typedef struct {
    float *Qt, *Ot, *St;
    float m[GROUP_ROWS], l[GROUP_ROWS], alpha[GROUP_ROWS], pos[GROUP_ROWS];
    int64_t r0, R, last_pos;
} row_group;

static void group_init(row_group* g, const float* q, chunk_shape sh, int64_t kh, int64_t i0, int64_t r0, int64_t R,
                       float* buffers) {
    const int64_t G = sh.H / sh.KVH, D = sh.D, RP = (R + 7) / 8 * 8;
    g->Qt = buffers;
    g->Ot = buffers + MAX_D * GROUP_ROWS;
    g->St = buffers + 2 * MAX_D * GROUP_ROWS;
    g->r0 = r0;
    g->R = R;
    g->last_pos = sh.context + i0 + (r0 + R - 1) / G;
    for (int64_t r = 0; r < RP; r++) {
        const int64_t row = r0 + (r < R ? r : R - 1); /* padding repeats the last row's position, zero query */
        const float* src = q + ((i0 + row / G) * sh.H + kh * G + row % G) * D;
        for (int64_t d = 0; d < D; d++) {
            g->Qt[d * RP + r] = r < R ? src[d] * sh.scale : 0.f;
            g->Ot[d * RP + r] = 0.f;
        }
        g->m[r] = -INFINITY;
        g->l[r] = 0.f;
        g->pos[r] = (float)(sh.context + i0 + row / G);
    }
}

/* The group's scores, softmax and P . V over one key tile; RP = 8 NV a constant here. */
ALWAYS_INLINE void group_tile_nv(row_group* g, const float* const* krows, const float* const* vrows, int64_t j0,
                                 int64_t n, int64_t D, int NV) {
    const int64_t RP = 8 * NV;
    const int masked = j0 + KT > (int64_t)g->pos[0] + 1; /* some key of the tile lies past some row */
    tile_scores(g->Qt, krows, g->St, D, RP, NV);
    tile_softmax(g->St, g->m, g->l, g->alpha, g->pos, j0, n, masked, RP, NV);
    tile_pv(g->St, vrows, g->Ot, g->alpha, D, RP, NV);
}

static void group_tile(row_group* g, const float* const* krows, const float* const* vrows, int64_t j0, int64_t n,
                       int64_t D) {
    if (j0 > g->last_pos) return; /* every key of the tile lies past every row of the group */
    switch ((g->R + 7) / 8) { /* a constant vector count: the accumulators stay in registers */
#define GROUP_CASE(NV) \
    case NV: group_tile_nv(g, krows, vrows, j0, n, D, NV); break;
        GROUP_CASE(1) GROUP_CASE(2) GROUP_CASE(3) GROUP_CASE(4) GROUP_CASE(5)
        default: group_tile_nv(g, krows, vrows, j0, n, D, 6); break;
#undef GROUP_CASE
    }
}

static void group_finish(const row_group* g, float* out, chunk_shape sh, int64_t kh, int64_t i0) {
    const int64_t G = sh.H / sh.KVH, D = sh.D, RP = (g->R + 7) / 8 * 8;
    for (int64_t r = 0; r < g->R; r++) {
        const int64_t row = g->r0 + r;
        float* dst = out + ((i0 + row / G) * sh.H + kh * G + row % G) * D;
        const float inv = 1.f / g->l[r];
        for (int64_t d = 0; d < D; d++) dst[d] = g->Ot[d * RP + r] * inv;
    }
}

/* One (KV head, query tile) item: rows r = pi * G + g are position i0 + pi, query head kh * G + g, in
   groups of GROUP_ROWS. Each key tile is read from the pool once for all of them: the groups take
   it in turn while it sits in L1. */
static void chunk_tile(const float* q, const float* k_pool, const float* v_pool, const int32_t* blocks, float* out,
                       chunk_shape sh, int64_t kh, int64_t i0, int64_t i1, float* work, const float* zeros) {
    const int64_t G = sh.H / sh.KVH, D = sh.D, R = (i1 - i0) * G, row_stride = sh.KVH * D;
    row_group groups[MAX_ROWS / GROUP_ROWS];
    const int64_t num_groups = (R + GROUP_ROWS - 1) / GROUP_ROWS;
    for (int64_t k = 0; k < num_groups; k++) {
        const int64_t r0 = k * GROUP_ROWS;
        group_init(&groups[k], q, sh, kh, i0, r0, R - r0 < GROUP_ROWS ? R - r0 : GROUP_ROWS, work + k * GROUP_FLOATS);
    }
    const float* krows[KT];
    const float* vrows[KT];
    const int64_t num_keys = sh.context + i1; /* the item's last position sees keys 0..context + i1 - 1 */
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
        for (int64_t k = 0; k < num_groups; k++) group_tile(&groups[k], krows, vrows, j0, n, D);
    }
    for (int64_t k = 0; k < num_groups; k++) group_finish(&groups[k], out, sh, kh, i0);
}
#endif

/* Returns -1 after writing out; -2 when context + Q keys exceed the table (or Q < 1) or a table entry
   they use lies outside [0, num_blocks); -3 when this build or these shapes are not supported
   (G > GROUP_ROWS, D not a multiple of 8 or over MAX_D): then nothing is read or written. */
int64_t chunk_attention(const float* q, const float* k_pool, const float* v_pool, const int32_t* blocks, float* out,
                        int64_t num_table_blocks, int64_t num_blocks, int64_t Q, int64_t context, int64_t H,
                        int64_t KVH, int64_t D, int64_t bs, float scale, int num_threads) {
#ifdef SERVELM_HAVE_AVX2
    if (Q < 1 || context < 0 || context + Q > INT32_MAX) return -2;
    if (KVH < 1 || H % KVH || H / KVH > GROUP_ROWS || D % 8 || D > MAX_D || bs < 1) return -3;
    /* The chunk is one request of the decode kernel's check: its keys within the table, the blocks
       they use within the pool. */
    const int32_t num_keys = (int32_t)(context + Q);
    if (servelm_first_invalid_request(blocks, &num_keys, 1, num_table_blocks, bs, num_keys, num_blocks) >= 0) return -2;
    /* Positions per item: as many as MAX_ROWS rows hold, fewer when that would leave a thread
       without work (a short chunk: at least two items a thread). */
    const int64_t G = H / KVH, threads = num_threads > 1 ? num_threads : 1;
    const int64_t tiles_wanted = (2 * threads + KVH - 1) / KVH;
    int64_t TQ = (Q + tiles_wanted - 1) / tiles_wanted;
    if (TQ > MAX_ROWS / G) TQ = MAX_ROWS / G;
    const int64_t tiles = (Q + TQ - 1) / TQ;
    const chunk_shape sh = {H, KVH, D, bs, context, scale};
    const size_t work_floats = (size_t)(MAX_ROWS / GROUP_ROWS * GROUP_FLOATS + MAX_D);
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float* work = (float*)aligned_alloc(64, ((work_floats * sizeof(float) + 63) / 64) * 64);
        if (!work) {
#pragma omp atomic write
            failed = 1;
        }
        float* zeros = work ? work + MAX_ROWS / GROUP_ROWS * GROUP_FLOATS : NULL; /* [MAX_D]: a key row past the tile */
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
