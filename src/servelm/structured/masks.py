"""One step's token bitmasks: filled on a worker thread while the forward runs, read by the sampler.

A bitmask row is int32 [ceil(vocab / 32)], bit i of word w allowing token 32 w + i (the layout
both backends fill). EngineCore starts the fill right after schedule(); the runner waits for it
only when it samples, so the mask costs the step the part of its time the forward did not hide.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from servelm.structured.grammars import SamplingGrammar


@dataclass
class GrammarMasks:
    """The bitmasks of the step's constrained requests once `rows` is done: one row per sampler row
    of each (1 + its drafts: the mask after the drafts before that position)."""

    first_row: dict[str, int]  # request id -> its first row in the bitmask (its others follow)
    rows: Future[torch.Tensor]  # int32 [rows, words], on the host

    def for_rows(self, request_ids: list[str]) -> torch.Tensor | None:
        """The bitmask of the sampler rows, given each row's request (a request's rows together, in
        order); free rows allow everything. None when no row is constrained."""
        if not any(rid in self.first_row for rid in request_ids):
            return None
        filled = self.rows.result()
        out = torch.full((len(request_ids), filled.shape[1]), -1, dtype=torch.int32)
        next_row = dict(self.first_row)
        for i, rid in enumerate(request_ids):
            row = next_row.get(rid)
            if row is not None:
                out[i] = filled[row]
                next_row[rid] = row + 1
        return out


class MaskFiller:
    """Fills the step's bitmasks on one worker thread (the backends release the GIL while filling)."""

    def __init__(self, vocab_size: int) -> None:
        self.num_words = (vocab_size + 31) // 32
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")
        self.last_fill_s = 0.0  # how long the last fill took
        self._fills: list[float] = []  # every fill's seconds since take_fill_times (the mask-time metric)

    def start(self, matchers: list[SamplingGrammar]) -> GrammarMasks | None:
        """Start filling the masks of these requests' sampler rows; None when there are none."""
        if not matchers:
            return None
        first_row, row = {}, 0
        for sampling in matchers:
            first_row[sampling.request_id] = row
            row += 1 + len(sampling.drafts)
        return GrammarMasks(first_row, self._executor.submit(self._fill, matchers, row))

    def _fill(self, matchers: list[SamplingGrammar], num_rows: int) -> torch.Tensor:
        started = time.perf_counter()
        bitmask = torch.empty((num_rows, self.num_words), dtype=torch.int32)
        row = 0
        for sampling in matchers:
            matcher = sampling.matcher
            matcher.fill_bitmask(bitmask, row)
            for draft in sampling.drafts:  # the masks after each draft (the scheduler cut them to what the grammar accepts)
                row += 1
                if not matcher.accept(draft):
                    raise RuntimeError(f"{sampling.request_id}: draft {draft} refused by its grammar after the cut")
                matcher.fill_bitmask(bitmask, row)
            matcher.rollback(len(sampling.drafts))
            row += 1
        self.last_fill_s = time.perf_counter() - started
        self._fills.append(self.last_fill_s)
        return bitmask

    def take_fill_times(self) -> list[float]:
        fills, self._fills = self._fills, []
        return fills

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
