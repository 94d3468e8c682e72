"""DraftModelProposer: greedy drafts from a draft model whose K/V live in the target's blocks.

One propose() for the requests that sampled this step (n = len(token_ids), the newest last):

    1. one catch-up forward, batched over requests: each feeds its tokens from the first position
       whose draft K/V it lacks, v, up to its last token; the last token's logits give draft 1
           tokens:          t0 t1 ... t(v-1) | t(v) ... t(n-1)
           draft K/V:       valid            | fed now, at positions v .. n-1
       (a self-speculative draft has v = n - 1 always: below that the K/V are the target's own)
    2. k - 1 single-token forwards, batched over the requests still drafting: draft j is fed at
       position n - 1 + j and its logits give draft j + 1.

So k drafts write positions v .. n + k - 2, all in the request's own block table row. The
scheduler reserves num_speculative_tokens slots past each decode step's tokens for them; after a
prompt's last chunk the blocks may hold fewer, and a request drafts only as many as fit (maybe 0).

Drafts are the draft model's argmax: a deterministic function of the context, the point-mass
proposal that verification (spec_verify.py) assumes — exact for greedy and for sampling.

A separate draft model keeps, per request, which of its positions hold K/V of the request's real
tokens, and which hold its last guesses (valid only as far as the guesses were accepted). Its
first propose() after the prompt is the whole prompt through the draft; a catch-up longer than
`max_catch_up_tokens` (over all requests of one call) goes in chunks over several steps, the
request drafting nothing until its chunk reaches its last token. Its catch-up rewrites positions in
prefix-cached blocks that other running requests share: with the same tokens at the same positions
(a block's hash covers its whole prefix), so what their drafts read there stays right. Whatever the
draft's K/V hold, the target's output cannot change: only acceptance can.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from servelm.spec.proposer import DraftRequest
from servelm.worker.block_table import BlockTable
from servelm.worker.draft_model import DraftModel
from servelm.worker.model_runner import attention_backend_of
from servelm.worker.paged_inputs import paged_attention_inputs


@dataclass
class _DraftKV:
    """A separate draft's K/V of one request: positions [0, num_real) hold its real tokens', the
    next len(guesses) positions hold the guesses fed after them."""

    num_real: int = 0
    guesses: list[int] = field(default_factory=list)

    def num_valid(self, token_ids: Sequence[int]) -> int:
        """Positions whose K/V were computed from the request's actual tokens."""
        matched = 0
        for guess, token in zip(self.guesses, token_ids[self.num_real :]):
            if guess != token:
                break
            matched += 1
        return self.num_real + matched


@dataclass(frozen=True)
class _Feed:
    """One request's tokens in one draft forward."""

    request_id: str
    row: int  # its block table row
    start: int  # position of the first token fed; the draft's K/V below it are valid
    token_ids: list[int]  # fed at positions start .. start + len - 1
    num_drafts: int  # drafts it gets this call; 0: catch-up only (its last token is not fed)


