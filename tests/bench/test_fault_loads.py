"""The loads that the "TTFT tripled" scenarios inject: long chat histories resent as messages,
long documents, and clients that read their streams slowly (against a live server: the
server's output backlog must grow for them, and only for them)."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from servelm.bench.cli import bench_config
from servelm.bench.client import ClientConfig, request_body
from servelm.bench.profiles import TEMPLATE_TOKENS_PER_MESSAGE, build_workload
from servelm.bench.runner import RunLimits, run_workload
from servelm.bench.slow_reader import SlowReading, mark_slow_readers
from servelm.bench.tokens import TokenSource
from servelm.bench.workload import LengthLimits, WorkloadRequest
from servelm.cli import build_parser, main

LIMITS = LengthLimits(max_context=8192)


def test_longchat_turns_resend_a_growing_history_as_messages(tokens: TokenSource):
    requests = build_workload("longchat", 160, tokens, LIMITS, seed=0)
    by_index = {r.index: r for r in requests}
    longest = 0
    for request in requests:
        messages = request.messages
        assert messages is not None and messages[-1]["role"] == "user"
        assert [m["role"] for m in messages] == ["user", "assistant"] * (len(messages) // 2) + ["user"]
        assert "".join(m["content"] for m in messages) == request.prompt_text
        assert len(request.prompt_ids) + TEMPLATE_TOKENS_PER_MESSAGE * len(messages) + request.max_tokens <= 8192
        if request.after is not None:  # the previous turn of the session, resent whole, plus its reply
            previous = by_index[request.after]
            assert previous.session_id == request.session_id
            assert messages[: len(previous.messages)] == previous.messages
            assert len(messages) == len(previous.messages) + 2
            assert request.shared_prefix_tokens > len(previous.prompt_ids)
        longest = max(longest, len(messages))
        body = request_body(ClientConfig(base_url="http://x", endpoint="completions"), request)
        assert body["messages"] == messages and "prompt" not in body  # messages go to chat whatever the endpoint
    assert longest >= 21, "tens of turns"
    assert max(r.num_prompt_tokens for r in requests) >= 4000, "histories of several thousand tokens"


def open_sessions_at_most(requests: list[WorkloadRequest]) -> int:
    """The most conversations open at once: from a session's first request to its last."""
    last = {r.session_id: r.index for r in requests}
    first = {r.session_id: r.index for r in reversed(requests)}
    return max(sum(1 for s in first if first[s] <= r.index <= last[s]) for r in requests)


@pytest.mark.parametrize("profile", ["longchat", "voice"])
def test_sessions_sets_how_many_conversations_are_open_at_once(tokens: TokenSource, profile: str):
    few = build_workload(profile, 320, tokens, LIMITS, seed=0)
    many = build_workload(profile, 320, tokens, LIMITS, seed=0, sessions=32)
    assert open_sessions_at_most(few) <= 4 < open_sessions_at_most(many) <= 32
    if profile == "longchat":  # tens of turns each: more conversations make each shorter in the same run
        assert open_sessions_at_most(many) >= 24
        assert max(len(r.prompt_ids) for r in many) < max(len(r.prompt_ids) for r in few)
    with pytest.raises(ValueError, match="sessions"):
        build_workload(profile, 4, tokens, LIMITS, seed=0, sessions=0)


def test_long_documents_override_the_analytics_lengths(tokens: TokenSource):
    normal = build_workload("analytics", 20, tokens, LIMITS, seed=0)
    long = build_workload("analytics", 20, tokens, LIMITS, seed=0, document_tokens=(3000, 7000))
    assert all(500 <= r.num_prompt_tokens <= 2001 for r in normal)
    assert all(3000 <= r.num_prompt_tokens <= 7001 for r in long)
    assert long[0].prompt_ids[:64] == normal[0].prompt_ids[:64]  # the same tenant: one shared instruction


def test_slow_readers_are_a_seeded_fraction(tokens: TokenSource):
    requests = build_workload("chat", 400, tokens, LIMITS, seed=0)
    marked = [r.index for r in mark_slow_readers(requests, 0.25, seed=0) if r.slow_reader]
    assert 70 <= len(marked) <= 130
    again = [r.index for r in mark_slow_readers(requests, 0.25, seed=0) if r.slow_reader]
    assert marked == again


