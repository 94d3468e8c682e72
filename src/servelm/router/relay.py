"""The client's side of a stream that may move between replicas: what the client has, and each
upstream event turned into what it should see.

    origin leg        replica event ─▶ record prompt ids, ids, text, finish ─▶ drop the return_token_ids
                      fields the router asked for (and entries left empty by that) ─▶ client, same bytes
    continuation leg  completion chunk ─▶ _Piece ─▶ boundary: splice (splice.py), a stop string across
                      it, held until decided ─▶ a chunk of the client's kind (completion or chat) with
                      the original id/created/model ─▶ client

No I/O here: the migrating stream (migration.py) reads the replicas, asks `splice_ids()` which ids to
decode across the boundary and hands their texts to `apply_splice`. Every event a result carries is
written to the client before the next event is handled, so `sent_ids` is what the client has
(the ids of an entry dropped for being empty count: it was generated and passed on).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from servelm.openai_api.errors import SERVER_ERROR, error_body
from servelm.router.continuation import is_chat
from servelm.router.splice import REPLACEMENT, Splice, boundary_stop, splice, stop_settled
from servelm.router.sse import DONE_DATA, DONE_EVENT, encode_event, frame

logger = logging.getLogger(__name__)
# A choice that ended this way ended because of the replica (its engine failed, it shut down),
# not because of the request: the stream goes on elsewhere.
FAILED_FINISH_REASONS = ("error", "abort")
_decoder = msgspec.json.Decoder()


def replica_lost_events(message: str) -> list[bytes]:
    """The end of a stream whose replica failed and that cannot go on: an error event (what the
    OpenAI clients raise), then [DONE]."""
    return [encode_event(error_body(message, SERVER_ERROR, code="replica_lost")), DONE_EVENT]


@dataclass
class RelayResult:
    events: list[bytes] = field(default_factory=list)  # to write to the client, in order
    failure: str | None = None  # the upstream failed (why); its event is not passed on
    done: bool = False  # the client's stream is complete: stop reading


@dataclass
class _Piece:
    """One continuation entry, in the continuation's (completions) terms."""

    text: str
    token_ids: list[int]
    logprobs: dict[str, list[Any]] | None
    finish_reason: str | None = None
    stop_reason: Any = None


@dataclass
class _Boundary:
    """The continuation's first entries, held until the join with what the client has is settled.

    Its stop-string watch reads the decoded text of the ids, not the continuation's own text: that
    lags behind its ids (the continuation holds back too), and the stream must end at the very
    token that completes a stop string, as one replica's would."""

    pieces: list[_Piece] = field(default_factory=list)
    join: Splice | None = None  # set by apply_splice
    exact: bool = True  # False: the texts could not be joined by decoding; they are joined as they are
    decoded: int = 0  # pieces the last decode covered

    @property
    def token_ids(self) -> list[int]:
        return [t for piece in self.pieces for t in piece.token_ids]

    @property
    def finished(self) -> bool:
        return bool(self.pieces) and self.pieces[-1].finish_reason is not None

    def text(self) -> str:
        """pending + the continuation's own text after `skip` (call once joined)."""
        assert self.join is not None
        return self.join.pending + "".join(p.text for p in self.pieces)[self.join.skip :]


