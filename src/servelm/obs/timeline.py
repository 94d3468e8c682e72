"""Per-request timelines: every hand-off of one HTTP request, and where its TTFT went.

Two processes stamp one request:

    API   received ─ tokenized ─ sent_to_core ┐            ┌ first_output_received ─ first_token_detokenized ─ first_byte_written ─ … ─ finished
    core                                      └ arrived ─ queued ─ scheduled ─ prefill_chunk … [preempted ─ queued ─ scheduled ─ prefill_chunk …] ─ first_token ─ … ─ finished

Clocks. The core stamps its events with `time.time()` (see datatypes.RequestEvent) and
the API process stamps its hand-offs with `time.time()` too: both processes run on one
host, so both read the same CLOCK_REALTIME and a span from an API stamp to a core stamp is
a plain difference. The one thing that could break that is a clock *step* (an NTP jump)
inside a request's lifetime, so API stamps also carry `time.perf_counter()`, and the
breakdown reports `ttft_mono`, the TTFT measured on the monotonic clock alone: when it
disagrees with the wall-clock sum, the wall clock stepped and the split is suspect.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from servelm.datatypes import EventType, RequestEvent
from servelm.obs.attribution import TTFTBreakdown, attribute_ttft


class ApiStamp(str, enum.Enum):
    RECEIVED = "received"  # the ASGI app saw the request (before the body is parsed)
    TOKENIZED = "tokenized"  # prompt(s) templated and tokenized
    SENT_TO_CORE = "sent_to_core"  # the first engine request left for the core
    FIRST_OUTPUT_RECEIVED = "first_output_received"  # first engine output with a token reached the API
    FIRST_TOKEN_DETOKENIZED = "first_token_detokenized"  # … and was turned into text
    # The chunk carrying it is handed to the ASGI server, which writes it to the socket without
    # suspending (streaming). Stamped just before the hand-off: a stamp after it waits until the
    # generator is resumed, which on a busy event loop came 4 ms after the client had the bytes.
    FIRST_BYTE_WRITTEN = "first_byte_written"
    FINISHED = "finished"  # the last choice finished in the API process


@dataclass
class RequestTimeline:
    """One HTTP request: API stamps (first write wins) plus the core events of each choice."""

    request_id: str
    streaming: bool
    wall: dict[ApiStamp, float] = field(default_factory=dict)
    mono: dict[ApiStamp, float] = field(default_factory=dict)
    # choice index → that engine request's core events; the lists are the fan-out's own
    # RequestState.events, which it extends in place as outputs arrive.
    choice_events: dict[int, list[RequestEvent]] = field(default_factory=dict)

    def stamp(self, name: ApiStamp, wall: float | None = None, mono: float | None = None) -> None:
        if name in self.wall:
            return
        self.wall[name] = time.time() if wall is None else wall
        self.mono[name] = time.perf_counter() if mono is None else mono

    def first_token_choice(self) -> int | None:
        """The choice whose first token the core sampled first (what the client saw first)."""
        best: tuple[float, int] | None = None
        for index, events in self.choice_events.items():
            stamp = _first(events, EventType.FIRST_TOKEN)
            if stamp is not None and (best is None or stamp < best[0]):
                best = (stamp, index)
        return None if best is None else best[1]

    def breakdown(self) -> TTFTBreakdown | None:
        """TTFT split into ingress / queue / prefill / preemption / output; None before a first token.

        TTFT ends at `first_byte_written` for a stream; a non-streaming response is written only
        when complete, so there it ends at `first_token_detokenized`.
        """
        choice = self.first_token_choice()
        end_stamp = ApiStamp.FIRST_BYTE_WRITTEN if self.streaming else ApiStamp.FIRST_TOKEN_DETOKENIZED
        needed = (ApiStamp.RECEIVED, ApiStamp.SENT_TO_CORE, ApiStamp.FIRST_OUTPUT_RECEIVED, end_stamp)
        if choice is None or any(stamp not in self.wall for stamp in needed):
            return None
        return attribute_ttft(
            received=self.wall[ApiStamp.RECEIVED],
            sent_to_core=self.wall[ApiStamp.SENT_TO_CORE],
            first_output_received=self.wall[ApiStamp.FIRST_OUTPUT_RECEIVED],
            first_token_detokenized=self.wall.get(ApiStamp.FIRST_TOKEN_DETOKENIZED, self.wall[end_stamp]),
            end=self.wall[end_stamp],
            ttft_mono=self.mono[end_stamp] - self.mono[ApiStamp.RECEIVED],
            events=self.choice_events[choice],
        )

    def to_dict(self) -> dict:
        """JSON-ready: absolute origin, then every stamp in ms after `received` (one clock, see module doc)."""
        origin = self.wall.get(ApiStamp.RECEIVED, 0.0)
        breakdown = self.breakdown()
        return {
            "request_id": self.request_id,
            "clock": "unix time.time() seconds, shared by the API and core processes on one host",
            "received_unix": origin,
            "api_ms": {stamp.value: _ms(t - origin) for stamp, t in self.wall.items()},
            "choices": [
                {
                    "index": index,
                    "events": [
                        {"type": e.type.value, "t_ms": _ms(e.timestamp - origin), "detail": e.detail} for e in events
                    ],
                    "num_preemptions": sum(1 for e in events if e.type is EventType.PREEMPTED),
                    # Speculative decoding: drafts accepted in each step that verified some.
                    "spec_accepted_per_step": [e.detail for e in events if e.type is EventType.SPEC_VERIFIED],
                }
                for index, events in sorted(self.choice_events.items())
            ],
            "ttft_breakdown_ms": breakdown.as_ms() if breakdown is not None else None,
        }


def _first(events: list[RequestEvent], kind: EventType) -> float | None:
    for event in events:
        if event.type is kind:
            return event.timestamp
    return None


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)