def _peak_backlog(base_url: str, reading: SlowReading, duration_s: float) -> tuple[float, list]:
    """Run 3 slow-reader streams (logprobs: ~0.9 kB per token, 540 kB each: more than the ~220 kB of socket buffers between client and server) while polling the server's backlog gauge."""
    requests = [WorkloadRequest(index=i, traffic_class="chat", prompt_ids=[], num_prompt_tokens=3, max_tokens=600,
                                prompt_text=" hello world", arrival_s=0.1 * i, slow_reader=True) for i in range(3)]  # fmt: skip
    client = ClientConfig(base_url=base_url, slow_reading=reading, slow_reader_logprobs=20)
    peak, stop = [0.0], threading.Event()

    def poll() -> None:
        while not stop.is_set():
            for line in httpx.get(f"{base_url}/metrics", timeout=10).text.splitlines():
                if line.split("{", 1)[0].split(" ", 1)[0] == "servelm:num_outputs_queued_in_api":
                    peak[0] = max(peak[0], float(line.rsplit(" ", 1)[1]))
            time.sleep(0.1)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        result = asyncio.run(run_workload(requests, client, RunLimits(duration_s=duration_s, progress=False)))
    finally:
        stop.set()
        poller.join()
    return peak[0], result.records


def test_slow_readers_back_up_the_servers_output_path(bench_server):
    # Clients that read at once end when their 600 tokens do (~6 s here; the cap only guards a hang).
    fast_peak, fast = _peak_backlog(bench_server.base_url, SlowReading(read_delay_s=0.0), duration_s=60)
    assert all(r.ok and r.slow_reader and r.num_output_tokens == 600 for r in fast)
    # Slow readers would read for minutes: 8 s of them is the backlog's build-up.
    slow_peak, slow = _peak_backlog(bench_server.base_url, SlowReading(read_delay_s=0.2, read_bytes=1024), duration_s=8)
    assert slow_peak >= 100, f"slow readers left only {slow_peak:.0f} outputs queued in the API"
    # Relative, not a count: on a busy host even a prompt reader leaves a few outputs queued (9 seen).
    assert fast_peak <= 0.1 * slow_peak, f"clients that read at once left {fast_peak:.0f} outputs queued ({slow_peak:.0f} slow)"
    assert all(r.slow_reader and r.first_token_s is not None for r in slow)


def test_long_voice_answers_override_the_voice_output_lengths(tokens: TokenSource):
    mix = {"voice": 0.7, "analytics": 0.3}
    normal = build_workload("mixed", 40, tokens, LIMITS, seed=0, weights=mix)
    long = build_workload("mixed", 40, tokens, LIMITS, seed=0, weights=mix, voice_output_tokens=(200, 300))
    assert [r.traffic_class for r in long] == [r.traffic_class for r in normal]  # the same interleaving
    assert all(20 <= r.max_tokens <= 80 for r in normal if r.traffic_class == "voice")
    assert all(200 <= r.max_tokens <= 300 for r in long if r.traffic_class == "voice")
    # Analytics keeps its own outputs; a voice turn's history grows by the longer replies.
    assert [r.max_tokens for r in long if r.traffic_class == "analytics"] == [
        r.max_tokens for r in normal if r.traffic_class == "analytics"
    ]
    later = [r for r in long if r.traffic_class == "voice" and r.after is not None]
    assert later and all(r.shared_prefix_tokens >= 200 for r in later)
    with pytest.raises(ValueError, match="voice_output_tokens"):
        build_workload("voice", 4, tokens, LIMITS, voice_output_tokens=(300, 200))


