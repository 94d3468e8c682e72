/* Every decoder layer of a small decode step in one call: a Llama layer's norms, GGUF-block matmuls,
   rotary, K/V write, paged attention and activation, for B rows (one new token each, or a few per
   request after cached context), inside one parallel region.

   Why: a batch-1 decode step of the default model (30 layers) is ~6 ms of weight reads and, done op
   by op from Python, ~6 ms more of dispatch around ~450 small torch ops and ctypes calls (measured
   by benchmarks/decode_step.py). Here one call does the layers; the threads meet at a barrier
   between phases instead of a fork/join per op. Per layer, rows b in [0, B):

       residual = hidden + residual (layer 0 without one: residual = hidden)
       normed   = rmsnorm(residual) * input_norm
       qkv      = normed . Wqkv^T (+ bias)                 q | k | v, heads of D
       q, k     = rotated by cos/sin of the row's position (HF rotate-half)
       pool[slot(b)] = k, v                                the row's new K/V (float32 pool)
       attn     = softmax(scale * q . K) . V               over the row's seq_len keys (paged)
       hidden   = attn . Wo^T (+ bias);  residual += hidden
       normed   = rmsnorm(residual) * post_norm
       gate|up  = normed . Wgu^T;  act = silu(gate) * up
       hidden   = act . Wdown^T (+ bias)

   and the caller applies the final norm to hidden + residual. With LoRA adapter rows (lora_rows), each
   of the four matmuls is followed by its rows' adapter deltas, as the op-by-op path adds them
   (lora.c's per-row loop: the same values). Each phase computes what the
   op-by-op path computes, in float32: the matmul and attention passes are the same loops
   (block_gemm.c, paged_decode_attention.c), rotary's roundings are apply_rotary's, and only the
   sums inside the norms and the softmax may be ordered differently from torch's.

   All rows' K/V are written before any row attends, so a request's later rows see its earlier
   ones (short queries after context, a speculative step's verification), as in the op-by-op path.

   Shapes (row-major, float32 unless said): hidden, residual [B, hidden_size]; pools [2, num_blocks,
   bs, KVH, D] (K half then V half); block_tables [B, max_blocks] int32; seq_lens [B] int32;
   slots [B] int64; cos, sin [B, D/2]. The Python side (servelm/kernels/cpu.py, FusedDecodeKernel)
   checks dtypes and shapes; decode_layers checks lengths, table entries and slots here, before
   anything is read through them. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "internal.h"

/* A linear's LoRA adapters stacked by slot (servelm/lora/layers.py's layout); a NULL `a`: none. */
typedef struct {
    const float* a;        /* [slots, W, k] float32 */
    const float* bt;       /* [slots, W, n]: B^T, scaling folded in */
    const int64_t* widths; /* [slots]: the columns each slot's adapter uses (<= W) */
    int64_t W;
} fused_lora;

typedef struct {
    const uint8_t* blocks; /* [n, k / 32, block bytes] GGUF blocks of `type` */
    const float* bias;     /* [n] or NULL */
    int64_t n, k, type;
    fused_lora lora;
} fused_linear;

typedef struct {
    fused_linear qkv, o, gate_up, down;
    const float* input_norm; /* [hidden_size] */
    const float* post_norm;
    float* kv_pool; /* [2, num_blocks, bs, KVH, D] float32 */
} fused_layer;

typedef struct {
    int64_t rows, hidden_size, heads, kv_heads, head_dim, intermediate;
    int64_t block_size, max_blocks, max_len, num_blocks;
    const int32_t* block_tables;
    const int32_t* seq_lens;
    const int64_t* slots;
    const float* cos;
    const float* sin;
    float eps, scale;
    int64_t num_threads;
    /* scratch, [B, ...] each: normed [hidden_size], qkv [(H + 2 KVH) D], scores [H, max_len],
       attn [H D], gate_up [2 I], act [I] */
    float *normed, *qkv, *scores, *attn, *gate_up, *act;
    /* LoRA: each row's adapter slot ([B] int64, < 0: the base model's row; NULL: no adapter rows in
       the step), the slots there are, and scratch [B, lora_width] (lora_width >= every linear's W). */
    const int64_t* lora_rows;
    int64_t lora_slots, lora_width;
    float* lora_h;
} fused_step;

/* y[B, lin.n] = x[B, lin.k] . W^T (+ bias), the threads splitting lin.n, then each adapter row's LoRA
   delta (the threads splitting rows, as lora_bgmv does after the op-by-op matmul): call from every
   thread of the region. */
static void linear_rows(const fused_step* s, const fused_linear* lin, const float* x, float* y) {
    const int64_t B = s->rows, tasks = (lin->n + SERVELM_N_PER_TASK - 1) / SERVELM_N_PER_TASK;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tasks; t++) {
        const int64_t n0 = t * SERVELM_N_PER_TASK, n1 = n0 + SERVELM_N_PER_TASK < lin->n ? n0 + SERVELM_N_PER_TASK : lin->n;
        servelm_block_rows(x, lin->blocks, y, B, lin->n, lin->k, (int)lin->type, n0, n1);
        if (lin->bias)
            for (int64_t b = 0; b < B; b++)
                for (int64_t n = n0; n < n1; n++) y[b * lin->n + n] += lin->bias[n];
    }
    if (s->lora_rows == NULL || lin->lora.a == NULL) return; /* the same for every thread: shared data */
    const fused_lora* l = &lin->lora;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < SERVELM_LORA_TASKS(B); t++)
        servelm_lora_task(x, y, l->a, l->bt, s->lora_rows, l->widths, l->W, lin->k, lin->n, s->lora_h, s->lora_width, t,
                          B);
}

