"""A paged decode-attention kernel for CPU: reads K/V straight from the block pool.

Why: a decode step of B requests must read every request's whole K/V once per layer.
The torch path gathers them into a padded [B, max_len] copy and then runs SDPA on it,
touching the data three times (plus the padding); at 64 requests x ~400 tokens that was
about 10x the cost of the step's matmuls. This kernel walks each request's block table
and reads each K/V row once:

    scores[b, h, l] = scale * q[b, h] . K[slot(b, l), h // G]        decode_scores
    probs           = softmax(scores) over l   (torch: vectorised exp)
    out[b, h]       = sum_l probs[b, h, l] * V[slot(b, l), h // G]    decode_pv

    slot(b, l) = block_tables[b][l // block_size] * block_size + l % block_size,  G = H / KVH

It is plain C built once per machine with the system compiler into a cache directory
and called through ctypes (no torch headers, builds in about a second; ctypes drops the
GIL). Its OpenMP calls bind to the libgomp torch already loaded (same soname), so the
kernel and torch share one thread pool. Where no compiler is found or the build fails,
`load()` returns None and the backend keeps its torch path (same results to ~1e-6).
Only float32 K/V and queries; other dtypes use the torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCE = r"""
#include <math.h>
#include <stdint.h>

/* Shapes: q [B, H, D]; pool [num_blocks, bs, KVH, D] (the K or the V half of one layer);
   block_tables [B, max_blocks]; seq_lens [B]; scores and probs [B, H, max_len]; out [B, H, D].
   Work is split by request; a batch smaller than the thread count splits by KV head too.
   Rows are visited block by block: one table lookup per block, each K/V row read once for
   all the query heads that share it. */

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2 1

/* Eight weights of one 32-block from their int8 codes: d * q (+ m for Q4_1), rounded as the
   checkpoint's float32 values were (see compact_weights.py). */
static inline __m256 dequant8(const int8_t* q, __m256 vd, __m256 vm, int has_min) {
    const __m128i codes = _mm_loadl_epi64((const __m128i*)q);
    const __m256 w = _mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes)));
    return has_min ? _mm256_add_ps(w, vm) : w;
}

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
#ifdef HAVE_AVX2
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

/* out_h[0:D] += sum over n rows of p[o] * row_o. */
static inline void pv_rows(const float* p, const float* rows, int64_t row_stride, int64_t n, int64_t D, float* outh) {
    int64_t d = 0;
#ifdef HAVE_AVX2
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

/* Ask for the next block while this one is computed: blocks sit anywhere in the pool. */
static inline void prefetch_block(const float* block, int64_t count) {
    for (int64_t i = 0; i < count; i += 16) __builtin_prefetch(block + i, 0, 3);
}

static void scores_one(const float* q, const float* k_pool, const int32_t* bt, int64_t L, float* sb,
                       int64_t kh0, int64_t kh1, int64_t H, int64_t KVH, int64_t D, int64_t bs,
                       int64_t max_len, float scale) {
    const int64_t G = H / KVH;
    for (int64_t start = 0; start < L; start += bs) {
        const int64_t n = L - start < bs ? L - start : bs;
        const float* block = k_pool + (int64_t)bt[start / bs] * bs * KVH * D;
        if (start + bs < L) prefetch_block(k_pool + (int64_t)bt[start / bs + 1] * bs * KVH * D, bs * KVH * D);
        for (int64_t h = kh0 * G; h < kh1 * G; h++)
            scores_rows(q + h * D, block + (h / G) * D, KVH * D, n, D, scale, sb + h * max_len + start);
    }
    for (int64_t h = kh0 * G; h < kh1 * G; h++)
        for (int64_t l = L; l < max_len; l++) sb[h * max_len + l] = -INFINITY;
}

static void pv_one(const float* pb, const float* v_pool, const int32_t* bt, int64_t L, float* ob,
                   int64_t kh0, int64_t kh1, int64_t H, int64_t KVH, int64_t D, int64_t bs, int64_t max_len) {
    const int64_t G = H / KVH;
    for (int64_t i = kh0 * G * D; i < kh1 * G * D; i++) ob[i] = 0.f;
    for (int64_t start = 0; start < L; start += bs) {
        const int64_t n = L - start < bs ? L - start : bs;
        const float* block = v_pool + (int64_t)bt[start / bs] * bs * KVH * D;
        if (start + bs < L) prefetch_block(v_pool + (int64_t)bt[start / bs + 1] * bs * KVH * D, bs * KVH * D);
        for (int64_t h = kh0 * G; h < kh1 * G; h++)
            pv_rows(pb + h * max_len + start, block + (h / G) * D, KVH * D, n, D, ob + h * D);
    }
}

void decode_scores(const float* q, const float* k_pool, const int32_t* block_tables, const int32_t* seq_lens,
                   float* scores, int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t bs,
                   int64_t max_blocks, int64_t max_len, float scale, int num_threads) {
    const int64_t split = B < num_threads ? KVH : 1; /* pieces per request */
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t item = 0; item < B * split; item++) {
        const int64_t b = item / split, piece = item % split;
        const int64_t kh0 = piece * KVH / split, kh1 = (piece + 1) * KVH / split;
        scores_one(q + b * H * D, k_pool, block_tables + b * max_blocks, seq_lens[b], scores + b * H * max_len,
                   kh0, kh1, H, KVH, D, bs, max_len, scale);
    }
}