def test_voice_output_tokens_is_a_bench_flag(capsys):
    args = build_parser().parse_args(["bench", "run", "--voice-output-tokens", "200-300"])
    assert bench_config(args).voice_output_tokens == (200, 300)
    assert bench_config(build_parser().parse_args(["bench", "run"])).voice_output_tokens is None
    # A bad range is one line naming the flag, before any server is asked.
    assert main(["bench", "run", "--voice-output-tokens", "300-200", "--base-url", "http://127.0.0.1:9"]) == 2
    assert "--voice-output-tokens wants 1 <= LOW <= HIGH, got 300-200" in capsys.readouterr().err


def _turns_as_the_server_saw_them(requests: list[WorkloadRequest], records: dict) -> dict[int, list[dict[str, str]]]:
    """Each longchat turn's messages rebuilt from the replies the run really got (the plan's for the first turn)."""
    sent: dict[int, list[dict[str, str]]] = {}
    for request in requests:
        assert request.messages is not None
        if request.turn is None:
            sent[request.index] = request.messages
            continue
        assert request.after is not None
        reply = records[request.after].output_text
        assert reply, "every turn got text: a resent reply is the real one"
        sent[request.index] = [*sent[request.after], {"role": "assistant", "content": reply},
                               {"role": "user", "content": request.turn.text}]  # fmt: skip
    return sent


def _run_sessions(bench_server, requests: list[WorkloadRequest], tokens: TokenSource) -> dict:
    for i, request in enumerate(requests):
        request.arrival_s = 0.05 * i
    client = ClientConfig(base_url=bench_server.base_url, endpoint="completions", keep_output_text=True)
    result = asyncio.run(run_workload(requests, client, RunLimits(duration_s=120, progress=False), tokens))
    records = {r.index: r for r in result.records}
    assert len(records) == len(requests) and all(r.ok for r in records.values())
    return records


def test_a_session_turn_resends_the_reply_the_server_gave(bench_server, tokens: TokenSource):
    """A chat client resends what the model said: the next turn's history holds the real reply (so the
    server's prefix cache covers it), not the profile's planned stand-in."""
    limits = LengthLimits(max_context=1024, max_output_tokens=24)
    requests = build_workload("longchat", 10, tokens, limits, seed=3, sessions=2)
    continued = [r for r in requests if r.turn is not None]
    assert len(continued) >= 6
    records = _run_sessions(bench_server, requests, tokens)
    sent = _turns_as_the_server_saw_them(requests, records)
    for request in continued:
        assert sent[request.index] != request.messages  # the replies are the model's, not the plan's
        rendered = httpx.post(f"{bench_server.base_url}/tokenize", json={"messages": sent[request.index]},
                              timeout=30).json()["count"]  # fmt: skip
        assert records[request.index].num_prompt_tokens == rendered
    # The history up to the reply was cached; the reply too, wherever its text re-tokenizes into the
    # generated tokens (a random model's need not): with a planned stand-in no reply token ever hits.
    cached_beyond_previous_prompt = 0
    for request in continued:
        previous, record = records[request.after], records[request.index]
        assert record.num_cached_tokens >= previous.num_prompt_tokens // 16 * 16
        cached_beyond_previous_prompt += record.num_cached_tokens - previous.num_prompt_tokens
    assert cached_beyond_previous_prompt > 0


def test_a_completions_turn_resends_the_reply_and_counts_it_exactly(bench_server, tokens: TokenSource):
    limits = LengthLimits(max_context=1024, prompt_scale=0.5, max_output_tokens=24)
    requests = build_workload("voice", 10, tokens, limits, seed=3, sessions=2)
    planned = {r.index: r.num_prompt_tokens for r in requests}
    records = _run_sessions(bench_server, requests, tokens)
    # The runner counted each prompt with the real reply in it, exactly as the server did.
    assert all(r.num_prompt_tokens == r.expected_prompt_tokens for r in records.values())
    resent = [records[r.index] for r in requests if r.turn is not None]
    assert len(resent) >= 5 and any(r.expected_prompt_tokens != planned[r.index] for r in resent)
    for request in requests:
        if request.turn is not None:
            previous, record = records[request.after], records[request.index]
            assert record.shared_prefix_tokens >= previous.num_prompt_tokens - tokens.num_special_tokens
            assert record.num_cached_tokens >= previous.num_prompt_tokens // 16 * 16