/* One layer for all rows; every thread of the enclosing region calls it. */
static void layer_rows(const fused_step* s, const fused_layer* layer, float* hidden, float* residual,
                       int first_without_residual) {
    const int64_t B = s->rows, HS = s->hidden_size, H = s->heads, KVH = s->kv_heads, D = s->head_dim;
    const int64_t I = s->intermediate, QKV = (H + 2 * KVH) * D, half = D / 2, G = H / KVH;
#pragma omp single
    for (int64_t b = 0; b < B; b++) {
        float* r = residual + b * HS;
        const float* h = hidden + b * HS;
        if (first_without_residual) {
            memcpy(r, h, (size_t)HS * sizeof(float));
        } else {
            for (int64_t i = 0; i < HS; i++) r[i] = h[i] + r[i];
        }
        servelm_rms_norm_row(r, layer->input_norm, s->normed + b * HS, HS, s->eps);
    }
    linear_rows(s, &layer->qkv, s->normed, s->qkv);
    const int64_t pool_half_floats = s->num_blocks * s->block_size * KVH * D;
#pragma omp single
    for (int64_t b = 0; b < B; b++) {
        float* row = s->qkv + b * QKV;
        for (int64_t h = 0; h < H + KVH; h++) servelm_rotate_head(row + h * D, s->cos + b * half, s->sin + b * half, half);
        float* k_dst = layer->kv_pool + s->slots[b] * KVH * D;
        memcpy(k_dst, row + H * D, (size_t)(KVH * D) * sizeof(float));
        memcpy(k_dst + pool_half_floats, row + (H + KVH) * D, (size_t)(KVH * D) * sizeof(float));
    }
    const pool_half k_half = servelm_pool_half(layer->kv_pool, NULL);
    const pool_half v_half = servelm_pool_half(layer->kv_pool + pool_half_floats, NULL);
    /* One item per (row, KV head): its G query heads' scores, softmax and weighted V. */
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < B * KVH; item++) {
        const int64_t b = item / KVH, kh = item % KVH, L = s->seq_lens[b];
        const int32_t* bt = s->block_tables + b * s->max_blocks;
        float* sb = s->scores + b * H * s->max_len;
        servelm_scores_one(s->qkv + b * QKV, k_half, bt, L, sb, kh, kh + 1, H, KVH, D, s->block_size, s->max_len,
                           s->scale);
        for (int64_t h = kh * G; h < (kh + 1) * G; h++) servelm_softmax_row(sb + h * s->max_len, L);
        servelm_pv_one(sb, v_half, bt, L, s->attn + b * H * D, kh, kh + 1, H, KVH, D, s->block_size, s->max_len);
    }
    linear_rows(s, &layer->o, s->attn, hidden);
#pragma omp single
    for (int64_t b = 0; b < B; b++) {
        float* r = residual + b * HS;
        const float* h = hidden + b * HS;
        for (int64_t i = 0; i < HS; i++) r[i] = h[i] + r[i];
        servelm_rms_norm_row(r, layer->post_norm, s->normed + b * HS, HS, s->eps);
    }
    linear_rows(s, &layer->gate_up, s->normed, s->gate_up);
    /* Each row's intermediate split in two halves (32-aligned: I is a multiple of 32), for the threads. */
#pragma omp for schedule(static)
    for (int64_t piece = 0; piece < 2 * B; piece++) {
        const int64_t b = piece / 2, i0 = (piece % 2) * (I / 64) * 32, i1 = piece % 2 ? I : (I / 64) * 32;
        const float* gate = s->gate_up + b * 2 * I;
        servelm_silu_mul_row(gate + i0, gate + I + i0, s->act + b * I + i0, i1 - i0);
    }
    linear_rows(s, &layer->down, s->act, hidden);
}

/* Runs `num_layers` layers over hidden (in: the embedding, or the previous layer's MLP output with
   `residual` the sum before it when has_residual; out: the last layer's MLP output and the sum
   before it). Returns -1, or (reading and writing nothing) the first row whose seq_len, used block
   ids or slot fall outside the pool, or whose adapter slot is not one. */
int64_t decode_layers(const fused_step* s, const fused_layer* layers, int64_t num_layers, float* hidden,
                      float* residual, int64_t has_residual) {
    const int64_t bad = servelm_first_invalid_request(s->block_tables, s->seq_lens, s->rows, s->max_blocks,
                                                      s->block_size, s->max_len, s->num_blocks);
    if (bad >= 0) return bad;
    for (int64_t b = 0; b < s->rows; b++)
        if (s->slots[b] < 0 || s->slots[b] >= s->num_blocks * s->block_size) return b;
    if (s->lora_rows != NULL)
        for (int64_t b = 0; b < s->rows; b++)
            if (s->lora_rows[b] >= s->lora_slots) return b;
#pragma omp parallel num_threads((int)s->num_threads)
    for (int64_t i = 0; i < num_layers; i++) layer_rows(s, &layers[i], hidden, residual, i == 0 && !has_residual);
    return -1;
}