class StreamRelay:
    """One migratable request's stream state. Used from the router's event loop only."""

    def __init__(self, path: str, body: Mapping[str, Any]) -> None:
        self.chat = is_chat(path)
        self.wants_ids = body.get("return_token_ids") is True  # the client's own ask: fields stay
        stop = body.get("stop")
        self.stops: list[str] = [stop] if isinstance(stop, str) else [s for s in stop or [] if isinstance(s, str)]
        self.include_stop = bool(body.get("include_stop_str_in_output"))
        self.skip_special_tokens = body.get("skip_special_tokens") is not False  # how the stream's text is decoded
        self.num_top = int(body.get("top_logprobs") or 0)  # chat's; completions pass theirs through
        options = body.get("stream_options")
        self.include_usage = isinstance(options, Mapping) and bool(options.get("include_usage"))
        self.prompt_ids: list[int] | None = None
        self.sent_ids: list[int] = []
        self.sent_text: list[str] = []
        self.finish_reason: str | None = None
        self.done = False  # [DONE] went out
        self._header: dict[str, Any] | None = None  # id, object, created, model (+ usage: null) of every chunk
        self._role_sent = False
        self._cached_tokens = 0
        self._continuing = False  # the current leg is a continuation (its events need converting)
        self._boundary: _Boundary | None = None
        self._skip_left = 0  # continuation characters still to drop after the boundary was released
        self._offset_base = 0  # completions logprobs: the client's text_offset where this leg began
        self._next_offset = 0

    # -- what the migrating stream asks -------------------------------------------------------

    @property
    def can_continue(self) -> bool:
        """The prompt's ids are known (every stream's first event carries them)."""
        return self.prompt_ids is not None

    @property
    def stream_id(self) -> str:
        """The id the client sees (for logs), once the first chunk came."""
        return str(self._header.get("id", "?")) if self._header is not None else "(not started)"

    @property
    def started(self) -> bool:
        """The replica's first chunk came (the client may have it and this stream's id): a new leg
        must continue the stream, not start it again."""
        return self._header is not None

    def begin_continuation(self) -> None:
        """The next events come from a continuation request (continuation.py)."""
        self._continuing = True
        self._boundary = _Boundary()
        self._skip_left = 0
        self._offset_base = self._next_offset

    def handle(self, data: bytes) -> RelayResult:
        """One upstream event's data field."""
        if data == DONE_DATA:
            if self._boundary is not None and self._boundary.pieces:  # a finish always settles it first
                return RelayResult(failure="[DONE] before the continuation's first tokens were settled")
            self.done = True
            return RelayResult([DONE_EVENT], done=True)
        try:
            payload = _decoder.decode(data)
        except msgspec.DecodeError:
            return RelayResult(failure="an event that is not JSON")
        if not isinstance(payload, dict):
            return RelayResult(failure="an event that is not an object")
        if "error" in payload:
            return RelayResult(failure=f"an error event: {str(payload['error'])[:200]}")
        choices = payload.get("choices") or []
        failed = next((c["finish_reason"] for c in choices if c.get("finish_reason") in FAILED_FINISH_REASONS), None)
        if failed is not None:
            return RelayResult(failure=f"finish_reason {failed!r}")
        if self._continuing:
            return self._continuation_event(payload, choices)
        return self._origin_event(data, payload, choices)

    def splice_ids(self) -> list[list[int]] | None:
        """Id lists to decode (the replicas' /detokenize) before the boundary can go on, or None:
        [ids sent + held, held] until joined, then [ids sent + held] while a stop string may
        still start in `pending`. Asked after every event of a continuation."""
        boundary = self._boundary
        if boundary is None or not boundary.exact or boundary.decoded == len(boundary.pieces):
            return None
        held = boundary.token_ids
        return [self.sent_ids + held, held] if boundary.join is None else [self.sent_ids + held]

    def apply_splice(self, texts: list[str | None]) -> RelayResult:
        """The texts of splice_ids() (None: that decode failed): join, watch for a stop string,
        release what is settled. The join waits while the boundary splits a character."""
        boundary = self._boundary
        assert boundary is not None
        boundary.decoded = len(boundary.pieces)
        whole, sent = texts[0], "".join(self.sent_text)
        if boundary.join is None:
            right = texts[1]
            if whole is not None and whole.endswith(REPLACEMENT) and not boundary.finished:
                return RelayResult()  # the next ids finish the character
            boundary.join = splice(sent, whole, right) if whole is not None and right is not None else None
            if boundary.join is None:
                logger.warning("migration: could not join the texts at the boundary; they are joined as they are")
                boundary.join, boundary.exact = Splice("", 0), False
        if boundary.exact and whole is not None and whole.startswith(sent):
            return self._settle(whole[len(sent) :])
        boundary.exact = False
        return self._settle(boundary.text())

    def finish_tail(self) -> list[bytes]:
        """The stream's end when its finish already went out and only the tail was lost."""
        events = [self._usage_event({})] if self.include_usage and self._header is not None else []
        self.done = True
        return [*events, DONE_EVENT]

    def error_tail(self, message: str) -> list[bytes]:
        """A stream that cannot go on: an error event the OpenAI clients raise, then [DONE]."""
        self.done = True
        return replica_lost_events(message)

    # -- the origin leg: pass through, minus the fields the router added ---------------------------

    def _origin_event(self, data: bytes, payload: dict[str, Any], choices: list[dict[str, Any]]) -> RelayResult:
        changed = False
        if self._header is None and choices:
            self._header = {k: payload[k] for k in ("id", "object", "created", "model") if k in payload}
            if "usage" in payload:
                self._header["usage"] = None
        if "prompt_token_ids" in payload:  # chat: the first chunk's
            self.prompt_ids = payload["prompt_token_ids"]
            changed = self._strip(payload, "prompt_token_ids") or changed
        kept = []
        for entry in choices:
            changed = self._record_origin(entry) or changed
            if self.wants_ids or not self._empty(entry):
                kept.append(entry)
        usage = payload.get("usage")
        if isinstance(usage, dict):
            self._cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        if choices and not kept:
            return RelayResult()  # only ids the client did not ask for
        if len(kept) < len(choices):
            payload["choices"], changed = kept, True
        return RelayResult([encode_event(payload) if changed else frame(data)])

    def _record_origin(self, entry: dict[str, Any]) -> bool:
        changed = False
        if "prompt_token_ids" in entry:  # completions: the choice's first entry
            self.prompt_ids = entry["prompt_token_ids"]
            changed = self._strip(entry, "prompt_token_ids")
        self.sent_ids.extend(entry.get("token_ids") or ())
        changed = self._strip(entry, "token_ids") or changed
        if self.chat:
            delta = entry.get("delta") or {}
            self._role_sent = self._role_sent or "role" in delta
            text = delta.get("content") or ""
        else:
            text = entry.get("text") or ""
            self._note_offsets(entry.get("logprobs"))
        if text:
            self.sent_text.append(text)
        if entry.get("finish_reason") is not None:
            self.finish_reason = entry["finish_reason"]
        return changed

    def _strip(self, mapping: dict[str, Any], key: str) -> bool:
        if self.wants_ids or key not in mapping:
            return False
        del mapping[key]
        return True

    def _empty(self, entry: dict[str, Any]) -> bool:
        """What the replica would not have sent without return_token_ids: no text, logprobs or finish."""
        body = entry.get("delta") if self.chat else entry.get("text")
        return not body and entry.get("logprobs") is None and entry.get("finish_reason") is None

    def _note_offsets(self, logprobs: dict[str, Any] | None) -> None:
        if logprobs and logprobs.get("tokens"):
            self._next_offset = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])

    # -- continuation legs: convert, join at the boundary ----------------------------------------

    def _continuation_event(self, payload: dict[str, Any], choices: list[dict[str, Any]]) -> RelayResult:
        if not choices:
            if isinstance(payload.get("usage"), dict):  # the final usage chunk
                return RelayResult([self._usage_event(payload)])
            return RelayResult()
        entry = choices[0]
        piece = _Piece(entry.get("text") or "", entry.get("token_ids") or [], entry.get("logprobs"),
                       entry.get("finish_reason"), entry.get("stop_reason"))  # fmt: skip
        if self._boundary is not None:
            self._boundary.pieces.append(piece)  # decoded by splice_ids / apply_splice, unless inexact
            return RelayResult() if self._boundary.exact else self._settle(self._boundary.text())
        if self._skip_left:
            cut = min(self._skip_left, len(piece.text))
            piece.text, self._skip_left = piece.text[cut:], self._skip_left - cut
        return RelayResult(self._emit(piece))

    def _settle(self, decoded: str) -> RelayResult:
        """Release the held pieces as one once no stop string can start in `pending` (`decoded`: the
        boundary's text from `pending` on); or end the stream where one does (the continuation never
        saw `pending`, so it cannot)."""
        boundary = self._boundary
        assert boundary is not None and boundary.join is not None
        start = len(boundary.join.pending)
        hit = boundary_stop(decoded, start, self.stops) if self.stops else None
        if hit is None and not boundary.finished and not stop_settled(decoded, start, self.stops):
            return RelayResult()
        self._boundary = None
        raw = sum(len(p.text) for p in boundary.pieces)
        self._skip_left = max(0, boundary.join.skip - raw)
        last = boundary.pieces[-1]
        merged = _Piece(boundary.text(), boundary.token_ids, _merge_logprobs(boundary.pieces), last.finish_reason,
                        last.stop_reason)  # fmt: skip
        if hit is None:
            return RelayResult(self._emit(merged))
        position, stop = hit
        merged.text = decoded[: position + len(stop)] if self.include_stop else decoded[:position]
        merged.finish_reason, merged.stop_reason = "stop", stop
        return RelayResult([*self._emit(merged), *self.finish_tail()], done=True)

    def _emit(self, piece: _Piece) -> list[bytes]:
        """One continuation piece as the client's chunk (none when it would be empty)."""
        assert self._header is not None
        self.sent_ids.extend(piece.token_ids)
        if piece.text:
            self.sent_text.append(piece.text)
        if piece.finish_reason is not None:
            self.finish_reason = piece.finish_reason
        entry = self._chat_entry(piece) if self.chat else self._completion_entry(piece)
        if entry is None:
            return []
        if self.wants_ids:
            entry["token_ids"] = piece.token_ids
        return [encode_event({**self._header, "choices": [entry]})]

    def _completion_entry(self, piece: _Piece) -> dict[str, Any] | None:
        logprobs = piece.logprobs
        if logprobs is not None:
            logprobs = {**logprobs, "text_offset": [o + self._offset_base for o in logprobs["text_offset"]]}
            self._note_offsets(logprobs)
        if not piece.text and logprobs is None and piece.finish_reason is None and not self.wants_ids:
            return None
        return {"index": 0, "text": piece.text, "logprobs": logprobs, "finish_reason": piece.finish_reason,
                "stop_reason": piece.stop_reason}  # fmt: skip

    def _chat_entry(self, piece: _Piece) -> dict[str, Any] | None:
        delta: dict[str, str] = {}
        if not self._role_sent:
            self._role_sent = True
            delta["role"] = "assistant"
        if piece.text or delta:
            delta["content"] = piece.text
        logprobs = _chat_logprobs(piece.logprobs, self.num_top)
        if not delta and logprobs is None and piece.finish_reason is None and not self.wants_ids:
            return None
        return {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": piece.finish_reason,
                "stop_reason": piece.stop_reason}  # fmt: skip

    def _usage_event(self, final: Mapping[str, Any]) -> bytes:
        """The usage chunk as one replica would have written it: the original prompt, every token."""
        assert self._header is not None
        prompt_ids = self.prompt_ids or []
        details = (final.get("usage") or {}).get("prompt_tokens_details") or {}
        cached = min(details.get("cached_tokens", self._cached_tokens), len(prompt_ids))
        usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": len(self.sent_ids),
                 "total_tokens": len(prompt_ids) + len(self.sent_ids),
                 "prompt_tokens_details": {"cached_tokens": cached}}  # fmt: skip
        chunk = {**self._header, "choices": [], "usage": usage}
        if "servelm" in final:  # the timeline, when asked for: the last leg's
            chunk["servelm"] = final["servelm"]
        return encode_event(chunk)


def _merge_logprobs(pieces: list[_Piece]) -> dict[str, list[Any]] | None:
    parts = [p.logprobs for p in pieces if p.logprobs is not None]
    if not parts:
        return None
    return {key: [value for part in parts for value in part[key]] for key in parts[0]}


def _chat_logprobs(logprobs: Mapping[str, list[Any]] | None, num_top: int) -> dict[str, Any] | None:
    """Completions logprobs → chat's. The completions top dict lists the top alternatives first and
    then the chosen token if it was not among them (server/logprobs.py): the first `num_top` are chat's."""
    if logprobs is None or not logprobs.get("tokens"):
        return None
    content = []
    for token, logprob, top in zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"]):
        alternatives = list((top or {}).items())[:num_top]
        content.append({
            "token": token, "logprob": logprob, "bytes": list(token.encode("utf-8")),
            "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))} for t, lp in alternatives],
        })  # fmt: skip
    return {"content": content, "refusal": None}
