"""The client side of a migrating stream without processes: the relay (router/relay.py) fed the
events a servelm replica writes, with the default model's real byte-level BPE tokenizer and the
engine's own incremental detokenizer playing the replicas. A stream cut at any token and continued
from a fresh detokenizer (as a continuation replica decodes) must read exactly like the stream
one replica would have written: text, stop strings across the boundary, finish, ids, usage."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from servelm.engine.detokenizer import IncrementalDetokenizer
from servelm.router.continuation import continuation_body, migratable, remaining_tokens
from servelm.router.relay import StreamRelay
from servelm.router.splice import Splice, boundary_stop, splice, stop_settled
from servelm.router.sse import DONE_DATA, EventSplitter, frame
from servelm.tokenization.loading import load_tokenizer
from servelm.tokenization.prompt_tokenizer import FastDecoder

HEADER = {"id": "cmpl-1", "object": "text_completion", "created": 7, "model": "m"}
CHAT_HEADER = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "m"}
PROMPT_IDS = [1, 2, 3]


@pytest.fixture(scope="module")
def decoder() -> FastDecoder:
    return FastDecoder(load_tokenizer(None))


def replica_events(decoder: FastDecoder, ids: list[int], stops: list[str], include_stop: bool = False,
                   chat: bool = False, prompt_ids: list[int] | None = None, header: dict | None = None) -> list[bytes]:  # fmt: skip
    """What a servelm replica streams with return_token_ids for a request that generates `ids` one
    per step, up to a stop string (finish "stop") or the last id ("length"); [DONE] last."""
    detok = IncrementalDetokenizer(tokenizer=decoder, stop=stops, include_stop_str_in_output=include_stop)
    events = []
    header = header or (CHAT_HEADER if chat else HEADER)
    for position, token in enumerate(ids):
        last = position == len(ids) - 1
        update = detok.add_tokens([token], finished=last)
        finish = "stop" if update.stop_string else ("length" if last else None)
        entry: dict[str, Any]
        if chat:
            delta = {"role": "assistant", "content": update.new_text} if position == 0 else (
                {"content": update.new_text} if update.new_text else {})  # fmt: skip
            entry = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish,
                     "stop_reason": update.stop_string, "token_ids": [token]}  # fmt: skip
        else:
            entry = {"index": 0, "text": update.new_text, "logprobs": None, "finish_reason": finish,
                     "stop_reason": update.stop_string}  # fmt: skip
            if position == 0 and prompt_ids is not None:
                entry["prompt_token_ids"] = prompt_ids
            entry["token_ids"] = [token]
        chunk = {**header, "choices": [entry]}
        if chat and position == 0 and prompt_ids is not None:
            chunk["prompt_token_ids"] = prompt_ids
        events.append(msgspec.json.encode(chunk))
        if finish:
            break
    return [*events, DONE_DATA]


def client_view(events: list[bytes], chat: bool) -> tuple[str, list[int], str | None, Any]:
    """(text, token ids, finish_reason, stop_reason) of a client's events."""
    text, ids, finish, stop = "", [], None, None
    for event in events:
        for data in EventSplitter().feed(event):
            if data == DONE_DATA:
                continue
            for choice in json.loads(data).get("choices", []):
                text += (choice["delta"].get("content", "") if chat else choice["text"])
                ids += choice.get("token_ids", [])
                finish, stop = choice["finish_reason"] or finish, choice["stop_reason"] or stop
    return text, ids, finish, stop


