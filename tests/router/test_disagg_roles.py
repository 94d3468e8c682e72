"""The router's side of a split request without an engine: replica roles (parsing, the role
query on entering rotation), the two bodies it sends, and which requests may be split."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import httpx
import pytest

from servelm.router.health import check_replica
from servelm.router.prefill_calls import decode_body, prefill_body
from servelm.router.replicas import ReplicaSpec
from servelm.router.request_view import is_single_generation
from servelm.router.roles import ReplicaRole
from servelm.router.state import Router, RouterOptions


def test_replica_spec_parses_a_stated_role() -> None:
    spec = ReplicaSpec.parse("http://h:1/,kv=tcp://h:2,role=prefill")
    assert (spec.url, spec.kv_events, spec.role) == ("http://h:1", "tcp://h:2", "prefill")
    assert ReplicaSpec.parse("http://h:1,role=decode").kv_events is None
    with pytest.raises(ValueError, match="replica role must be one of prefill, decode, both, got 'decoder'"):
        ReplicaSpec.parse("http://h:1,role=decoder")
    with pytest.raises(ValueError, match="expected kv=tcp://HOST:PORT or role=ROLE"):
        ReplicaSpec.parse("http://h:1,rol=decode")


@pytest.mark.parametrize(
    "body, message",
    [
        ([], "expected a JSON object"),
        ({"kv_role": "mixed"}, "kv_role must be one of"),
        ({"kv_role": "prefill", "address": None}, "a prefill replica must report its transfer address"),
        ({"kv_role": "decode", "address": "http://x"}, "address must be tcp://HOST:PORT or null"),
        ({"kv_role": "decode", "block_size": 0}, "block_size must be a positive integer"),
    ],
)
def test_role_answers_that_make_no_sense_are_refused(body: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ReplicaRole.from_json(body)


def test_the_two_bodies_of_a_split_request() -> None:
    client = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 50, "stream": True,
              "stream_options": {"include_usage": True}, "min_tokens": 5, "temperature": 0}  # fmt: skip
    prefill = prefill_body(client, "T1")
    assert prefill == {"messages": client["messages"], "max_completion_tokens": 1, "max_tokens": 1, "stream": False,
                       "temperature": 0, "kv_transfer_params": {"do_remote_decode": True, "transfer_id": "T1"}}  # fmt: skip
    decode = decode_body(client, "T1", "tcp://p:9300")
    assert decode == {**client, "kv_transfer_params": {"do_remote_prefill": True, "transfer_id": "T1",
                                                       "remote_address": "tcp://p:9300"}}  # fmt: skip
    assert "kv_transfer_params" not in client and client["max_completion_tokens"] == 50  # the client's body untouched
    assert "max_completion_tokens" not in prefill_body({"prompt": "x", "max_tokens": 9}, "T2")


@pytest.mark.parametrize(
    "body, single",
    [
        ({"prompt": "x"}, True),
        ({"prompt": ["x"]}, True),
        ({"prompt": [[1, 2, 3]]}, True),
        ({"prompt": [1, 2, 3]}, True),
        ({"prompt": ["x", "y"]}, False),
        ({"prompt": "x", "n": 2}, False),
        ({"prompt": "x", "echo": True}, True),
        ({"prompt": "x", "echo": True, "logprobs": 1}, False),
        ({"prompt": "x", "echo": True, "max_tokens": 0}, False),
    ],
)
def test_which_requests_one_split_can_carry(body: dict, single: bool) -> None:
    assert is_single_generation(body) is single


class _Replica(BaseHTTPRequestHandler):
    """A replica's HTTP surface for the role query: /health and /ready, and /v1/kv_transfer as set on the server."""

    def do_GET(self) -> None:
        probe = self.path in ("/health", "/ready")
        status, body = (200, b"") if probe else self.server.kv_transfer  # type: ignore[attr-defined]
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_role_is_learned_when_a_replica_enters_rotation(caplog: pytest.LogCaptureFixture) -> None:
    server = HTTPServer(("127.0.0.1", 0), _Replica)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    answer = {"kv_role": "prefill", "address": "tcp://127.0.0.1:9300", "block_size": 16}

    async def scenario() -> None:
        router = Router(RouterOptions(policy="round_robin"))
        replica = router.add_replica(ReplicaSpec(url, role="decode"))
        async with httpx.AsyncClient() as client:
            server.kv_transfer = (500, b"")  # type: ignore[attr-defined]
            await check_replica(client, router, replica, timeout_s=2)
            assert not replica.healthy and "role query failed" in replica.last_error
            server.kv_transfer = (200, json.dumps(answer).encode())  # type: ignore[attr-defined]
            with caplog.at_level(logging.WARNING, logger="servelm.router.roles"):
                await check_replica(client, router, replica, timeout_s=2)
            assert replica.healthy and (replica.kv_role, replica.transfer_address) == (
                "prefill",
                "tcp://127.0.0.1:9300",
            )
            assert "configured as decode but reports prefill" in caplog.text  # the replica's answer wins
            assert not replica.serves_aggregated and replica.is_producer
            # Asked again only on the way back into rotation: a restart may change the role.
            await router.mark_down(replica, "gone")
            server.kv_transfer = (404, b"")  # type: ignore[attr-defined]
            await check_replica(client, router, replica, timeout_s=2)
            assert replica.healthy and replica.kv_role is None and replica.transfer_address is None
            # A replica keyed differently from the router keeps serving, as a plain one.
            replica.kv_role = "decode"
            await router.mark_down(replica, "gone")
            server.kv_transfer = (401, b"")  # type: ignore[attr-defined]
            await check_replica(client, router, replica, timeout_s=2)
            assert replica.healthy and replica.kv_role is None
        await router.close()

    try:
        asyncio.run(scenario())
    finally:
        server.shutdown()
        server.server_close()
