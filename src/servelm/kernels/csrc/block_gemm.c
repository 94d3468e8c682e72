/* A small-batch matmul straight from GGUF blocks: y[M, N] = x[M, K] . W[N, K]^T for a few rows of x
   (a decode step of a few requests), reading W as the file stores it, one 32-weight block after the
   other along each row n:

       Q4_0 (18 bytes): d:f16, qs[16]              W = d * (q - 8)
       Q4_1 (20 bytes): d:f16, m:f16, qs[16]       W = d * q + m
       Q8_0 (34 bytes): d:f16, q[32]:int8          W = d * q

   where a Q4 block's byte i holds q[i] in its low nibble and q[i + 16] in its high one. Each weight
   is the float32 gguf dequantises to: d * q is exact in float32 (an 11-bit d times a code of at most
   8 bits), so the one rounding is Q4_1's + m, and fma(d, q, m) rounds exactly as d * q + m does
   (-ffp-contract=off keeps the compiler from fusing anything else). The float32 activations then
   meet the weights in FMAs: the float32 matmul reading 5/8 (Q4_1), 9/16 (Q4_0) or 17/16 (Q8_0)
   bytes per weight instead of 4; only the summation order differs from a dense float32 matmul.

   Three builds of the inner loops, chosen by the flags servelm/kernels/build.py compiled with
   (which follow the CPU found at run time): AVX-512F, AVX2 + FMA, and plain C.
   Threads split N; every output is one thread's sum in a fixed order, so results do not depend on
   the thread count. (The AVX2 loops sum a lone row in four chains and batched rows in two, as the
   int8-code kernel before them did: a row's last bits may differ between a batch and alone.)

   Shapes: x [M, K] float32; w [N, K / 32 blocks]; y [M, N]; K a multiple of 32. The Python wrapper
   (servelm/kernels/cpu.py) checks all of that, and the block type, before calling. */
#include <stdint.h>
#include <string.h>

#include "internal.h"
#include "simd.h"
#ifdef __F16C__
#include <immintrin.h> /* _cvtsh_ss */
#endif

enum { GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q8_0 = 8 };

static inline int block_bytes(int type) { return type == GGML_Q4_0 ? 18 : type == GGML_Q4_1 ? 20 : 34; }

static inline uint16_t load_u16(const uint8_t* p) {
    uint16_t v;
    memcpy(&v, p, 2); /* GGUF is little-endian, as is every CPU these kernels build for */
    return v;
}

/* IEEE half -> float, exact (every half is a float). */
static inline float half_to_float(uint16_t h) {
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
    uint32_t bits;
    float f;
    if (exponent == 0x1f) {
        bits = sign | 0x7f800000u | (mantissa << 13); /* inf, nan */
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13); /* rebias 15 -> 127 */
    } else {
        f = (float)mantissa * 0x1p-24f; /* zero or subnormal: mantissa * 2^-24, exact */
        memcpy(&bits, &f, 4);
        bits |= sign;
    }
    memcpy(&f, &bits, 4);
    return f;
#endif
}

#ifdef SERVELM_HAVE_AVX2
/* A Q4_1 block's d and m as floats in lanes 0 and 1: one conversion for both with F16C. */
static inline __m128 load_d_m(const uint8_t* b) {
#ifdef __F16C__
    uint32_t dm;
    memcpy(&dm, b, 4);
    return _mm_cvtph_ps(_mm_cvtsi32_si128((int)dm));
#else
    return _mm_setr_ps(half_to_float(load_u16(b)), half_to_float(load_u16(b + 2)), 0.f, 0.f);
#endif
}

/* Ask for the bytes 2 KB past block b while it is computed. A decode step reads ~100 MB of blocks once,
   from DRAM, and one core's hardware prefetchers alone keep too few lines in flight (measured on the
   default model's 30 layers of Q4_1 from a cold cache, one row, one thread: AVX-512 12.2 -> 9.2 ms,
   AVX2 25 -> 9.3 ms). A prefetch never faults: the last rows' ones past the end are harmless. */
#define PREFETCH_AHEAD 2048
static inline void prefetch_ahead(const uint8_t* b) { __builtin_prefetch(b + PREFETCH_AHEAD, 0, 3); }
#endif

/* One weight: code i (0..31) of block b, as gguf dequantises it. */
static inline float block_weight(const uint8_t* b, int type, int i) {
    const float d = half_to_float(load_u16(b));
    if (type == GGML_Q8_0) return d * (float)(int8_t)b[2 + i];
    const uint8_t* qs = b + (type == GGML_Q4_1 ? 4 : 2);
    const int q = i < 16 ? qs[i] & 0x0f : qs[i - 16] >> 4;
    if (type == GGML_Q4_0) return d * (float)(q - 8);
    return d * (float)q + half_to_float(load_u16(b + 2));
}

