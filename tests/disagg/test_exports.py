"""ExportRegistry: what a pull's next block is in each state of an export, and who is woken."""

import threading
import time

import pytest
from disagg_helpers import HostStore, block_hash, block_payload

from servelm.datatypes import KVExportEnd
from servelm.disagg.exports import ExportRegistry
from servelm.disagg.protocol import PullFailure

WAIT_S = 0.3


def make_registry() -> tuple[ExportRegistry, HostStore]:
    store = HostStore()
    registry = ExportRegistry(store.lookup, wait_s=WAIT_S)
    store.registry = registry
    return registry, store


def hashes(transfer_id: str, count: int) -> list[bytes]:
    return [block_hash(transfer_id, index) for index in range(count)]


def test_open_export_serves_saved_blocks_and_waits_for_the_rest():
    registry, store = make_registry()
    registry.announce("t", hashes("t", 3))
    store.save("t", [0])
    arrived = time.monotonic()
    found = registry.next_block("t", block_hash("t", 0), arrived)
    assert isinstance(found, memoryview) and bytes(found) == block_payload("t", 0)
    assert registry.next_block("t", block_hash("t", 1), arrived) is None  # being computed
    store.save("t", [1])
    assert bytes(registry.next_block("t", block_hash("t", 1), arrived)) == block_payload("t", 1)


@pytest.mark.parametrize("why", [KVExportEnd.COMPLETE, KVExportEnd.ABORTED])
def test_an_ended_export_reports_absent_blocks_missing_and_still_serves_present_ones(why):
    registry, store = make_registry()
    registry.announce("t", hashes("t", 3))
    store.save("t", [0, 2])
    registry.end("t", why)
    arrived = time.monotonic()
    assert bytes(registry.next_block("t", block_hash("t", 0), arrived)) == block_payload("t", 0)
    assert registry.next_block("t", block_hash("t", 1), arrived) is PullFailure.MISSING
    assert bytes(registry.next_block("t", block_hash("t", 2), arrived)) == block_payload("t", 2)


def test_a_hash_never_announced_is_missing_unless_the_store_has_it():
    registry, store = make_registry()
    registry.announce("t", hashes("t", 1))
    store.save("other", [0])
    arrived = time.monotonic()
    assert registry.next_block("t", block_hash("t", 5), arrived) is PullFailure.MISSING
    # A block the host tier holds anyway (another prompt saved it) is served.
    assert bytes(registry.next_block("t", block_hash("other", 0), arrived)) == block_payload("other", 0)


def test_an_unknown_transfer_waits_wait_s_for_its_announce_then_fails_unknown():
    registry, store = make_registry()
    store.save("t", [0])
    assert registry.next_block("t", block_hash("t", 0), time.monotonic()) is None
    assert registry.next_block("t", block_hash("t", 0), time.monotonic() - WAIT_S) is PullFailure.UNKNOWN
    registry.announce("t", hashes("t", 1))  # a late announce, within a pull's wait
    assert registry.next_block("t", block_hash("t", 0), time.monotonic() - WAIT_S) is not None


def test_expired_fails_at_once_and_a_new_announce_starts_afresh():
    registry, store = make_registry()
    registry.announce("t", hashes("t", 1))
    store.save("t", [0])
    registry.end("t", KVExportEnd.EXPIRED)
    assert registry.next_block("t", block_hash("t", 0), time.monotonic()) is PullFailure.EXPIRED
    registry.end("never-announced", KVExportEnd.EXPIRED)
    assert registry.next_block("never-announced", b"x", time.monotonic()) is PullFailure.EXPIRED
    registry.announce("t", hashes("t", 1))
    assert registry.next_block("t", block_hash("t", 0), time.monotonic()) is not None


def test_announce_twice_keeps_the_state():
    registry, _ = make_registry()
    registry.announce("t", hashes("t", 2))
    registry.end("t", KVExportEnd.COMPLETE)
    registry.announce("t", hashes("t", 2))
    assert registry.next_block("t", block_hash("t", 1), time.monotonic()) is PullFailure.MISSING


def test_take_served_reports_each_served_pull_once_and_forgets_expired():
    registry, _ = make_registry()
    registry.announce("a", hashes("a", 1))
    registry.announce("b", hashes("b", 1))
    registry.mark_served("a")
    registry.end("b", KVExportEnd.EXPIRED)
    registry.mark_served("b")  # a pull of a forgotten transfer: nothing to release
    assert registry.take_served() == ["a"]
    assert registry.take_served() == []


def test_listeners_hear_every_change_from_any_thread():
    registry, store = make_registry()
    calls: list[str] = []

    def listener() -> None:
        calls.append(threading.current_thread().name)

    registry.add_listener(listener)
    registry.announce("t", hashes("t", 1))
    store.save("t", [0])
    saver = threading.Thread(target=lambda: registry.end("t", KVExportEnd.COMPLETE), name="runner")
    saver.start()
    saver.join()
    assert calls == ["MainThread", "MainThread", "runner"]
    registry.remove_listener(registry.remove_listener)  # never added: ignored
    registry.remove_listener(listener)
    registry.notify_saved()
    assert len(calls) == 3


def test_bad_input_is_refused_with_a_clear_error():
    with pytest.raises(ValueError, match="wait_s"):
        ExportRegistry(lambda _: None, wait_s=0)
    registry, _ = make_registry()
    with pytest.raises(ValueError, match="transfer_id"):
        registry.announce("", [])
