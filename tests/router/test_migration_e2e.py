"""Streams that outlive their replica: `servelm router` over 3 real replicas of a tiny model, each
behind a TCP proxy the test can cut, refuse or freeze (servelm.testing.cut_proxy). A long greedy stream loses
its replica mid-stream (its connection reset, its bytes frozen past the stall timeout, its engine
core or its process killed with SIGKILL) and the client's stream must still be the undisturbed
run's: the same token ids, text, logprobs, usage and finish; a stream whose every replica fails
ends with an error event. The two kills run last, each leaving one replica fewer in rotation."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from servelm.server.launcher import ServerProcess
from servelm.testing.cut_proxy import CutProxy
from servelm.testing.process_tree import descendants
from servelm.testing.proxied_fleet import ProxiedFleet, start_proxied_fleet
from servelm.testing.tiny_model import write_tiny_checkpoint

NUM_REPLICAS = 3  # the kills take two out for good: the last stream still has one to move to
REPLICA_ARGS = ["--num-blocks", "1024", "--num-threads", "1", "--max-num-seqs", "16"]
STALL_TIMEOUT_S = 2.0
NUM_TOKENS = 200
PROMPT = "The lighthouse keeper wrote in his log every night, and tonight he wrote"
MESSAGES = [{"role": "user", "content": "Tell me about the lighthouse keeper and his log."}]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxiedFleet]:
    model = write_tiny_checkpoint(tmp_path_factory.mktemp("migration") / "model", seed=0)
    router_args = ["--policy", "least_load", "--health-interval", "0.5",
                   "--upstream-stall-timeout", str(STALL_TIMEOUT_S)]  # fmt: skip
    fleet = start_proxied_fleet(model, NUM_REPLICAS, REPLICA_ARGS, router_args)
    yield fleet
    fleet.close()


@dataclass
class Streamed:
    replica: str  # the x-servelm-replica header: the first leg's
    chunks: list[dict[str, Any]]  # every event's JSON but [DONE]
    done: bool  # ended with [DONE]

    @property
    def choices(self) -> list[dict[str, Any]]:
        return [c["choices"][0] for c in self.chunks if c.get("choices")]

    def text(self) -> str:
        return "".join(c["delta"].get("content", "") if "delta" in c else c["text"] for c in self.choices)

    @property
    def usage(self) -> dict[str, Any]:
        return self.chunks[-1]["usage"]


def stream(fleet: ProxiedFleet, path: str, body: dict[str, Any], fault_after: int | None = None, fault=None) -> Streamed:
    """POST a stream through the router; after `fault_after` events call `fault(replica_url)`."""
    chunks, done = [], False
    with httpx.stream("POST", fleet.router + path, json=body, timeout=httpx.Timeout(60, read=30)) as response:
        assert response.status_code == 200, response.read()
        replica = response.headers["x-servelm-replica"]
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            chunks.append(json.loads(line[6:]))
            if fault is not None and len(chunks) == fault_after:
                fault(replica)
    return Streamed(replica, chunks, done)


def completion_body(**extra: Any) -> dict[str, Any]:
    return {"prompt": PROMPT, "max_tokens": NUM_TOKENS, "ignore_eos": True, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **extra}  # fmt: skip


def chat_body(**extra: Any) -> dict[str, Any]:
    return {"messages": MESSAGES, "max_completion_tokens": NUM_TOKENS, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, **extra}  # fmt: skip


def assert_same_stream(got: Streamed, want: Streamed) -> None:
    assert got.done and want.done
    assert got.text() == want.text()
    assert got.usage == {**want.usage, "prompt_tokens_details": got.usage["prompt_tokens_details"]}
    assert [c["finish_reason"] for c in got.choices if c["finish_reason"]] == ["length"]
    assert {c["id"] for c in got.chunks} == {got.chunks[0]["id"]}  # one stream, one id, whatever served it
    assert {c["object"] for c in got.chunks} == {want.chunks[0]["object"]}


def test_a_reset_connection_mid_chat_stream_continues_elsewhere(fleet: ProxiedFleet) -> None:
    body = chat_body(logprobs=True, top_logprobs=2)
    want = stream(fleet, "/v1/chat/completions", body)
    assert want.usage["completion_tokens"] == NUM_TOKENS
    assert all("token_ids" not in c for c in want.choices) and all("prompt_token_ids" not in c for c in want.chunks)
    before = fleet.metric("servelm:router_migrations_total", 'cause="connection"')
    got = stream(fleet, "/v1/chat/completions", body, fault_after=40, fault=lambda url: fleet.proxies[fleet.index_of(url)].cut())
    assert fleet.metric("servelm:router_migrations_total", 'cause="connection"') == before + 1
    assert_same_stream(got, want)
    got_lp = [t for c in got.choices if c["logprobs"] for t in c["logprobs"]["content"]]
    want_lp = [t for c in want.choices if c["logprobs"] for t in c["logprobs"]["content"]]
    assert [(t["token"], [a["token"] for a in t["top_logprobs"]]) for t in got_lp] == \
        [(t["token"], [a["token"] for a in t["top_logprobs"]]) for t in want_lp]  # fmt: skip
    assert [t["logprob"] for t in got_lp] == pytest.approx([t["logprob"] for t in want_lp], abs=1e-3)
    assert got.chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert sum("role" in c["delta"] for c in got.choices) == 1
    fleet.wait_healthy()


def test_a_constrained_chat_stream_keeps_its_schema_across_the_move(fleet: ProxiedFleet) -> None:
    """The continuation resumes the grammar after the tokens already sent: restarted, it would have
    to open a new object mid-array (and the tiny model's text would differ from the undisturbed run)."""
    schema = {"type": "object", "properties": {"items": {"type": "array", "items": {"enum": ["alpha", "beta", "gamma"]},
                                                         "minItems": 30, "maxItems": 30}},
              "required": ["items"], "additionalProperties": False}  # fmt: skip
    body = chat_body(response_format={"type": "json_schema", "json_schema": {"name": "list", "schema": schema}})
    want = stream(fleet, "/v1/chat/completions", body)
    before = fleet.metric("servelm:router_migrations_total", 'cause="connection"')
    got = stream(fleet, "/v1/chat/completions", body, fault_after=25, fault=lambda url: fleet.proxies[fleet.index_of(url)].cut())
    assert fleet.metric("servelm:router_migrations_total", 'cause="connection"') == before + 1
    assert got.done and want.done
    assert [c["finish_reason"] for c in got.choices if c["finish_reason"]] == ["stop"]  # the grammar ended it
    assert got.text() == want.text() and len(json.loads(got.text())["items"]) == 30
    assert got.usage == {**want.usage, "prompt_tokens_details": got.usage["prompt_tokens_details"]}
    fleet.wait_healthy()


def test_a_stalled_stream_moves_after_the_stall_timeout(fleet: ProxiedFleet) -> None:
    body = completion_body(logprobs=1)
    want = stream(fleet, "/v1/completions", body)
    frozen: list[CutProxy] = []

    def freeze(url: str) -> None:
        frozen.append(fleet.proxies[fleet.index_of(url)])
        frozen[0].freeze(True)  # the replica is alive and its socket open: only the bytes stop

    before = fleet.metric("servelm:router_migrations_total", 'cause="stalled"')
    started = time.monotonic()
    try:
        got = stream(fleet, "/v1/completions", body, fault_after=30, fault=freeze)
    finally:
        frozen[0].freeze(False)
    assert time.monotonic() - started >= STALL_TIMEOUT_S
    assert fleet.metric("servelm:router_migrations_total", 'cause="stalled"') == before + 1
    assert_same_stream(got, want)
    # text_offset runs on across the boundary as in one replica's stream.
    offsets = [o for c in got.choices if c["logprobs"] for o in c["logprobs"]["text_offset"]]
    assert offsets == [o for c in want.choices if c["logprobs"] for o in c["logprobs"]["text_offset"]]
    fleet.wait_healthy()


def test_a_stream_whose_every_replica_fails_ends_with_an_error_event(fleet: ProxiedFleet) -> None:
    def refuse_all(_: str) -> None:
        for proxy in fleet.proxies:
            proxy.refuse(True)

    before = fleet.metric("servelm:router_migration_failures_total", 'reason="no_replica"')
    started = time.monotonic()
    try:
        got = stream(fleet, "/v1/completions", completion_body(), fault_after=20, fault=refuse_all)
    finally:
        for proxy in fleet.proxies:
            proxy.refuse(False)
    assert time.monotonic() - started < 20  # an answer, not a hang
    assert got.done  # [DONE] after the error: the stream ends cleanly
    error = got.chunks[-1]["error"]
    assert error["type"] == "server_error" and error["code"] == "replica_lost" and "no_replica" in error["message"]
    assert len(got.choices) >= 19 and all(c["finish_reason"] is None for c in got.choices)
    assert fleet.metric("servelm:router_migration_failures_total", 'reason="no_replica"') == before + 1
    fleet.wait_healthy()


def test_a_stream_that_cannot_move_ends_with_an_error_event_when_its_replica_is_lost(fleet: ProxiedFleet) -> None:
    """Streams of several choices are passed through, not relayed: one whose replica's connection
    resets mid-stream ends with an error event and [DONE] (before: a broken chunked body, which the
    openai client reports as a network fault, and a traceback in the router's log)."""
    got = stream(fleet, "/v1/completions", completion_body(n=2), fault_after=20,
                 fault=lambda url: fleet.proxies[fleet.index_of(url)].cut())  # fmt: skip
    assert got.done
    error = got.chunks[-1]["error"]
    assert error["type"] == "server_error" and error["code"] == "replica_lost"
    assert len(got.choices) >= 19 and all(c["finish_reason"] is None for c in got.choices)
    fleet.wait_healthy()


def _signal_replica(fleet: ProxiedFleet, index: int, signum: int) -> None:
    """`signum` to a replica's API process and everything under it (its engine core)."""
    pid = fleet.replicas[index].process.pid
    for target in [pid, *descendants(pid)]:
        os.kill(target, signum)


def test_requests_waiting_on_a_frozen_replica_are_retried_once_it_leaves_rotation(fleet: ProxiedFleet) -> None:
    """Two replicas' processes stop (SIGSTOP: a deadlock, a long pause) while requests wait there
    for their answers: once the health checker takes them out of rotation, those requests are
    retried on the third (before: they waited until the processes resumed)."""
    body = {"prompt": PROMPT, "max_tokens": 40, "ignore_eos": True, "temperature": 0}
    want = httpx.post(fleet.router + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    before = fleet.metric("servelm:router_retries_total")
    for index in (0, 1):
        _signal_replica(fleet, index, signal.SIGSTOP)
    started = time.monotonic()
    try:
        with ThreadPoolExecutor(3) as pool:  # least load: one each, two on stopped replicas
            answers = list(pool.map(lambda _: httpx.post(fleet.router + "/v1/completions", json=body, timeout=40),
                                    range(3)))  # fmt: skip
        elapsed = time.monotonic() - started
    finally:
        for index in (0, 1):
            _signal_replica(fleet, index, signal.SIGCONT)
    assert [a.status_code for a in answers] == [200] * 3, [a.text for a in answers]
    assert [a.json()["choices"][0]["text"] for a in answers] == [want] * 3
    assert elapsed < 20  # a health timeout (2 s) and a retry, not the client's timeout
    assert fleet.metric("servelm:router_retries_total") >= before + 2
    fleet.wait_healthy()


def test_an_engine_core_killed_mid_stream_ends_its_replicas_stream_and_it_moves(fleet: ProxiedFleet) -> None:
    """SIGKILL of the serving replica's engine core: its API process ends the stream with an error
    event (the replica stays out of rotation while it has no engine)."""
    body = chat_body(max_completion_tokens=120)
    want = stream(fleet, "/v1/chat/completions", body)

    def kill_core(url: str) -> None:
        fleet.kill_engine_core(fleet.index_of(url))

    before = fleet.metric("servelm:router_migrations_total", 'cause="replica_error"')
    got = stream(fleet, "/v1/chat/completions", body, fault_after=30, fault=kill_core)
    assert fleet.metric("servelm:router_migrations_total", 'cause="replica_error"') == before + 1
    assert_same_stream(got, want)


def test_killing_the_replica_mid_stream_loses_no_token(fleet: ProxiedFleet) -> None:
    """Last: SIGKILL of the replica process serving the stream."""
    body = completion_body(return_token_ids=True)
    want = stream(fleet, "/v1/completions", body)
    prompt_ids = want.choices[0]["prompt_token_ids"]
    want_ids = [t for c in want.choices for t in c["token_ids"]]
    assert len(want_ids) == NUM_TOKENS
    killed: list[ServerProcess] = []

    def kill(url: str) -> None:
        killed.append(fleet.replicas[fleet.index_of(url)])
        killed[0].process.kill()

    before = fleet.metric("servelm:router_migrations_total")
    got = stream(fleet, "/v1/completions", body, fault_after=40, fault=kill)
    assert killed[0].process.wait(timeout=10) == -9
    assert fleet.metric("servelm:router_migrations_total") == before + 1
    assert_same_stream(got, want)
    assert [t for c in got.choices for t in c["token_ids"]] == want_ids  # none missing, none twice
    assert [c["prompt_token_ids"] for c in got.choices if "prompt_token_ids" in c] == [prompt_ids]
