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

from servelm.structured.grammars import GrammarMatcher


@dataclass
class GrammarMasks:
    """The bitmasks of the step's constrained requests, one row each, once `rows` is done."""

    row_of: dict[str, int]  # request id -> its row in the bitmask
    rows: Future[torch.Tensor]  # int32 [len(row_of), words], on the host

    def for_rows(self, request_ids: list[str]) -> torch.Tensor | None:
        """The bitmask for sampler rows of these requests (a request's every row gets its mask; the
        others allow everything); None when none is constrained."""
        if not any(rid in self.row_of for rid in request_ids):
            return None
        filled = self.rows.result()
        out = torch.full((len(request_ids), filled.shape[1]), -1, dtype=torch.int32)
        for i, rid in enumerate(request_ids):
            row = self.row_of.get(rid)
            if row is not None:
                out[i] = filled[row]
        return out


class MaskFiller:
    """Fills the step's bitmasks on one worker thread (the backends release the GIL while filling)."""

    def __init__(self, vocab_size: int) -> None:
        self.num_words = (vocab_size + 31) // 32
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")
        self.last_fill_s = 0.0  # how long the last fill took (for the mask-time metric)

    def start(self, matchers: list[tuple[str, GrammarMatcher]]) -> GrammarMasks | None:
        if not matchers:
            return None
        return GrammarMasks({rid: i for i, (rid, _) in enumerate(matchers)}, self._executor.submit(self._fill, matchers))

    def _fill(self, matchers: list[tuple[str, GrammarMatcher]]) -> torch.Tensor:
        started = time.perf_counter()
        bitmask = torch.empty((len(matchers), self.num_words), dtype=torch.int32)
        for row, (_, matcher) in enumerate(matchers):
            matcher.fill_bitmask(bitmask, row)
        self.last_fill_s = time.perf_counter() - started
        return bitmask

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