void decode_pv(const float* probs, const float* v_pool, const int32_t* block_tables, const int32_t* seq_lens,
               float* out, int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t bs,
               int64_t max_blocks, int64_t max_len, int num_threads) {
    const int64_t split = B < num_threads ? KVH : 1;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t item = 0; item < B * split; item++) {
        const int64_t b = item / split, piece = item % split;
        const int64_t kh0 = piece * KVH / split, kh1 = (piece + 1) * KVH / split;
        pv_one(probs + b * H * max_len, v_pool, block_tables + b * max_blocks, seq_lens[b], out + b * H * D,
               kh0, kh1, H, KVH, D, bs, max_len);
    }
}

/* y[M, N] = x[M, K] . W[N, K]^T for a few rows of x, with W stored as int8 codes and per-32
   scales: W[n, k] = d[n, k/32] * q[n, k] (+ m[n, k/32] when has_min). Product and sum are
   rounded separately (the file is built with -ffp-contract=off), exactly as the float32
   weights were made from the same codes, so this is the float32 matmul reading under a third of
   the bytes. Threads split N; every output is one thread's sum, so results do not depend on
   the thread count. */
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
#ifdef HAVE_AVX2
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
                float lanes[8];
                _mm256_storeu_ps(lanes, _mm256_add_ps(_mm256_add_ps(a[0], a[2]), _mm256_add_ps(a[1], a[3])));
                y[r0 * N + n] = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
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
            for (int64_t r = 0; r < rows; r++) {
                float lanes[8];
                _mm256_storeu_ps(lanes, _mm256_add_ps(acc[r][0], acc[r][1]));
                y[(r0 + r) * N + n] = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
            }
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
"""

_lock = threading.Lock()
_loaded: "_Kernels | None | bool" = False  # False: not tried yet; None: unavailable


class _Kernels:
    def __init__(self, lib: ctypes.CDLL) -> None:
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        lib.decode_scores.argtypes = [p, p, p, p, p] + [i64] * 7 + [ctypes.c_float, ctypes.c_int]
        lib.decode_scores.restype = None
        lib.decode_pv.argtypes = [p, p, p, p, p] + [i64] * 7 + [ctypes.c_int]
        lib.decode_pv.restype = None
        lib.qgemm_small.argtypes = [p, p, p, p, p, i64, i64, i64, ctypes.c_int, ctypes.c_int]
        lib.qgemm_small.restype = None
        self.lib = lib

    def qgemm_small(
        self,
        x: torch.Tensor,  # [M, K] float32 contiguous, M small
        codes: torch.Tensor,  # [N, K] int8
        scales: torch.Tensor,  # [N, K / 32] float32
        mins: torch.Tensor | None,  # [N, K / 32] float32, or None (no offset)
    ) -> torch.Tensor:  # [M, N] float32
        rows, k = x.shape
        n = codes.shape[0]
        out = torch.empty(rows, n, dtype=torch.float32)
        self.lib.qgemm_small(
            x.data_ptr(), codes.data_ptr(), scales.data_ptr(), (scales if mins is None else mins).data_ptr(),
            out.data_ptr(), rows, n, k, int(mins is not None), torch.get_num_threads(),
        )
        return out

    def decode_attention(
        self,
        query: torch.Tensor,  # [B, H, D] float32 contiguous
        k_pool: torch.Tensor,  # [num_blocks, block_size, KVH, D] float32 contiguous
        v_pool: torch.Tensor,
        block_tables: torch.Tensor,  # [B, max_blocks] int32 contiguous
        seq_lens: torch.Tensor,  # [B] int32
        max_len: int,
        scale: float,
    ) -> torch.Tensor:  # [B, H, D]
        batch, heads, head_dim = query.shape
        _, block_size, kv_heads, _ = k_pool.shape
        max_blocks = block_tables.shape[1]
        threads = torch.get_num_threads()
        scores = torch.empty(batch, heads, max_len, dtype=torch.float32)
        self.lib.decode_scores(
            query.data_ptr(), k_pool.data_ptr(), block_tables.data_ptr(), seq_lens.data_ptr(), scores.data_ptr(),
            batch, heads, kv_heads, head_dim, block_size, max_blocks, max_len, scale, threads,
        )
        probs = torch.softmax(scores, dim=-1)
        out = torch.empty(batch, heads, head_dim, dtype=torch.float32)
        self.lib.decode_pv(
            probs.data_ptr(), v_pool.data_ptr(), block_tables.data_ptr(), seq_lens.data_ptr(), out.data_ptr(),
            batch, heads, kv_heads, head_dim, block_size, max_blocks, max_len, threads,
        )
        return out


def load() -> _Kernels | None:
    """The compiled kernels, built on first use; None where they cannot be built here."""
    global _loaded
    if _loaded is False:
        with _lock:
            if _loaded is False:
                _loaded = _build_and_load()
    return _loaded  # type: ignore[return-value]


def _cpu_flags() -> list[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    flags = set(line.split(":", 1)[-1].split())
    return ["-mavx2", "-mfma"] if {"avx2", "fma"} <= flags else []


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "servelm" / "kernels"


def _build_and_load() -> _Kernels | None:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.info("no C compiler found: decode attention uses the torch path")
        return None
    flags = ["-O3", "-fPIC", "-shared", "-fopenmp", "-ffp-contract=off", *_cpu_flags()]
    key = hashlib.sha256((_SOURCE + " ".join(flags) + compiler).encode()).hexdigest()[:16]
    target = _cache_dir() / f"paged_attention_{key}.so"
    try:
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                src = Path(tmp) / "paged_attention.c"
                src.write_text(_SOURCE)
                built = Path(tmp) / "out.so"
                subprocess.run([compiler, *flags, str(src), "-o", str(built)], check=True, capture_output=True, timeout=120)
                os.replace(built, target)  # atomic: concurrent builders all end with a whole file
        return _Kernels(ctypes.CDLL(str(target)))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        logger.warning("CPU attention kernel unavailable (%s %s): using the torch path", exc, detail.decode(errors="replace")[:500])
        return None
