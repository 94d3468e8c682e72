"""The KV transfer over real sockets and threads: a producer's KVTransferServer serving its
ExportRegistry, a consumer's KVTransferClient pulling from it, and every way a pull ends."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from disagg_helpers import BLOCK_BYTES, HostStore, Received, block_hash, wait_until

from servelm.datatypes import KVExportEnd
from servelm.disagg.exports import ExportRegistry
from servelm.disagg.transport import KVTransferClient, KVTransferServer

WAIT_S = 0.5  # the producer's wait for an announce and the consumer's for a reply
LATE_S = 1.5  # a failure that should take ~WAIT_S takes less than this


class Producer:
    def __init__(self, tmp_path: Path | None = None, corrupt_every: int = 0) -> None:
        self.store = HostStore()
        self.registry = ExportRegistry(self.store.lookup, wait_s=WAIT_S)
        self.store.registry = self.registry
        ipc_path = None if tmp_path is None else str(tmp_path / "kv.ipc")
        self.server = KVTransferServer(self.registry, ipc_path=ipc_path, corrupt_every=corrupt_every)

    def announce(self, transfer_id: str, count: int) -> None:
        self.registry.announce(transfer_id, hashes(transfer_id, count))


def hashes(transfer_id: str, count: int) -> list[bytes]:
    return [block_hash(transfer_id, index) for index in range(count)]


@pytest.fixture
def producer():
    producer = Producer()
    yield producer
    producer.server.close()


@pytest.fixture
def received():
    return Received()


@pytest.fixture
def client(received):
    client = KVTransferClient(BLOCK_BYTES, WAIT_S, received.on_block, received.on_end)
    yield client
    client.close()


def pull(client, key, address, transfer_id, count, timeout_s=10.0):
    client.start(key, address, transfer_id, hashes(transfer_id, count), time.monotonic() + timeout_s)


def test_a_pull_streams_blocks_as_the_prefill_saves_them(producer, client, received):
    client.connect(producer.server.address)
    producer.announce("t", 4)
    producer.store.save("t", [0, 1])
    pull(client, "r", producer.server.address, "t", 4)
    assert received.wait_blocks("r", 2) == [0, 1]  # before the export is complete: overlap
    time.sleep(2 * WAIT_S)  # the prefill is slow: heartbeats keep the pull alive
    assert "r" not in received.ends
    producer.store.save("t", [2, 3])
    producer.registry.end("t", KVExportEnd.COMPLETE)
    assert received.wait_end("r") is None
    assert received.indices("r") == [0, 1, 2, 3]
    received.check_payloads("r", "t")
    assert producer.registry.take_served() == ["t"]
    assert wait_until(lambda: producer.server.num_active_pulls == 0)


def test_a_waiting_pull_does_not_hold_up_another(producer, client, received):
    producer.announce("slow", 2)
    producer.announce("fast", 3)
    producer.store.save("fast", range(3))
    producer.registry.end("fast", KVExportEnd.COMPLETE)
    pull(client, "a", producer.server.address, "slow", 2)
    pull(client, "b", producer.server.address, "fast", 3)
    assert received.wait_end("b") is None
    assert "a" not in received.ends and received.indices("a") == []
    producer.store.save("slow", [0])
    producer.registry.end("slow", KVExportEnd.ABORTED)  # the prefill failed after one block
    assert received.wait_end("a") == "missing"
    assert received.indices("a") == [0]
    received.check_payloads("a", "slow")
    received.check_payloads("b", "fast")


def test_a_transfer_announced_late_within_wait_s_is_served(producer, client, received):
    producer.store.save("t", [0, 1])
    pull(client, "r", producer.server.address, "t", 2)
    time.sleep(WAIT_S / 2)  # the prefill request is still on its way
    producer.announce("t", 2)
    assert received.wait_end("r") is None
    assert received.indices("r") == [0, 1]


def test_a_transfer_never_announced_fails_unknown_after_wait_s(producer, client, received):
    started = time.monotonic()
    pull(client, "r", producer.server.address, "t", 2)
    assert received.wait_end("r") == "unknown"
    assert WAIT_S <= time.monotonic() - started < LATE_S


def test_an_expired_transfer_fails_at_once(producer, client, received):
    producer.announce("t", 1)
    producer.store.save("t", [0])
    producer.registry.end("t", KVExportEnd.EXPIRED)
    started = time.monotonic()
    pull(client, "r", producer.server.address, "t", 1)
    assert received.wait_end("r") == "expired"
    assert time.monotonic() - started < WAIT_S
    assert received.indices("r") == []


def test_a_hole_after_complete_ends_the_pull_missing_after_the_blocks_before_it(producer, client, received):
    producer.announce("t", 4)
    producer.store.save("t", [0, 1, 3])
    producer.registry.end("t", KVExportEnd.COMPLETE)
    pull(client, "r", producer.server.address, "t", 4)
    assert received.wait_end("r") == "missing"
    assert received.indices("r") == [0, 1]
    received.check_payloads("r", "t")
    assert producer.registry.take_served() == []


def test_a_corrupt_block_is_not_delivered_and_ends_the_pull(client, received):
    producer = Producer(corrupt_every=2)
    try:
        producer.announce("t", 3)
        producer.store.save("t", range(3))
        pull(client, "r", producer.server.address, "t", 3)
        assert received.wait_end("r") == "corrupt"
        assert received.indices("r") == [0]  # block 1 was damaged on the way
        received.check_payloads("r", "t")
        assert wait_until(lambda: producer.server.num_active_pulls == 0)  # the consumer cancelled it
    finally:
        producer.server.close()


def test_a_peer_nobody_listens_on_fails_unreachable_within_wait_s(client, received):
    with socket.socket() as probe:  # a port that was free a moment ago: nothing listens there
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    started = time.monotonic()
    pull(client, "r", f"tcp://127.0.0.1:{port}", "t", 2)
    assert received.wait_end("r") == "unreachable"
    assert WAIT_S <= time.monotonic() - started < LATE_S


def test_an_address_zmq_refuses_fails_unreachable_and_the_client_keeps_working(producer, client, received):
    pull(client, "bad", "tcp://127.0.0.1", "t", 1)  # no port
    assert received.wait_end("bad") == "unreachable"
    producer.announce("t", 1)
    producer.store.save("t", [0])
    pull(client, "good", producer.server.address, "t", 1)
    assert received.wait_end("good") is None


def test_a_producer_killed_mid_pull_fails_peer_gone_within_wait_s(client, received):
    here = Path(__file__).parent
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here), *sys.path])}
    process = subprocess.Popen(
        [sys.executable, str(here / "producer_process.py"), "t", "4", "2"], stdout=subprocess.PIPE, env=environment
    )
    try:
        assert process.stdout is not None
        address = process.stdout.readline().decode().strip()
        pull(client, "r", address, "t", 4)
        assert received.wait_blocks("r", 2, timeout_s=10) == [0, 1]
        process.kill()
        killed = time.monotonic()
        assert received.wait_end("r") == "peer_gone"
        assert time.monotonic() - killed < LATE_S
        received.check_payloads("r", "t")
    finally:
        process.kill()
        process.wait()


def test_cancel_stops_the_callbacks_and_ends_the_pull_once(producer, client, received):
    producer.announce("t", 3)
    producer.store.save("t", [0])
    pull(client, "r", producer.server.address, "t", 3)
    received.wait_blocks("r", 1)
    client.cancel("r")
    assert received.ends["r"] == ["cancelled"]  # delivered before cancel returned
    producer.store.save("t", [1, 2])
    assert wait_until(lambda: producer.server.num_active_pulls == 0)
    client.cancel("r")  # safe twice
    assert received.indices("r") == [0] and received.ends["r"] == ["cancelled"]


def test_a_pull_past_its_deadline_fails_timeout(producer, client, received):
    producer.announce("t", 2)
    started = time.monotonic()
    pull(client, "r", producer.server.address, "t", 2, timeout_s=0.3)
    assert received.wait_end("r") == "timeout"
    assert 0.3 <= time.monotonic() - started < LATE_S


def test_ipc_addresses_serve_the_same_blocks(tmp_path, client, received):
    producer = Producer(tmp_path)
    try:
        assert producer.server.ipc_address == f"ipc://{tmp_path / 'kv.ipc'}"
        producer.announce("t", 3)
        producer.store.save("t", range(3))
        pull(client, "r", producer.server.ipc_address, "t", 3)
        assert received.wait_end("r") is None
        received.check_payloads("r", "t")
    finally:
        producer.server.close()


def test_close_cancels_running_pulls_and_is_safe_twice(producer, received):
    client = KVTransferClient(BLOCK_BYTES, WAIT_S, received.on_block, received.on_end)
    producer.announce("t", 1)
    pull(client, "r", producer.server.address, "t", 1)
    client.close()
    client.close()
    assert received.ends == {"r": ["cancelled"]}
    with pytest.raises(RuntimeError, match="closed"):
        pull(client, "s", producer.server.address, "t", 1)
    producer.server.close()
    producer.server.close()
    producer.store.save("t", [0])  # the closed server no longer listens to the registry


def test_bad_pulls_are_refused_with_a_clear_error(producer, client):
    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        pull(client, "r", "localhost:5555", "t", 1)
    with pytest.raises(ValueError, match="no block hashes"):
        pull(client, "r", producer.server.address, "t", 0)
    producer.announce("t", 1)
    pull(client, "r", producer.server.address, "t", 1)
    with pytest.raises(ValueError, match="already running"):
        pull(client, "r", producer.server.address, "t", 1)
    with pytest.raises(ValueError, match="block_bytes"):
        KVTransferClient(0, WAIT_S, lambda *_: None, lambda *_: None)
