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

/* e^x for eight floats (Cephes' expf: a degree-5 polynomial on x - n ln2, times 2^n), within 2 ulp of
   expf where the result is a normal float below 2^127; 0 where expf gives subnormals or 0 (x below
   about -88.0), inf from x = 88.38 (expf: from 88.72). Why not expf: softmax and SiLU call it on every score and every activation, and
   libm's scalar call cost ~10x this per value (the default model's SiLU alone is 46k per token). */
static inline __m256 exp8_ps(__m256 x) {
    /* hi: n = 128 above it, whose exponent bits (255) make inf; lo: n = -127, whose bits (0) make 0 */
    const __m256 hi = _mm256_set1_ps(89.f), lo = _mm256_set1_ps(-88.3762626647949f);
    x = _mm256_max_ps(_mm256_min_ps(x, hi), lo);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    /* r = x - n ln2, ln2 in two parts so that n * the first is exact */
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    /* 2^n by the exponent bits: n + 127 in [0, 255] after the clamp */
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* Eight int8 codes as eight floats (exact: every int8 is a float). */
static inline __m256 load_int8x8_ps(const int8_t* codes) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)codes)));
}
#endif

#endif /* SERVELM_SIMD_H */
