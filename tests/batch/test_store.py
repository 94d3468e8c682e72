"""The batch store on a real SQLite file: a line is finished once (its result kept, counted once),
duplicate custom_ids refuse the whole input, a second connection (a restarted process) sees what
the first committed, and results come back in input order a page at a time."""

from __future__ import annotations

import pytest

from servelm.batch.records import LINE_ERROR, LINE_OUTPUT, BatchRecord, FileRecord
from servelm.batch.store import BatchStore, DuplicateCustomId


def batch(batch_id: str = "batch_1", created_at: int = 100) -> BatchRecord:
    return BatchRecord(batch_id, "t", "/v1/completions", "file-1", "24h", 86400.0, created_at)


def test_a_line_is_finished_and_counted_once(tmp_path):
    store = BatchStore(tmp_path / "b.sqlite3")
    store.add_batch(batch())
    assert store.replace_lines("batch_1", [(1, "a", 0, 10, None), (2, "b", 10, 10, None), (3, None, 20, 5, "bad")]) == 3
    assert store.counts("batch_1") == (3, 0, 1)  # the unparsable line is done already
    assert [line.custom_id for line in store.pending_lines("batch_1", 0, 10)] == ["a", "b"]
    assert store.finish_line("batch_1", 2, True, "rb")
    assert not store.finish_line("batch_1", 2, False, "again")  # a second finish changes nothing
    assert store.counts("batch_1") == (3, 1, 1)
    assert list(store.results("batch_1", LINE_OUTPUT)) == ["rb"] and list(store.results("batch_1", LINE_ERROR)) == ["bad"]
    store.close()
    reopened = BatchStore(tmp_path / "b.sqlite3")  # as a restarted process finds it
    assert [line.line_no for line in reopened.pending_lines("batch_1", 0, 10)] == [1]
    assert reopened.get_batch("batch_1").total == 3 and [b.id for b in reopened.active_batches()] == ["batch_1"]


def test_duplicate_custom_ids_refuse_the_whole_input(tmp_path):
    store = BatchStore(tmp_path / "b.sqlite3")
    store.add_batch(batch())
    with pytest.raises(DuplicateCustomId) as duplicate:
        store.replace_lines("batch_1", [(1, "a", 0, 1, None), (2, "b", 1, 1, None), (4, "a", 2, 1, None)])
    assert duplicate.value.line_no == 4 and duplicate.value.custom_id == "a"
    assert store.pending_lines("batch_1", 0, 10) == [] and store.counts("batch_1") == (0, 0, 0)


def test_results_page_in_input_order_and_saving_keeps_counts_and_cancels(tmp_path):
    store = BatchStore(tmp_path / "b.sqlite3")
    record = batch()
    store.add_batch(record)
    store.replace_lines("batch_1", [(i, f"c{i}", i, 1, None) for i in range(1, 1001)])
    for i in reversed(range(1, 1001)):
        store.finish_line("batch_1", i, True, f"r{i}")
    assert list(store.results("batch_1", LINE_OUTPUT, page=7)) == [f"r{i}" for i in range(1, 1001)]
    assert store.mark_cancelling("batch_1", 123)
    record.status = "in_progress"  # a runner's stale copy, saved after the cancel
    store.save_batch(record)
    saved = store.get_batch("batch_1")
    assert saved.cancelling_at == 123 and saved.completed == 1000 and saved.total == 1000


def test_files_and_batches_list_newest_first_with_a_cursor(tmp_path):
    store = BatchStore(tmp_path / "b.sqlite3")
    for i in range(5):
        store.add_file(FileRecord(f"file-{i}", "t", "batch", "x.jsonl", 1, 100 + i))
        store.add_batch(batch(f"batch_{i}", 100 + i))
    store.add_file(FileRecord("file-other", "u", "batch", "x.jsonl", 1, 200))
    assert [f.id for f in store.list_files("t", None, 2, None, True)] == ["file-4", "file-3"]
    assert [f.id for f in store.list_files("t", None, 10, "file-3", True)] == ["file-2", "file-1", "file-0"]
    assert [f.id for f in store.list_files("t", "batch", 2, "file-1", False)] == ["file-2", "file-3"]
    assert [b.id for b in store.list_batches("t", 10, "batch_2")] == ["batch_1", "batch_0"]
    assert store.count_files("u") == 1