/* Outputs [n0, n1) of every row, plain C: one sequential sum per output. Unused in SIMD builds. */
static __attribute__((unused)) void rows_scalar(const float* x, const uint8_t* w, float* y, int64_t M, int64_t N, int64_t K, int type,
                        int64_t n0, int64_t n1) {
    const int64_t nb = K / 32, bytes = block_bytes(type);
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t* row = w + n * nb * bytes;
        for (int64_t r = 0; r < M; r++) {
            float acc = 0.f;
            for (int64_t j = 0; j < nb; j++)
                for (int i = 0; i < 32; i++) acc += x[r * K + j * 32 + i] * block_weight(row + j * bytes, type, i);
            y[r * N + n] = acc;
        }
    }
}

#if defined(SERVELM_HAVE_AVX512)
/* The 32 weights of block b as two vectors of 16 (inputs 0-15, 16-31). A Q4 block's 16 possible
   weights are one register (a table made with one FMA per block), and each weight is a lookup
   of its code: vpermps reads only the low 4 bits of an index, so the raw byte indexes the low
   nibble and the byte shifted right by 4 the high one. */
static inline __attribute__((always_inline)) void block_weights16(const uint8_t* b, int type, __m512* w0, __m512* w1) {
    if (type == GGML_Q8_0) {
        const __m512 vd = _mm512_set1_ps(half_to_float(load_u16(b)));
        *w0 = _mm512_mul_ps(vd, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(b + 2)))));
        *w1 = _mm512_mul_ps(vd, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(b + 18)))));
        return;
    }
    const __m512 codes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 table; /* Q4_1: d * q + m; Q4_0: d * q - 8d = d * (q - 8) (every term exact: one exact result) */
    if (type == GGML_Q4_1) {
        const __m128 dm = load_d_m(b);
        table = _mm512_fmadd_ps(_mm512_broadcastss_ps(dm), codes, _mm512_broadcastss_ps(_mm_movehdup_ps(dm)));
    } else {
        const float d = half_to_float(load_u16(b));
        table = _mm512_fmadd_ps(_mm512_set1_ps(d), codes, _mm512_set1_ps(-8.f * d));
    }
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(b + (type == GGML_Q4_1 ? 4 : 2))));
    *w0 = _mm512_permutexvar_ps(bytes, table);
    *w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
}

/* Outputs [n0, n1) of up to 8 rows starting at x (row stride K) into y (row stride N). */
static inline __attribute__((always_inline)) void rows8_avx512(const float* x, const uint8_t* w, float* y, int64_t rows,
                                                               int64_t N, int64_t K, int type, int64_t n0, int64_t n1) {
    const int64_t nb = K / 32, bytes = block_bytes(type);
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t* row = w + n * nb * bytes;
        __m512 acc[8][2];
        for (int64_t r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
        for (int64_t j = 0; j < nb; j++) {
            __m512 w0, w1;
            prefetch_ahead(row + j * bytes);
            block_weights16(row + j * bytes, type, &w0, &w1);
            for (int64_t r = 0; r < rows; r++) {
                const float* xr = x + r * K + j * 32;
                acc[r][0] = _mm512_fmadd_ps(_mm512_loadu_ps(xr), w0, acc[r][0]);
                acc[r][1] = _mm512_fmadd_ps(_mm512_loadu_ps(xr + 16), w1, acc[r][1]);
            }
        }
        for (int64_t r = 0; r < rows; r++) y[r * N + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
    }
}

static void rows_simd(const float* x, const uint8_t* w, float* y, int64_t M, int64_t N, int64_t K, int type,
                      int64_t n0, int64_t n1) {
    for (int64_t r0 = 0; r0 < M; r0 += 8) {
        const int64_t rows = M - r0 < 8 ? M - r0 : 8;
        /* A literal type per call, so the always-inline helpers fold their type branches away. */
        switch (type) {
            case GGML_Q4_0: rows8_avx512(x + r0 * K, w, y + r0 * N, rows, N, K, GGML_Q4_0, n0, n1); break;
            case GGML_Q4_1: rows8_avx512(x + r0 * K, w, y + r0 * N, rows, N, K, GGML_Q4_1, n0, n1); break;
            default: rows8_avx512(x + r0 * K, w, y + r0 * N, rows, N, K, GGML_Q8_0, n0, n1); break;
        }
    }
}
#elif defined(SERVELM_HAVE_AVX2)
/* The 32 weights of block b as four vectors of 8 (inputs 0-7, 8-15, 16-23, 24-31). */
static inline __attribute__((always_inline)) void block_weights8(const uint8_t* b, int type, __m256 w[4]) {
    if (type == GGML_Q8_0) {
        const __m256 vd = _mm256_set1_ps(half_to_float(load_u16(b)));
        for (int g = 0; g < 4; g++) w[g] = _mm256_mul_ps(vd, load_int8x8_ps((const int8_t*)(b + 2 + 8 * g)));
        return;
    }
    __m256 vd, vm; /* Q4_1: d * q + m; Q4_0: d * q - 8d = d * (q - 8) (every term exact: one exact result) */
    if (type == GGML_Q4_1) {
        const __m128 dm = load_d_m(b);
        vd = _mm256_broadcastss_ps(dm);
        vm = _mm256_broadcastss_ps(_mm_movehdup_ps(dm));
    } else {
        const float d = half_to_float(load_u16(b));
        vd = _mm256_set1_ps(d);
        vm = _mm256_set1_ps(-8.f * d);
    }
    /* Bytes 0-7 and 8-15 widened to 32-bit lanes straight from memory (one shuffle each); a lane's
       low nibble is q[i], its value >> 4 is q[i + 16]. */
    const uint8_t* qs = b + (type == GGML_Q4_1 ? 4 : 2);
    const __m256i nibble = _mm256_set1_epi32(0x0f);
    const __m256i lanes0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)qs));
    const __m256i lanes1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(qs + 8)));
    const __m256i q[4] = {_mm256_and_si256(lanes0, nibble), _mm256_and_si256(lanes1, nibble),
                          _mm256_srli_epi32(lanes0, 4), _mm256_srli_epi32(lanes1, 4)};
    for (int g = 0; g < 4; g++) w[g] = _mm256_fmadd_ps(vd, _mm256_cvtepi32_ps(q[g]), vm);
}

