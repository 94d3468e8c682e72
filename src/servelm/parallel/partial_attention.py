"""Attention over part of a request's keys, with its log-sum-exp, and the merge of such parts.

Context parallelism splits a request's keys over ranks; each rank attends the queries to the
keys it holds and gets, per query and head, a normalised partial output o_p and the log of its
softmax denominator lse_p = log sum_k exp(s_k). The exact attention over all keys is then

    lse = log sum_p exp(lse_p)          out = sum_p exp(lse_p - lse) * o_p

(the online-softmax combine). A part where a query sees no key has lse_p = -inf and o_p = 0 and
weighs nothing; a query that sees no key anywhere gets out = 0.

Keys are a contiguous run per request and query i sees the first key_limits[i] of them: every
causal pattern of the context-parallel layout has that shape (servelm.parallel.context_layout).
The math is plain torch in float32 (any device); GQA is computed by grouping the G = H / KVH
query heads that share a KV head into one matrix, so K/V are never repeated.
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
    group = num_heads // num_kv_heads
    k32 = k.float().transpose(1, 2)  # [B, KVH, L, D]
    v32 = v.float().transpose(1, 2)
    columns = torch.arange(length, device=q.device)
    tile = max(1, SCORE_TILE_BYTES // (4 * batch * num_heads * length))
    for a in range(0, num_queries, tile):
        b = min(a + tile, num_queries)
        n = b - a
        # [B, n, KVH, G, D] → [B, KVH, n*G, D]: the G heads of a KV head are rows of one matrix.
        qt = q[:, a:b].float().view(batch, n, num_kv_heads, group, head_dim).permute(0, 2, 1, 3, 4)
        scores = torch.matmul(qt.reshape(batch, num_kv_heads, n * group, head_dim), k32.transpose(-1, -2))
        scores = scores.mul_(scale).view(batch, num_kv_heads, n, group, length)
        hidden = columns >= key_limits[:, a:b, None]  # [B, n, L]: True = not seen
        scores.masked_fill_(hidden[:, None, :, None, :], float("-inf"))
        tile_lse = torch.logsumexp(scores, dim=-1)  # [B, KVH, n, G]; -inf where nothing is seen
        # exp(s - lse) is the softmax; a row that sees nothing subtracts 0 and stays all zeros.
        probs = scores.sub_(torch.nan_to_num(tile_lse, neginf=0.0)[..., None]).exp_()
        tile_out = torch.matmul(probs.view(batch, num_kv_heads, n * group, length), v32)  # [B, KVH, n*G, D]
        tile_out = tile_out.view(batch, num_kv_heads, n, group, head_dim).permute(0, 2, 1, 3, 4)
        out[:, a:b] = tile_out.reshape(batch, n, num_heads, head_dim)  # head h = kv_head * G + g
        lse[:, a:b] = tile_lse.permute(0, 2, 1, 3).reshape(batch, n, num_heads)
    return out, lse


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
