/* What the CPU kernels share: whether this build may use AVX2 + FMA (and AVX-512), and a
   fixed-order lane sum.

   servelm/kernels/build.py passes -mavx2 -mfma only when the CPU running the build reports both,
   -mf16c and -mavx512f on top only when it reports those too (and puts the flags in the cache key),
   so SERVELM_HAVE_AVX2 / SERVELM_HAVE_AVX512 are set exactly for builds made for such CPUs; without
   them every kernel takes its scalar loop. No -march=native: a cache entry must run on any CPU with
   the features in its key. */
#ifndef SERVELM_SIMD_H
#define SERVELM_SIMD_H

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include <stdint.h>
#define SERVELM_HAVE_AVX2 1
#if defined(__AVX512F__)
#define SERVELM_HAVE_AVX512 1 /* only block_gemm.c has AVX-512 loops; the others keep their AVX2 ones */
#endif

/* The eight lanes of v summed pairwise in a fixed order, so a result never depends on anything
   but its inputs (not the thread count, not the batch it came in). */
static inline float sum_lanes8(__m256 v) {
    float lanes[8];
    _mm256_storeu_ps(lanes, v);
    return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
}

/* Eight int8 codes as eight floats (exact: every int8 is a float). */
static inline __m256 load_int8x8_ps(const int8_t* codes) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)codes)));
}
#endif

#endif /* SERVELM_SIMD_H */