/* Outputs [n0, n1) of up to 4 rows starting at x (row stride K) into y (row stride N). One row: four
   FMA chains, one per group of 8; more: two per row. */
static inline __attribute__((always_inline)) void rows4_avx2(const float* x, const uint8_t* w, float* y, int64_t rows,
                                                             int64_t N, int64_t K, int type, int64_t n0, int64_t n1) {
    const int64_t nb = K / 32, bytes = block_bytes(type);
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t* row = w + n * nb * bytes;
        __m256 wv[4];
        if (rows == 1) {
            __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
            for (int64_t j = 0; j < nb; j++) {
                prefetch_ahead(row + j * bytes);
                block_weights8(row + j * bytes, type, wv);
                for (int g = 0; g < 4; g++) a[g] = _mm256_fmadd_ps(_mm256_loadu_ps(x + j * 32 + g * 8), wv[g], a[g]);
            }
            y[n] = sum_lanes8(_mm256_add_ps(_mm256_add_ps(a[0], a[2]), _mm256_add_ps(a[1], a[3])));
            continue;
        }
        __m256 acc[4][2];
        for (int64_t r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
        for (int64_t j = 0; j < nb; j++) {
            prefetch_ahead(row + j * bytes);
            block_weights8(row + j * bytes, type, wv);
            for (int g = 0; g < 4; g++)
                for (int64_t r = 0; r < rows; r++)
                    acc[r][g & 1] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * K + j * 32 + g * 8), wv[g], acc[r][g & 1]);
        }
        for (int64_t r = 0; r < rows; r++) y[r * N + n] = sum_lanes8(_mm256_add_ps(acc[r][0], acc[r][1]));
    }
}

static void rows_simd(const float* x, const uint8_t* w, float* y, int64_t M, int64_t N, int64_t K, int type,
                      int64_t n0, int64_t n1) {
    for (int64_t r0 = 0; r0 < M; r0 += 4) {
        const int64_t rows = M - r0 < 4 ? M - r0 : 4;
        switch (type) { /* a literal type per call: the always-inline helpers fold their type branches */
            case GGML_Q4_0: rows4_avx2(x + r0 * K, w, y + r0 * N, rows, N, K, GGML_Q4_0, n0, n1); break;
            case GGML_Q4_1: rows4_avx2(x + r0 * K, w, y + r0 * N, rows, N, K, GGML_Q4_1, n0, n1); break;
            default: rows4_avx2(x + r0 * K, w, y + r0 * N, rows, N, K, GGML_Q8_0, n0, n1); break;
        }
    }
}
#else
#define rows_simd rows_scalar
#endif

/* Which inner loops this build runs: 2 AVX-512, 1 AVX2 + FMA, 0 plain C (tests and logs ask). */
int block_gemm_simd_level(void) {
#if defined(SERVELM_HAVE_AVX512)
    return 2;
#elif defined(SERVELM_HAVE_AVX2)
    return 1;
#else
    return 0;
#endif
}

/* Rows of W per task: a multiple of 16 keeps two threads' outputs off one cache line; 32 rows of the
   narrowest layer (K = 576) are ~11 KB of Q4_1, enough work per task, and the default model's
   N = 576 and 960 split into an even number of tasks (two threads get equal shares). */
#define N_PER_TASK SERVELM_N_PER_TASK

void servelm_block_rows(const float* x, const uint8_t* w, float* y, int64_t M, int64_t N, int64_t K, int type,
                        int64_t n0, int64_t n1) {
    rows_simd(x, w, y, M, N, K, type, n0, n1);
}

void block_gemm_small(const float* x, const uint8_t* w, float* y, int64_t M, int64_t N, int64_t K, int type,
                      int num_threads) {
    const int64_t tasks = (N + N_PER_TASK - 1) / N_PER_TASK;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t t = 0; t < tasks; t++) {
        const int64_t n0 = t * N_PER_TASK, n1 = n0 + N_PER_TASK < N ? n0 + N_PER_TASK : N;
        rows_simd(x, w, y, M, N, K, type, n0, n1);
    }
}
