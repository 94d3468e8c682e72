"""What a benchmark sends: requests with a traffic class, and each class's SLO.

A workload is a plain list of `WorkloadRequest`s, built ahead of the run from a seed (so
the same seed gives the same prompts, lengths and arrival times), then replayed by the
runner. Requests of one multi-turn session name the turn before them (`after`): the runner
sends a turn only once the previous one has finished, as a user would, and resends what the
server actually replied (`NextTurn`), as a chat client does.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class SLO:
    """Per-request bounds of one traffic class (None: unbounded) and the share that must meet them.

    A request meets its SLO when it succeeded, its TTFT <= ttft_s, the `percentile`-th percentile
    of its own inter-token gaps <= tbt_s, and its end-to-end latency <= e2e_s. The class meets its
    SLO when at least `percentile` % of its requests do: "TTFT p90 <= 0.5 s" is
    SLO(ttft_s=0.5, percentile=90) met by the class.
    """

    ttft_s: float | None = None
    tbt_s: float | None = None
    e2e_s: float | None = None
    percentile: float = 90.0

    def __post_init__(self) -> None:
        if not 0.0 < self.percentile <= 100.0:
            raise ValueError(f"SLO percentile must be in (0, 100], got {self.percentile}")
        for name in ("ttft_s", "tbt_s", "e2e_s"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"SLO {name} must be > 0, got {value}")

    def describe(self) -> str:
        parts = [f"{label} p{self.percentile:g} <= {value:g} s"
                 for label, value in (("TTFT", self.ttft_s), ("TBT", self.tbt_s), ("E2E", self.e2e_s))
                 if value is not None]  # fmt: skip
        return ", ".join(parts) or "none"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# The example SLOs; every one can be overridden with --slo CLASS:ttft=..,tbt=..,e2e=..,p=..
DEFAULT_SLOS: dict[str, SLO] = {
    "voice": SLO(ttft_s=0.5, tbt_s=0.1),
    "code": SLO(ttft_s=2.0),
    "analytics": SLO(ttft_s=10.0, e2e_s=60.0),  # throughput work: relaxed, and sent at a lower priority
    "chat": SLO(ttft_s=1.0, tbt_s=0.2),
    "longchat": SLO(ttft_s=1.0, tbt_s=0.2),
    "trace": SLO(ttft_s=2.0, tbt_s=0.2),
}

# Sent as `priority` to servers that take it (lower runs first): analytics yields to interactive work.
DEFAULT_PRIORITIES: dict[str, int] = {"voice": 0, "code": 0, "chat": 0, "analytics": 1, "longchat": 0, "trace": 0}


def parse_slo(spec: str, base: dict[str, SLO]) -> dict[str, SLO]:
    """`voice:ttft=0.5,tbt=0.1,p=95` → base with voice's SLO replaced (unnamed bounds: none)."""
    name, _, rest = spec.partition(":")
    if not name or not rest:
        raise ValueError(f"--slo wants CLASS:ttft=S,tbt=S,e2e=S,p=PCT, got {spec!r}")
    keys = {"ttft": "ttft_s", "tbt": "tbt_s", "e2e": "e2e_s", "p": "percentile"}
    values: dict[str, float] = {}
    for part in rest.split(","):
        key, _, value = part.partition("=")
        if key.strip() not in keys:
            raise ValueError(f"unknown SLO bound {key!r} in {spec!r}: expected one of {sorted(keys)}")
        values[keys[key.strip()]] = float(value)
    return {**base, name.strip(): SLO(**values)}


@dataclass(frozen=True)
class NextTurn:
    """How a session's turn continues the one before it (`WorkloadRequest.after`).

    Its prompt is the previous turn's prompt as it was sent, the reply the server actually gave,
    then `text`: a chat client resends what the model said, so the server's cached prefix covers
    the whole history and only the new turn is new work. A history of replies the model never
    wrote would make every turn recompute the last reply (and, in a chat, everything after it).
    The workload's own `prompt_ids`/`prompt_text`/`messages` are the plan: what is sent when the
    previous turn's reply is exactly `planned_reply`.
    """

    text: str  # completions: appended after the reply; as `messages`: the new user message's content
    planned_reply: str  # the previous turn's reply as the profile drew it: resent when that turn got no text

    def history(self, previous_prompt: str, reply: str) -> str:
        """What a completions prompt resends before `text`; `reply` "" stands for one that never came."""
        return previous_prompt + (reply or self.planned_reply)

    def messages(self, previous: list[dict[str, str]], reply: str) -> list[dict[str, str]]:
        return [*previous, {"role": "assistant", "content": reply or self.planned_reply},
                {"role": "user", "content": self.text}]  # fmt: skip


@dataclass
class WorkloadRequest:
    """One request to send. Prompts are token ids of clean words (see bench.tokens)."""

    index: int  # position in the workload; records keep it
    traffic_class: str
    prompt_ids: list[int]  # what the prompt text decodes from (no special tokens)
    num_prompt_tokens: int  # what the server will count: len(prompt_ids) + the tokenizer's BOS, if any
    max_tokens: int
    priority: int = 0
    session_id: str | None = None  # multi-turn session, repository or trace prefix group
    after: int | None = None  # index of the session's previous turn: sent only once it finished
    shared_prefix_tokens: int = 0  # leading prompt tokens identical to an earlier request's prompt
    arrival_s: float | None = None  # seconds after the run starts; None: closed loop (sent when a slot frees)
    prompt_text: str = field(default="", repr=False)  # decode(prompt_ids), checked exact
    # A whole chat history (role/content dicts ending with a user turn), sent as `messages` to
    # /v1/chat/completions whatever the endpoint: the server renders and tokenizes all of it.
    # None: `prompt_text` is the prompt (or the one user message).
    messages: list[dict[str, str]] | None = field(default=None, repr=False)
    slow_reader: bool = False  # its client reads the stream slowly (ClientConfig.slow_reading says how)
    turn: NextTurn | None = field(default=None, repr=False)  # with `after`: resend the actual reply (NextTurn)

    def describe(self) -> dict[str, Any]:
        """The request without its prompt: what the JSON report keeps."""
        return {
            "index": self.index,
            "traffic_class": self.traffic_class,
            "num_prompt_tokens": self.num_prompt_tokens,
            "max_tokens": self.max_tokens,
            "priority": self.priority,
            "session_id": self.session_id,
            "after": self.after,
            "shared_prefix_tokens": self.shared_prefix_tokens,
            "arrival_s": self.arrival_s,
            "num_messages": None if self.messages is None else len(self.messages),
            "slow_reader": self.slow_reader,
            "resends_reply": self.turn is not None,
        }


@dataclass(frozen=True)
class LengthLimits:
    """How generated lengths are fitted to a server and a time budget."""

    max_context: int  # the server's context window (prompt + output)
    prompt_scale: float = 1.0  # multiplies every profile's prompt lengths (small models, quick runs)
    max_output_tokens: int | None = None  # caps every profile's output lengths

    def __post_init__(self) -> None:
        if self.max_context < 64:
            raise ValueError(f"max_context must be >= 64, got {self.max_context}")
        if self.prompt_scale <= 0:
            raise ValueError(f"prompt_scale must be > 0, got {self.prompt_scale}")
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise ValueError(f"max_output_tokens must be >= 1, got {self.max_output_tokens}")

    def prompt(self, num_tokens: float) -> int:
        return max(1, round(num_tokens * self.prompt_scale))

    def output(self, num_tokens: int) -> int:
        return max(1, min(num_tokens, self.max_output_tokens or num_tokens))
