"""The runner's persistent block table and the vectorised positions / slot mapping built over it."""

from __future__ import annotations

import random

import pytest
import torch

from servelm.attention.backend import slots_of
from servelm.worker.block_table import BlockTable
from servelm.worker.paged_inputs import token_positions


def _rows(table: BlockTable) -> list[list[int]]:
    return table.table.tolist()


def test_add_append_remove_exact_contents_and_row_reuse():
    table = BlockTable(max_num_requests=3, max_blocks_per_request=8, initial_width=4)
    assert table.add("a", [7, 2]) == 0
    assert table.add("b", []) == 1  # a prefix-less request before its first allocation
    assert table.add("c", [4]) == 2
    table.append("a", [9])
    table.append("b", [11, 12])
    assert _rows(table) == [[7, 2, 9, 0], [11, 12, 0, 0], [4, 0, 0, 0]]
    assert table.num_blocks == [3, 2, 1]

    table.remove("a")
    assert _rows(table) == [[0, 0, 0, 0], [11, 12, 0, 0], [4, 0, 0, 0]]  # freed and zeroed
    assert table.add("d", [5]) == 0  # the freed row is reused
    table.remove("c")
    table.remove("d")
    assert table.add("e", [1, 3]) == 0  # the lowest free row first
    assert _rows(table) == [[1, 3, 0, 0], [11, 12, 0, 0], [0, 0, 0, 0]]
    assert table.block_ids("e") == [1, 3] and table.block_ids("b") == [11, 12]


def test_width_grows_keeping_contents_up_to_the_cap():
    table = BlockTable(max_num_requests=2, max_blocks_per_request=10, initial_width=2)
    table.add("a", [1, 2])
    table.add("b", [3])
    table.append("a", [4])  # 3 blocks > width 2: doubles to 4
    assert table.table.shape == (2, 4)
    assert _rows(table) == [[1, 2, 4, 0], [3, 0, 0, 0]]
    table.append("b", [5, 6, 7, 8, 9])  # 6 blocks > width 4: doubles to 8
    assert table.table.shape == (2, 8)
    table.append("b", [10, 11, 12, 13])  # 10 blocks: capped at max_blocks_per_request
    assert table.table.shape == (2, 10)
    assert table.block_ids("b") == [3, 5, 6, 7, 8, 9, 10, 11, 12, 13]
    assert table.block_ids("a") == [1, 2, 4]
    assert table.table.dtype == torch.int32


def test_bad_use_raises_clear_errors():
    table = BlockTable(max_num_requests=1, max_blocks_per_request=2)
    table.add("a", [1])
    with pytest.raises(ValueError, match="already has"):
        table.add("a", [2])
    with pytest.raises(RuntimeError, match="full"):
        table.add("b", [2])
    with pytest.raises(ValueError, match="max_blocks_per_request"):
        table.append("a", [2, 3])
    with pytest.raises(KeyError, match="no block table row"):
        table.append("zzz", [1])
    with pytest.raises(ValueError, match="must be positive"):
        BlockTable(0, 4)


def test_vectorised_positions_and_slots_equal_the_formula():
    """Random requests in scattered table rows: every token's position and slot by hand."""
    rng = random.Random(4)
    block_size = 4
    table = BlockTable(max_num_requests=8, max_blocks_per_request=40, initial_width=2)
    free_blocks = list(range(300))
    rng.shuffle(free_blocks)
    requests = []  # (request_id, num_computed, query_len)
    for i in range(8):
        request_id = f"r{i}"
        seq_len = rng.randint(1, 150)
        num_computed = rng.randint(0, seq_len - 1)
        num_blocks = (seq_len + block_size - 1) // block_size
        first = rng.randint(0, num_blocks)  # some blocks on add, the rest appended later
        table.add(request_id, [free_blocks.pop() for _ in range(first)])
        table.append(request_id, [free_blocks.pop() for _ in range(num_blocks - first)])
        requests.append((request_id, num_computed, seq_len - num_computed))
    table.remove("r3")  # a hole: rows are not in batch order
    requests = [r for r in requests if r[0] != "r3"]
    rng.shuffle(requests)

    num_computed = torch.tensor([r[1] for r in requests])
    query_lens = torch.tensor([r[2] for r in requests])
    rows = torch.tensor([table.row(r[0]) for r in requests])
    positions, request_of_token = token_positions(num_computed, query_lens)
    slots = slots_of(table.table, rows[request_of_token], positions, block_size)

    expected_positions, expected_slots = [], []
    for request_id, start, q_len in requests:
        block_ids = table.block_ids(request_id)
        for pos in range(start, start + q_len):
            expected_positions.append(pos)
            expected_slots.append(block_ids[pos // block_size] * block_size + pos % block_size)
    assert positions.tolist() == expected_positions
    assert slots.tolist() == expected_slots
    assert slots.dtype == torch.long
