"""Attention over part of a request's keys, with its log-sum-exp, and the merge of such parts.

Context parallelism splits a request's keys over ranks; each rank attends the queries to the
keys it holds and gets, per query and head, a normalised partial output o_p and the log of its
softmax denominator lse_p = log sum_k exp(s_k). The exact attention over all keys is then

    lse = log sum_p exp(lse_p)          out = sum_p exp(lse_p - lse) * o_p

(the online-softmax combine). A part where a query sees no key has lse_p = -inf and o_p = 0 and
weighs nothing; a query that sees no key anywhere gets out = 0.

Keys are a contiguous run per request and query i sees the first key_limits[i] of them: every
causal pattern of the context-parallel layout has that shape (servelm.parallel.context_layout).
Prefill-sized parts on CPU are computed by torch's flash-attention kernel for CPU (the op SDPA
dispatches to there, which also returns the log-sum-exp; ~3.5x faster than the math at 2048 x 4096,
9 heads, one thread). Everything else, and every part on other devices, is plain torch math in
float32, GQA as one matrix per KV head (its G = H / KVH query heads as rows), so K/V are never
repeated: for a few queries the kernel's K/V repeat per head costs more than the attention
(1 query over 4096 keys: 7.5 ms vs 0.8 ms; 64 queries: 10 vs 12 ms). Queries go a band at a time, and each band reads
only the keys its queries can see (a causal prompt's early queries skip most of them).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# Scores of one tile ([B, H, queries, keys] float32) stay under this many bytes: long prefills
# are attended a band of queries at a time instead of materialising [H, T, T].
SCORE_TILE_BYTES = 32 * 1024 * 1024


def partial_attention(
    q: torch.Tensor,  # [Tq, H, D]
    k: torch.Tensor,  # [Tk, KVH, D]
    v: torch.Tensor,  # [Tk, KVH, D]
    key_limits: torch.Tensor,  # [Tq] long: query i sees keys [0, key_limits[i])
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # out [Tq, H, D] in q's dtype, lse [Tq, H] float32
    """One request's queries over a run of its keys (see the module). Pure."""
    out, lse = padded_partial_attention(q[None], k[None], v[None], key_limits[None], scale)
    return out[0], lse[0]