class DraftModelProposer:
    """Contract: `Proposer` (servelm.spec.proposer). Called by the ModelRunner in its step, after
    sampling, with requests that have a row in `block_table` (the runner's own, updated by it);
    writes the draft's K/V (a self-speculative draft's: into the target's first layers' caches) at
    positions the target has not computed, inside the request's blocks. `release` is safe twice."""

    def __init__(self, draft: DraftModel, block_table: BlockTable, block_size: int, max_catch_up_tokens: int) -> None:
        if max_catch_up_tokens < 1:
            raise ValueError(f"max_catch_up_tokens must be >= 1, got {max_catch_up_tokens}")
        self.draft = draft
        self.backend = attention_backend_of(draft.model)
        self.block_table = block_table
        self.block_size = block_size
        self.max_catch_up_tokens = max_catch_up_tokens  # tokens in the first forward of one propose()
        weight = draft.model.embed_tokens.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.kv_dtype = draft.kv_caches[0].dtype  # what its pool stores (the target's when it shares it)
        self._kv: dict[str, _DraftKV] = {}  # separate draft only

    def propose(self, requests: Sequence[DraftRequest]) -> dict[str, list[int]]:
        feeds = self._plan(requests)
        if not feeds:
            return {}
        drafts: dict[str, list[int]] = {f.request_id: [] for f in feeds if f.num_drafts > 0}
        for feed, token in zip(feeds, self._forward(feeds)):
            if feed.num_drafts > 0:
                drafts[feed.request_id].append(token)
        # Draft j (1-based) of a request whose last token sat at position n - 1 goes in at n - 1 + j.
        ends = {f.request_id: f.start + len(f.token_ids) for f in feeds}  # n, for the drafting ones
        for j in range(1, max(f.num_drafts for f in feeds)):
            step = [
                _Feed(f.request_id, f.row, ends[f.request_id] - 1 + j, [drafts[f.request_id][-1]], f.num_drafts)
                for f in feeds
                if f.num_drafts > j
            ]
            for feed, token in zip(step, self._forward(step)):
                drafts[feed.request_id].append(token)
        if not self.draft.shares_target_kv:
            for feed in feeds:
                # The last draft was never fed; the ones before it were, after the real tokens.
                self._kv[feed.request_id] = _DraftKV(ends[feed.request_id], drafts.get(feed.request_id, [])[:-1])
        return drafts

    def release(self, request_id: str, token_ids: Sequence[int] | None) -> None:
        """Its blocks go back to the pool (or are taken away): the draft K/V in them are forgotten."""
        self._kv.pop(request_id, None)

    def _plan(self, requests: Sequence[DraftRequest]) -> list[_Feed]:
        """Each request's tokens for the first forward, within the catch-up budget: the requests
        needing fewest tokens first, so one long catch-up never costs the others their drafts."""
        wanted = []
        for request in requests:
            n = len(request.token_ids)
            row = self.block_table.row(request.request_id)
            capacity = self.block_table.num_blocks[row] * self.block_size
            # k drafts write positions n - 1 .. n + k - 2: the last token's, then guesses 1 .. k - 1.
            num_drafts = max(0, min(request.max_draft_tokens, capacity - (n - 1)))
            start = min(self._num_valid(request), n - 1)
            end = n if num_drafts > 0 else n - 1  # without room to draft, only catch up
            if start < end:
                wanted.append(_Feed(request.request_id, row, start, list(request.token_ids[start:end]), num_drafts))
        feeds = []
        budget = self.max_catch_up_tokens
        for feed in sorted(wanted, key=lambda f: len(f.token_ids)):
            if budget <= 0:
                break
            if len(feed.token_ids) > budget:  # a first chunk now, the rest (and its drafts) later
                feed = _Feed(feed.request_id, feed.row, feed.start, feed.token_ids[:budget], 0)
            feeds.append(feed)
            budget -= len(feed.token_ids)
        return feeds

    def _num_valid(self, request: DraftRequest) -> int:
        """Leading positions whose draft K/V match the request's tokens."""
        if self.draft.shares_target_kv:
            # The target computed every position but the last token's (it sampled after them).
            return len(request.token_ids) - 1
        kv = self._kv.get(request.request_id)
        return kv.num_valid(request.token_ids) if kv is not None else 0

    def _forward(self, feeds: list[_Feed]) -> list[int]:
        """Run the draft over `feeds` (writing their K/V); the argmax after each feed's last token."""
        starts = torch.tensor([f.start for f in feeds], dtype=torch.long)  # [R]
        query_lens = torch.tensor([len(f.token_ids) for f in feeds], dtype=torch.long)  # [R]
        rows = torch.tensor([f.row for f in feeds], dtype=torch.long)  # [R]
        positions, common = paged_attention_inputs(
            self.block_table.table, rows, starts, query_lens, self.block_size, self.device, self.dtype, self.kv_dtype
        )
        input_ids = torch.tensor([t for f in feeds for t in f.token_ids], dtype=torch.long).to(self.device)
        model = self.draft.model
        hidden = model(
            input_ids,
            positions.to(self.device, non_blocking=True),
            self.backend.build_metadata(common),
            self.draft.kv_caches,
            num_layers=self.draft.num_layers,
        )  # [T, hidden]
        last_rows = (common.query_start_loc[1:] - 1).to(self.device, dtype=torch.long)  # [R]
        return model.compute_logits(hidden[last_rows]).argmax(dim=-1).tolist()
