"""Server-sent events as the replicas write them: `data: <json>\\n\\n` each, `data: [DONE]\\n\\n` last.

A stream the router may migrate is re-framed event by event (relay.py): `EventSplitter` cuts the
raw bytes, however the network delivered them, into whole events' data; `encode_event` writes
one back in the replicas' own framing and JSON encoder (msgspec, compact, keys in order), so an
event that passes through unchanged is the same bytes.
"""

from __future__ import annotations

from typing import Any

import msgspec

DONE_DATA = b"[DONE]"
DONE_EVENT = b"data: [DONE]\n\n"
_END = b"\n\n"
_DATA = b"data: "
_encoder = msgspec.json.Encoder()


def encode_event(payload: dict[str, Any]) -> bytes:
    return _DATA + _encoder.encode(payload) + _END


def frame(data: bytes) -> bytes:
    """An event whose data field is `data`, unchanged."""
    return _DATA + data + _END


class EventSplitter:
    """Whole events out of a byte stream. Not thread-safe; one per upstream response."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        """The data fields of the events `chunk` completes, in order (comment and other field lines
        are dropped; replicas write none). A partial event waits in the buffer for the next chunk."""
        buffer = self._buffer + chunk if self._buffer else chunk
        events = []
        start = 0
        while (end := buffer.find(_END, start)) != -1:
            for line in buffer[start:end].split(b"\n"):
                if line.startswith(_DATA):
                    events.append(line[len(_DATA) :])
            start = end + len(_END)
        self._buffer = buffer[start:]
        return events

    @property
    def pending(self) -> int:
        """Bytes of an event not yet complete (what a cut stream loses)."""
        return len(self._buffer)
