"""The runner's block tables as one persistent CPU tensor, updated from the scheduler's diffs.

    table (int32, [max_num_requests, width]):
        row 0: | 7 | 2 | 9 | 0 | ...     request "a" (3 blocks)
        row 1: | 4 | 0 | 0 | 0 | ...     request "c" (1 block)
        row 2: | 0 | 0 | 0 | 0 | ...     free (its request finished; the next add takes it)

A request gets a row when the runner first sees it (`add`, with the blocks the scheduler
has given it so far); the blocks of later steps are appended (`append`); finishing or
preemption frees the row (`remove`), zeroed for the next request. Entries past a
request's blocks are 0 and never read (every read stops at the request's length).
The width doubles when a request outgrows it, up to what max_model_len needs.
"""

from __future__ import annotations

import torch


class BlockTable:
    def __init__(self, max_num_requests: int, max_blocks_per_request: int, initial_width: int = 16) -> None:
        if max_num_requests < 1 or max_blocks_per_request < 1:
            raise ValueError(
                f"max_num_requests ({max_num_requests}) and max_blocks_per_request "
                f"({max_blocks_per_request}) must be positive"
            )
        self.max_blocks_per_request = max_blocks_per_request
        width = min(initial_width, max_blocks_per_request)
        self.table = torch.zeros(max_num_requests, width, dtype=torch.int32)  # [rows, width] block ids
        self.num_blocks = [0] * max_num_requests  # blocks held by each row's request
        self._row_of: dict[str, int] = {}
        self._free_rows = list(range(max_num_requests - 1, -1, -1))  # a stack: row 0 is taken first

    @classmethod
    def for_requests(cls, max_num_requests: int, max_model_len: int, block_size: int) -> BlockTable:
        """Room for `max_num_requests` requests of up to `max_model_len` tokens each."""
        return cls(max_num_requests, (max_model_len + block_size - 1) // block_size)

    def add(self, request_id: str, block_ids: list[int]) -> int:
        """Give a request the lowest free row, holding `block_ids`; returns the row."""
        if request_id in self._row_of:
            raise ValueError(f"request {request_id!r} already has block table row {self._row_of[request_id]}")
        if not self._free_rows:
            raise RuntimeError(f"block table is full: all {self.table.shape[0]} rows hold live requests")
        row = self._free_rows.pop()
        self._row_of[request_id] = row
        self.append(request_id, block_ids)
        return row

    def append(self, request_id: str, block_ids: list[int]) -> None:
        """Append a request's new blocks after those it holds."""
        if not block_ids:
            return
        row = self.row(request_id)
        start = self.num_blocks[row]
        end = start + len(block_ids)
        if end > self.max_blocks_per_request:
            raise ValueError(
                f"request {request_id!r} would hold {end} blocks, more than max_blocks_per_request "
                f"{self.max_blocks_per_request}"
            )
        if end > self.table.shape[1]:
            self._grow(end)
        self.table[row, start:end] = torch.tensor(block_ids, dtype=torch.int32)
        self.num_blocks[row] = end

    def remove(self, request_id: str) -> None:
        """Free a request's row (zeroed) for the next one."""
        row = self._row_of.pop(request_id)
        self.table[row, : self.num_blocks[row]] = 0
        self.num_blocks[row] = 0
        self._free_rows.append(row)
        self._free_rows.sort(reverse=True)  # lowest row on top: the table stays dense at the top

    def row(self, request_id: str) -> int:
        if request_id not in self._row_of:
            raise KeyError(f"request {request_id!r} has no block table row")
        return self._row_of[request_id]

    def block_ids(self, request_id: str) -> list[int]:
        row = self.row(request_id)
        return self.table[row, : self.num_blocks[row]].tolist()

    def _grow(self, min_width: int) -> None:
        width = self.table.shape[1]
        while width < min_width:
            width *= 2
        width = min(width, self.max_blocks_per_request)
        grown = torch.zeros(self.table.shape[0], width, dtype=torch.int32)
        grown[:, : self.table.shape[1]] = self.table
        self.table = grown
