/* What one kernel source lends another inside the library: the block matmul's row loop, the paged
   decode attention's per-request passes and the row ops, so that decode_layers.c composes them
   inside its own parallel region instead of opening one per call. Not part of the library's ctypes surface. */
#ifndef SERVELM_INTERNAL_H
#define SERVELM_INTERNAL_H

#include <stdint.h>

/* block_gemm.c: outputs [n0, n1) of y[M, N] = x[M, K] . W^T, W as GGUF blocks of ggml `type`.
   block_gemm_small splits N into tasks of this many rows. */
#define SERVELM_N_PER_TASK 32
void servelm_block_rows(const float* x, const uint8_t* w, float* y, int64_t M, int64_t N, int64_t K, int type,
                        int64_t n0, int64_t n1);

/* paged_decode_attention.c. One layer's K or V half: float32 values, or int8 codes with their
   scales (scales NULL: float32). */
typedef struct {
    const char* base; /* the pool's first byte */
    const float* scales;
    int64_t element_size; /* 4 or 1 */
} pool_half;

pool_half servelm_pool_half(const void* pool, const float* scales);
/* Scores of request row q ([H, D]) against its L keys for KV heads [kh0, kh1): sb [H, max_len]
   (entries past L set to -inf). */
void servelm_scores_one(const float* q, pool_half k_pool, const int32_t* bt, int64_t L, float* sb, int64_t kh0,
                        int64_t kh1, int64_t H, int64_t KVH, int64_t D, int64_t bs, int64_t max_len, float scale);
/* ob[h] = sum_l pb[h, l] * V[l] for the query heads of KV heads [kh0, kh1) (ob [H, D], overwritten). */
void servelm_pv_one(const float* pb, pool_half v_pool, const int32_t* bt, int64_t L, float* ob, int64_t kh0,
                    int64_t kh1, int64_t H, int64_t KVH, int64_t D, int64_t bs, int64_t max_len);
/* The first request whose lengths or used block ids fall outside the pool, or -1. */
int64_t servelm_first_invalid_request(const int32_t* block_tables, const int32_t* seq_lens, int64_t B,
                                      int64_t max_blocks, int64_t bs, int64_t max_len, int64_t num_blocks);

/* row_ops.c: one row each. out = x * (1 / sqrt(mean(x^2) + eps)) * w over n. */
void servelm_rms_norm_row(const float* x, const float* w, float* out, int64_t n, float eps);
/* x[0:2 half] rotated in place: x1*cos - x2*sin | x2*cos + x1*sin (apply_rotary's roundings). */
void servelm_rotate_head(float* x, const float* cos, const float* sin, int64_t half);
void servelm_softmax_row(float* x, int64_t n);
/* act = silu(gate) * up = gate / (1 + e^-gate) * up, over n. */
void servelm_silu_mul_row(const float* gate, const float* up, float* act, int64_t n);

/* lora.c: the LoRA deltas of a batch's rows (x [num_rows, in], y [num_rows, out]) that task `task`
   takes: SERVELM_LORA_ROWS_PER_TASK consecutive rows, each row b of slot row_slots[b] >= 0 (negative:
   untouched), A [slots, W, in], Bt [slots, W, out], h rows `hs` apart. A run of four rows of one slot
   shares the loads of its weights; every value is the one-row kernel's. lora_bgmv and decode_layers.c
   both split rows so, and add the same values. */
void servelm_lora_task(const float* x, float* y, const float* a, const float* bt, const int64_t* row_slots,
                       const int64_t* widths, int64_t W, int64_t in, int64_t out, float* h, int64_t hs, int64_t task,
                       int64_t num_rows);
#define SERVELM_LORA_ROWS_PER_TASK 4
#define SERVELM_LORA_TASKS(num_rows) (((num_rows) + SERVELM_LORA_ROWS_PER_TASK - 1) / SERVELM_LORA_ROWS_PER_TASK)

#endif /* SERVELM_INTERNAL_H */