def run_migrated(decoder: FastDecoder, ids: list[int], cut: int, stops: list[str], include_stop: bool,
                 chat: bool) -> list[bytes]:  # fmt: skip
    """The client's events when the first replica is lost after `cut` events and a fresh one
    continues (it decodes its ids alone, from nothing)."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    relay = StreamRelay(path, {"stream": True, "stop": stops, "include_stop_str_in_output": include_stop,
                               "return_token_ids": True})  # fmt: skip
    out: list[bytes] = []
    for data in replica_events(decoder, ids, stops, include_stop, chat, PROMPT_IDS)[:cut]:
        result = relay.handle(data)
        assert result.failure is None and not result.done
        out += result.events
    relay.begin_continuation()
    rest = ids[len(relay.sent_ids):]
    for data in replica_events(decoder, rest, stops, include_stop, prompt_ids=PROMPT_IDS + relay.sent_ids,
                               header={**HEADER, "id": "cmpl-2", "created": 9}):  # fmt: skip
        result = relay.handle(data)
        out += result.events
        if (to_decode := relay.splice_ids()) is not None:
            skip = relay.skip_special_tokens  # as the replica's /detokenize decodes them for the router
            result = relay.apply_splice([decoder.decode(token_ids, skip) for token_ids in to_decode])
            out += result.events
        if result.done:
            break
    assert relay.done
    return out


WORDS = ["the", " café", " 東京", "🚀", " naïve", " STOP", "ST", "OP", " ñ", "\n", " x", "é", "  ", "日本語", "—",
         "<|im_end|>", "\t", "!!"]


@settings(max_examples=150, deadline=None)
@given(words=st.lists(st.sampled_from(WORDS), min_size=3, max_size=14), cut=st.integers(1, 40),
       stops=st.sampled_from([[], ["STOP"], ["é 東", "x"], ["OP 🚀"], ["\n the"], ["本語—", "🚀🚀"]]),
       include_stop=st.booleans(), chat=st.booleans())  # fmt: skip
def test_a_stream_continued_at_any_token_reads_as_one_replicas(decoder, words, cut, stops, include_stop, chat):
    ids = decoder.tokenizer.encode("".join(words), add_special_tokens=False)
    want = client_view([frame(e) for e in replica_events(decoder, ids, stops, include_stop, chat)], chat)
    num_events = len(want[1])
    assume(cut < num_events)  # the first replica is lost before the stream's finish
    got = client_view(run_migrated(decoder, ids, cut, stops, include_stop, chat), chat)
    assert got == want


def test_a_stop_string_across_the_boundary_ends_the_stream_there(decoder):
    ids = decoder.tokenizer.encode("one two STOP three four five", add_special_tokens=False)
    stop_at = next(i for i in range(len(ids)) if "ST" in decoder.decode(ids[: i + 1]))  # the event "ST" begins
    events = run_migrated(decoder, ids, stop_at + 1, ["STOP"], False, chat=False)
    text, got_ids, finish, stop = client_view(events, chat=False)
    assert (text, finish, stop) == ("one two ", "stop", "STOP")
    assert decoder.decode(got_ids).startswith("one two STOP") and "three" not in decoder.decode(got_ids)


def test_a_character_split_by_the_boundary_is_repaired(decoder):
    ids = decoder.tokenizer.encode("a 🚀 b", add_special_tokens=False)
    # The emoji's bytes span several tokens: cut right after its first one.
    first = next(i for i in range(len(ids)) if decoder.decode(ids[: i + 1]).endswith("\ufffd"))
    text, got_ids, _, _ = client_view(run_migrated(decoder, ids, first + 1, [], False, chat=True), chat=True)
    assert text == "a 🚀 b" and got_ids == ids


def test_the_origin_passes_through_without_the_fields_the_router_asked_for(decoder):
    relay = StreamRelay("/v1/completions", {"stream": True})
    first = msgspec.json.encode({**HEADER, "choices": [{"index": 0, "text": "", "logprobs": None,
        "finish_reason": None, "stop_reason": None, "prompt_token_ids": [5, 6], "token_ids": [7]}]})  # fmt: skip
    assert relay.handle(first).events == []  # held-back text only: nothing the client would have got
    second = {**HEADER, "choices": [{"index": 0, "text": "hi", "logprobs": None, "finish_reason": None,
                                     "stop_reason": None, "token_ids": [8]}]}  # fmt: skip
    [event] = relay.handle(msgspec.json.encode(second)).events
    del second["choices"][0]["token_ids"]
    assert event == b"data: " + msgspec.json.encode(second) + b"\n\n"  # the replica's bytes without the field
    assert (relay.prompt_ids, relay.sent_ids, relay.sent_text) == ([5, 6], [7, 8], ["hi"])
    # A client that asked for the ids gets the replica's bytes untouched.
    asking = StreamRelay("/v1/completions", {"stream": True, "return_token_ids": True})
    assert asking.handle(first).events == [b"data: " + first + b"\n\n"]


def test_a_chat_continuation_is_written_as_the_original_chat_stream():
    relay = StreamRelay("/v1/chat/completions", {"stream": True, "logprobs": True, "top_logprobs": 1,
                                                 "stream_options": {"include_usage": True}})  # fmt: skip
    first = {**CHAT_HEADER, "usage": None, "choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hi"},
             "logprobs": None, "finish_reason": None, "stop_reason": None, "token_ids": [10, 11]}],
             "prompt_token_ids": [1, 2, 3, 4]}  # fmt: skip
    relay.handle(msgspec.json.encode(first))
    relay.begin_continuation()
    logprobs = {"tokens": [" there"], "token_logprobs": [-0.5], "top_logprobs": [{" there": -0.5, "!": -0.6}],
                "text_offset": [0]}  # fmt: skip
    chunk = {**HEADER, "id": "cmpl-9", "usage": None, "choices": [{"index": 0, "text": " there", "logprobs": logprobs,
             "finish_reason": "length", "stop_reason": None, "prompt_token_ids": [1, 2, 3, 4, 10, 11],
             "token_ids": [12]}]}  # fmt: skip
    result = relay.handle(msgspec.json.encode(chunk))
    assert relay.splice_ids() == [[10, 11, 12], [12]]
    [event] = relay.apply_splice(["Hi there", " there"]).events
    got = json.loads(event[6:])
    assert got == {**CHAT_HEADER, "usage": None, "choices": [{"index": 0, "delta": {"content": " there"},
                   "logprobs": {"content": [{"token": " there", "logprob": -0.5, "bytes": list(b" there"),
                                             "top_logprobs": [{"token": " there", "logprob": -0.5,
                                                               "bytes": list(b" there")}]}], "refusal": None},
                   "finish_reason": "length", "stop_reason": None}]}  # fmt: skip
    assert result.events == []
    usage = {**HEADER, "id": "cmpl-9", "choices": [], "usage": {"prompt_tokens": 6, "completion_tokens": 1,
             "total_tokens": 7, "prompt_tokens_details": {"cached_tokens": 6}}}  # fmt: skip
    [event] = relay.handle(msgspec.json.encode(usage)).events
    assert json.loads(event[6:]) == {**CHAT_HEADER, "usage": {"prompt_tokens": 4, "completion_tokens": 3,
                                     "total_tokens": 7, "prompt_tokens_details": {"cached_tokens": 4}}, "choices": []}  # fmt: skip
    assert relay.handle(DONE_DATA).done


@pytest.mark.parametrize("event", [
    {"error": {"message": "engine died", "type": "server_error", "param": None, "code": None}},
    {**HEADER, "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": "error", "stop_reason": None,
                            "token_ids": []}]},
    {**HEADER, "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": "abort", "stop_reason": None,
                            "token_ids": []}]},
])  # fmt: skip
def test_a_replica_side_failure_is_not_passed_on(event):
    relay = StreamRelay("/v1/completions", {"stream": True})
    result = relay.handle(msgspec.json.encode(event))
    assert result.failure and result.events == [] and not result.done


def test_a_lost_tail_after_the_finish_is_written_by_the_router():
    relay = StreamRelay("/v1/completions", {"stream": True, "stream_options": {"include_usage": True}})
    relay.handle(msgspec.json.encode({**HEADER, "usage": None, "choices": [{"index": 0, "text": "x", "logprobs": None,
        "finish_reason": "length", "stop_reason": None, "prompt_token_ids": [1, 2], "token_ids": [3]}]}))  # fmt: skip
    usage, done = relay.finish_tail()
    assert json.loads(usage[6:])["usage"]["total_tokens"] == 3 and done == b"data: [DONE]\n\n"


def test_splice_and_boundary_stops():
    assert splice("hel", "hello", "lo") == Splice("", 0)
    assert splice("he", "hello", "lo") == Splice("l", 0)  # held back by the lost replica
    assert splice("hello", "hello world", "world") == Splice(" ", 0)  # a leading space decoded alone is lost
    assert splice("caf", "café!", "\ufffd!") == Splice("é", 1)  # the rest of a character the boundary split
    assert splice("other", "hello", "lo") is None
    assert boundary_stop("xSTOP", 1, ["STOP"]) is None  # starts after the boundary: the continuation's to find
    assert boundary_stop("aSTOP", 2, ["STOP", "aS"]) == (0, "aS")
    assert boundary_stop("ab", 1, ["abc"]) is None and not stop_settled("ab", 1, ["abc"])  # "c" may come
    assert stop_settled("abd", 1, ["abc"]) and stop_settled("", 0, [])


def test_continuation_requests():
    chat = {"messages": [], "stream": True, "temperature": 0.7, "seed": 5, "min_tokens": 10, "logprobs": True,
            "top_logprobs": 3, "stop": ["x"], "stream_options": {"include_usage": True}, "n": 1}  # fmt: skip
    assert migratable("/v1/chat/completions", chat)
    assert remaining_tokens("/v1/chat/completions", chat, 10, 4, max_model_len=100) == 86
    body = continuation_body("/v1/chat/completions", chat, [1, 2], [3, 4, 5], 20)
    assert body == {"temperature": 0.7, "stop": ["x"], "prompt": [1, 2, 3, 4, 5], "max_tokens": 20, "stream": True,
                    "return_token_ids": True, "min_tokens": 7, "seed": 8, "logprobs": 3,
                    "stream_options": {"include_usage": True}}  # fmt: skip
    completion = {"prompt": "hi", "stream": True, "max_tokens": 50}
    assert remaining_tokens("/v1/completions", completion, 2, 30, None) == 20
    assert remaining_tokens("/v1/completions", {"prompt": "hi"}, 2, 6, None) == 10  # the default 16
    assert not migratable("/v1/completions", {**completion, "n": 2})
    assert not migratable("/v1/completions", {**completion, "prompt": ["a", "b"]})
    assert not migratable("/v1/completions", {**completion, "echo": True})
    assert not migratable("/v1/completions", {**completion, "stream": False})
    assert migratable("/v1/completions", {**completion, "prompt": [1, 2, 3]})
    # A constrained stream moves with its constraint, resumed after what was sent; tools do not move.
    constrained = {**chat, "response_format": {"type": "json_object"}, "servelm": {"timeline": True}}
    assert migratable("/v1/chat/completions", constrained)
    body = continuation_body("/v1/chat/completions", constrained, [1, 2], [3, 4, 5], 20)
    assert body["response_format"] == {"type": "json_object"}
    assert body["servelm"] == {"timeline": True, "structured_resume_tokens": 3}
    regex = continuation_body("/v1/completions", {**completion, "structured_outputs": {"regex": "a+"}}, [1], [2], 5)
    assert regex["structured_outputs"] == {"regex": "a+"} and regex["servelm"] == {"structured_resume_tokens": 1}
    assert continuation_body("/v1/completions", {**completion, "servelm": {"timeline": True}}, [1], [2], 5)["servelm"] == \
        {"timeline": True}  # fmt: skip
    assert not migratable("/v1/chat/completions", {**chat, "tools": [{"type": "function"}]})
    assert migratable("/v1/chat/completions", {**chat, "tools": [{"type": "function"}], "tool_choice": "none"})
    assert migratable("/v1/chat/completions", {**chat, "response_format": {"type": "text"}})


def test_events_are_cut_whole_however_the_bytes_arrive():
    raw = b'data: {"a":1}\n\ndata: {"b":2}\n\ndata: [DONE]\n\n'
    for size in (1, 3, 7, len(raw)):
        splitter = EventSplitter()
        events = [e for i in range(0, len(raw), size) for e in splitter.feed(raw[i : i + size])]
        assert events == [b'{"a":1}', b'{"b":2}', DONE_DATA] and splitter.pending == 0