def causal_partial_attention(
    q: torch.Tensor,  # [Tq, H, D]
    k: torch.Tensor,  # [Tk, KVH, D]
    v: torch.Tensor,  # [Tk, KVH, D]
    first_limit: int,  # query i sees keys [0, min(first_limit + i, Tk))
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # out [Tq, H, D] in q's dtype, lse [Tq, H] float32
    """`partial_attention` for key limits that grow by one per query: every (request, rank) pair of
    context parallelism's ring has that shape, since a rank's queries are every C-th position.

    On CPU (prefill-sized) it is maskless kernel calls, so the kernel skips the causal triangle
    instead of reading a mask; with first_limit = L >= 1:

        keys [0, L - 1)       every query sees them                          (dense)
        keys [L - 1, ...)     query i sees the first i + 1 of them           (causal, top-left)

    one call when L = 1 (a fresh prompt's shards of ranks at or before this one), two merged
    otherwise; with L = 0 (the shards of later ranks) query 0 sees nothing and q[1:] is causal.
    """
    num_queries, num_keys = q.shape[0], k.shape[0]
    if not _use_flash(q, num_queries):
        limits = (torch.arange(num_queries, device=q.device) + first_limit).clamp_(max=num_keys)
        return partial_attention(q, k, v, limits, scale)
    skip = 0 if first_limit >= 1 else 1  # leading queries that see no key
    prefix = min(max(first_limit - 1, 0), num_keys)
    rest = min(num_queries - skip, num_keys - prefix)  # keys the last query sees past the prefix
    outs, lses = [], []
    if prefix:
        out, lse = _flash(q, k[:prefix], v[:prefix], scale, causal=False)
        outs.append(out)
        lses.append(lse)
    if rest > 0:
        out, lse = _flash(q[skip:], k[prefix : prefix + rest], v[prefix : prefix + rest], scale, causal=True)
        if skip:  # query 0 sees none of these keys
            out = torch.cat([out.new_zeros(skip, *out.shape[1:]), out])
            lse = torch.cat([lse.new_full((skip, lse.shape[1]), float("-inf")), lse])
        outs.append(out)
        lses.append(lse)
    if not outs:
        return q.new_zeros(q.shape), torch.full(q.shape[:2], float("-inf"), device=q.device)
    return merge_partials_with_lse(outs, lses) if len(outs) > 1 else (outs[0], lses[0])


def _flash(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:  # out [Tq, H, D], lse [Tq, H] float32
    """q [Tq, H, D] over every key of k/v [Tk, KVH, D] (or top-left causal) with torch's CPU kernel."""
    group = q.shape[1] // k.shape[1]
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.transpose(0, 1)[None],  # [1, H, Tq, D]
        k.transpose(0, 1).repeat_interleave(group, dim=0)[None],  # [1, H, Tk, D]
        v.transpose(0, 1).repeat_interleave(group, dim=0)[None],
        0.0,
        causal,
        scale=scale,
    )
    return out[0].transpose(0, 1), lse[0].float().transpose(0, 1)


def _use_flash(q: torch.Tensor, num_queries: int) -> bool:
    return q.device.type == "cpu" and q.dtype in _FLASH_CPU_DTYPES and num_queries >= FLASH_MIN_QUERIES


def padded_partial_attention(
    q: torch.Tensor,  # [B, Q, H, D]: B requests' queries, padded to Q
    k: torch.Tensor,  # [B, L, KVH, D]: their keys, padded to L
    v: torch.Tensor,  # [B, L, KVH, D]
    key_limits: torch.Tensor,  # [B, Q] long: query j of request b sees keys [0, key_limits[b, j]) of its row
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # out [B, Q, H, D] in q's dtype, lse [B, Q, H] float32
    """`partial_attention` for B requests at once (decodes side by side); padding keys past a
    row's limits are never seen, padding queries are computed and the caller drops them."""
    batch, num_queries, num_heads, head_dim = q.shape
    length, num_kv_heads = k.shape[1], k.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not group over {num_kv_heads} KV heads")
    out = q.new_zeros(q.shape)
    lse = torch.full((batch, num_queries, num_heads), float("-inf"), device=q.device)
    if length == 0 or num_queries == 0 or batch == 0:
        return out, lse
    flash = _use_flash(q, num_queries)
    if flash:  # [B, H, L, D]: the kernel wants as many K/V heads as query heads
        group = num_heads // num_kv_heads
        k = k.transpose(1, 2).repeat_interleave(group, dim=1)
        v = v.transpose(1, 2).repeat_interleave(group, dim=1)
    else:  # [B, KVH, L, D] float32
        k, v = k.float().transpose(1, 2), v.float().transpose(1, 2)
    tile = max(1, SCORE_TILE_BYTES // (4 * batch * num_heads * length))
    for a in range(0, num_queries, tile):
        b = min(a + tile, num_queries)
        limits = key_limits[:, a:b]
        seen = min(int(limits.max()), length)  # no query of the band sees a key past this one
        if seen == 0:
            continue
        attend = _flash_band if flash else _math_band
        out[:, a:b], lse[:, a:b] = attend(q[:, a:b], k[:, :, :seen], v[:, :, :seen], limits, scale)
    return out, lse


# What torch's CPU flash-attention kernel computes in (it returns the log-sum-exp in float32), and
# the fewest queries per request it is used for (measured above: the math wins up to ~16).
_FLASH_CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FLASH_MIN_QUERIES = 32


def _hidden_keys(limits: torch.Tensor, length: int) -> torch.Tensor:  # [B, n, L] bool, True = not seen
    return torch.arange(length, device=limits.device) >= limits[..., None]


def _flash_band(
    q: torch.Tensor,  # [B, n, H, D]
    k: torch.Tensor,  # [B, H, L, D]
    v: torch.Tensor,  # [B, H, L, D]
    limits: torch.Tensor,  # [B, n] long
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # [B, n, H, D], [B, n, H] float32
    hidden = _hidden_keys(limits, k.shape[2])
    mask = torch.zeros(hidden.shape, dtype=q.dtype, device=q.device).masked_fill_(hidden, float("-inf"))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.transpose(1, 2), k, v, 0.0, False, attn_mask=mask[:, None], scale=scale
    )  # [B, H, n, D], [B, H, n]
    # The kernel gives a query that sees no key out = 0 but lse = 0; the merge needs -inf.
    lse = lse.float().transpose(1, 2).masked_fill((limits == 0)[..., None], float("-inf"))
    return out.transpose(1, 2), lse


def _math_band(
    q: torch.Tensor,  # [B, n, H, D]
    k: torch.Tensor,  # [B, KVH, L, D] float32
    v: torch.Tensor,  # [B, KVH, L, D] float32
    limits: torch.Tensor,  # [B, n] long
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # [B, n, H, D], [B, n, H] float32
    batch, n, num_heads, head_dim = q.shape
    num_kv_heads, length = k.shape[1], k.shape[2]
    group = num_heads // num_kv_heads
    # [B, n, KVH, G, D] → [B, KVH, n*G, D]: the G heads of a KV head are rows of one matrix.
    qt = q.float().view(batch, n, num_kv_heads, group, head_dim).permute(0, 2, 1, 3, 4)
    scores = torch.matmul(qt.reshape(batch, num_kv_heads, n * group, head_dim), k.transpose(-1, -2))
    scores = scores.mul_(scale).view(batch, num_kv_heads, n, group, length)
    scores.masked_fill_(_hidden_keys(limits, length)[:, None, :, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, KVH, n, G]; -inf where nothing is seen
    # exp(s - lse) is the softmax; a row that sees nothing subtracts 0 and stays all zeros.
    probs = scores.sub_(torch.nan_to_num(lse, neginf=0.0)[..., None]).exp_()
    out = torch.matmul(probs.view(batch, num_kv_heads, n * group, length), v)  # [B, KVH, n*G, D]
    out = out.view(batch, num_kv_heads, n, group, head_dim).permute(0, 2, 1, 3, 4)
    # head h = kv_head * G + g, as in Hugging Face's repeat_kv
    return out.reshape(batch, n, num_heads, head_dim), lse.permute(0, 2, 1, 3).reshape(batch, n, num_heads)


def merge_partials_with_lse(
    outs: Sequence[torch.Tensor],  # P parts, each [..., H, D]
    lses: Sequence[torch.Tensor],  # P parts, each [..., H] float32
) -> tuple[torch.Tensor, torch.Tensor]:  # out [..., H, D] in outs[0]'s dtype, lse [..., H] float32
    """The exact attention over the union of the parts' keys, and its log-sum-exp (the module)."""
    if not outs or len(outs) != len(lses):
        raise ValueError(f"merge needs one lse per partial output, got {len(outs)} outputs and {len(lses)} lses")
    lse = torch.stack([x.float() for x in lses])  # [P, ..., H]
    peak = lse.amax(dim=0)
    # Shifted by the largest part's lse, the weights are in [0, 1] and one of them is 1, unless
    # every part is empty (peak = -inf): then shift by 0 and every weight is exp(-inf) = 0.
    weights = torch.exp(lse - torch.nan_to_num(peak, neginf=0.0))  # [P, ..., H]
    total = weights.sum(dim=0)
    merged = sum(w[..., None] * o.float() for w, o in zip(weights, outs))
    assert isinstance(merged, torch.Tensor)
    out = merged / torch.where(total > 0, total, 1.0)[..., None]
    return out.to(outs[0].dtype), peak + torch.log(total)


def merge_partials(outs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor]) -> torch.Tensor:
    """The exact attention output over the union of the parts' keys (`merge_partials_with_lse`)."""
    return merge_partials_with_lse(outs, lses)[0]
