"""Workload profiles: seeded generators of requests, one per traffic class, and their mix.

    voice      short turns (prompt 30-200, output 20-80 or `voice_output_tokens`) in multi-turn sessions that resend the
               whole conversation so far: each turn's prompt starts with the previous turn's prompt
               and the reply the server actually gave (the runner fills it in: workload.NextTurn;
               the plan's reply, drawn here, stands in for one that never came)
    code       a few repositories, each a long context (1-4k tokens) resent with a small edit (5-30
               tokens replaced, in its second half: the file being worked on sits last) and a short
               question (10-60); outputs 50-300
    analytics  documents (prompt 500-2000, or `document_tokens`) after one shared instruction
               block, outputs 10-100, sent at a lower priority
    longchat   long chat sessions (20-40 turns) sent as `messages`: every turn resends the whole
               conversation with the server's actual replies, which the server renders with the chat
               template and tokenizes again, growing to thousands of tokens (capped by the context)
    chat       ShareGPT-like lengths: log-normal fits of ShareGPT's prompt and reply lengths (or
               pairs drawn from a ShareGPT JSON file, --chat-dataset)
    mixed      each request's class drawn by weight

Each profile has its own random stream (seeded with "seed:name"), so a class's requests are
the same whether it runs alone or in a mix, and the mix only decides the interleaving.
"""

from __future__ import annotations

import json
import math
import random
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from servelm.bench.tokens import TokenSource
from servelm.bench.workload import DEFAULT_PRIORITIES, LengthLimits, NextTurn, WorkloadRequest

PROFILES = ("voice", "code", "analytics", "chat", "longchat")


class Profile(Protocol):
    name: str

    def next(self, index: int) -> WorkloadRequest:
        """The profile's next request; `index` is its position in the workload."""
        ...


@dataclass
class _Base(ABC):
    tokens: TokenSource
    limits: LengthLimits
    seed: int
    salt: int = 0  # changes the prompts' tokens only, not their lengths or structure (see build_workload)
    name: str = ""
    rng: random.Random = field(init=False)  # lengths, sessions, edit positions
    text_rng: random.Random = field(init=False)  # the prompts' token ids

    def __post_init__(self) -> None:
        self.rng = random.Random(f"{self.seed}:{self.name}")
        self.text_rng = random.Random(f"{self.seed}:{self.name}:text:{self.salt}")

    @abstractmethod
    def next(self, index: int) -> WorkloadRequest:
        """See `Profile.next`; every profile below implements it."""

    def prompt_budget(self, max_tokens: int) -> int:
        """Most prompt ids (excluding the server's BOS) that fit the context with `max_tokens` more."""
        return self.limits.max_context - self.tokens.num_special_tokens - max_tokens

    def output_tokens(self, low: int, high: int) -> int:
        # At most half the context: a prompt must still fit next to it.
        return min(self.limits.output(self.rng.randint(low, high)), self.limits.max_context // 2)

    def request(
        self,
        index: int,
        prompt_ids: list[int],
        max_tokens: int,
        session_id: str | None = None,
        after: int | None = None,
        shared_prefix_tokens: int = 0,
        turn: NextTurn | None = None,
    ) -> WorkloadRequest:
        # Truncating the tail keeps whatever prefix the prompt shares with earlier ones.
        prompt_ids = prompt_ids[: self.prompt_budget(max_tokens)]
        return WorkloadRequest(
            index=index,
            traffic_class=self.name,
            prompt_ids=prompt_ids,
            num_prompt_tokens=len(prompt_ids) + self.tokens.num_special_tokens,
            max_tokens=max_tokens,
            priority=DEFAULT_PRIORITIES.get(self.name, 0),
            prompt_text=self.tokens.exact_text(prompt_ids),
            session_id=session_id,
            after=after,
            shared_prefix_tokens=shared_prefix_tokens,
            turn=turn,
        )


@dataclass
class _Session:
    session_id: str
    turns_left: int
    history: list[int] = field(default_factory=list)  # every earlier turn's prompt and (planned) reply
    last_index: int | None = None
    messages: list[dict[str, str]] = field(default_factory=list)  # the same history as chat messages
    last_reply: str = ""  # the last turn's planned reply (NextTurn.planned_reply of the next turn)

    def next_turn(self, text: str) -> NextTurn | None:
        """How the next turn, whose own part is `text`, continues this session (None: it opens it)."""
        return None if self.last_index is None else NextTurn(text=text, planned_reply=self.last_reply)


@dataclass
class VoiceProfile(_Base):
    name: str = "voice"
    max_active: int = 4  # sessions open at once
    continue_probability: float = 0.75  # next voice request continues an open session (vs starts one)
    turns: tuple[int, int] = (2, 6)  # a session's number of turns, drawn in this range
    output: tuple[int, int] = (20, 80)  # what each turn asks the server to generate, drawn in this range
    sessions: list[_Session] = field(default_factory=list)

    def _pick_session(self) -> _Session:
        active = [s for s in self.sessions if s.turns_left > 0]
        if active and (len(active) >= self.max_active or self.rng.random() < self.continue_probability):
            return self.rng.choice(active)
        return self._new_session()

    def _new_session(self) -> _Session:
        session = _Session(f"{self.name}-{len(self.sessions)}", turns_left=self.rng.randint(*self.turns))
        self.sessions.append(session)
        return session

    def next(self, index: int) -> WorkloadRequest:
        session = self._pick_session()
        user_ids = self.tokens.sample(self.text_rng, self.limits.prompt(self.rng.randint(30, 200)))
        max_tokens = self.output_tokens(*self.output)
        if session.history and len(session.history) + len(user_ids) > self.prompt_budget(max_tokens):
            session.turns_left = 0  # the conversation outgrew the context: the user starts over
            session = self._new_session()
        prompt_ids = session.history + user_ids
        request = self.request(index, prompt_ids, max_tokens, session_id=session.session_id,
                               after=session.last_index, shared_prefix_tokens=len(session.history),
                               turn=session.next_turn(self.tokens.exact_text(user_ids)))  # fmt: skip
        reply_ids = self.tokens.sample(self.text_rng, max_tokens)
        session.history = request.prompt_ids + reply_ids
        session.last_reply = self.tokens.exact_text(reply_ids)
        session.turns_left -= 1
        session.last_index = index
        return request


# What a chat template adds around each message (SmolLM2's `<|im_start|>user\n ... <|im_end|>\n`
# is 5 tokens): room kept so that a history never outgrows the context once rendered.
TEMPLATE_TOKENS_PER_MESSAGE = 8


@dataclass
class LongChatProfile(VoiceProfile):
    """Voice's sessions (same picking), but long: tens of turns of a text chat, sent as messages."""

    name: str = "longchat"
    turns: tuple[int, int] = (20, 40)
    user_tokens: tuple[int, int] = (40, 160)  # each user message
    output: tuple[int, int] = (16, 64)  # what this turn asks the server to generate (and the planned reply)

    def next(self, index: int) -> WorkloadRequest:
        session = self._pick_session()
        user_ids = self.tokens.sample(self.text_rng, self.limits.prompt(self.rng.randint(*self.user_tokens)))
        max_tokens = self.output_tokens(*self.output)
        room = self.prompt_budget(max_tokens) - TEMPLATE_TOKENS_PER_MESSAGE * (len(session.messages) + 1)
        if session.messages and len(session.history) + len(user_ids) > room:
            session.turns_left = 0  # the conversation outgrew the context: the user starts over
            session = self._new_session()
        user_ids = user_ids[: max(self.prompt_budget(max_tokens) - TEMPLATE_TOKENS_PER_MESSAGE, 1)]
        user_text = self.tokens.exact_text(user_ids)
        messages = [*session.messages, {"role": "user", "content": user_text}]
        prompt_ids = session.history + user_ids
        request = WorkloadRequest(
            index=index, traffic_class=self.name, prompt_ids=prompt_ids,
            num_prompt_tokens=len(prompt_ids) + TEMPLATE_TOKENS_PER_MESSAGE * len(messages), max_tokens=max_tokens,
            priority=DEFAULT_PRIORITIES.get(self.name, 0), session_id=session.session_id, after=session.last_index,
            shared_prefix_tokens=len(session.history), prompt_text="".join(m["content"] for m in messages),
            messages=messages, turn=session.next_turn(user_text),
        )  # fmt: skip
        reply_ids = self.tokens.sample(self.text_rng, max_tokens)
        session.last_reply = self.tokens.exact_text(reply_ids)
        session.messages = [*messages, {"role": "assistant", "content": session.last_reply}]
        session.history = prompt_ids + reply_ids
        session.turns_left -= 1
        session.last_index = index
        return request


# The code profile's lengths in tokens, drawn uniformly in each range: a repository context, the
# edit that replaces part of it, the question after it, the reply (benchmarks/kv_tiers.py builds
# its multi-turn code sessions from the same ranges).
CODE_CONTEXT_TOKENS = (1000, 4000)
CODE_EDIT_TOKENS = (5, 30)
CODE_QUESTION_TOKENS = (10, 60)
CODE_OUTPUT_TOKENS = (50, 300)


@dataclass
class _Repository:
    repo_id: str
    context_ids: list[int]
    num_sent: int = 0


@dataclass
class CodeProfile(_Base):
    name: str = "code"
    num_repositories: int = 3
    repositories: list[_Repository] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__post_init__()
        # Room for the largest question and answer next to the largest context.
        room = self.prompt_budget(
            self.limits.output(CODE_OUTPUT_TOKENS[1]) + self.limits.prompt(CODE_QUESTION_TOKENS[1])
        )
        for r in range(self.num_repositories):
            size = min(self.limits.prompt(self.rng.randint(*CODE_CONTEXT_TOKENS)), max(room, 16))
            self.repositories.append(_Repository(f"repo-{r}", self.tokens.sample(self.text_rng, size)))

    def next(self, index: int) -> WorkloadRequest:
        # Popular repositories get more traffic: weights 1, 1/2, 1/3, ...
        weights = [1.0 / (r + 1) for r in range(len(self.repositories))]
        repo = self.rng.choices(self.repositories, weights)[0]
        context = repo.context_ids
        edit_length = min(self.rng.randint(*CODE_EDIT_TOKENS), max(len(context) // 4, 1))
        position = self.rng.randint(len(context) // 2, len(context) - edit_length)
        context[position : position + edit_length] = self.tokens.sample(self.text_rng, edit_length)
        question_ids = self.tokens.sample(self.text_rng, self.limits.prompt(self.rng.randint(*CODE_QUESTION_TOKENS)))
        max_tokens = self.output_tokens(*CODE_OUTPUT_TOKENS)
        shared = position if repo.num_sent else 0
        repo.num_sent += 1
        return self.request(index, context + question_ids, max_tokens, session_id=repo.repo_id,
                            shared_prefix_tokens=shared)  # fmt: skip


@dataclass
class AnalyticsProfile(_Base):
    name: str = "analytics"
    document_tokens: tuple[int, int] = (500, 2000)  # each prompt's length (instruction included), drawn here
    instruction_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__post_init__()
        # One extraction instruction ("return JSON with fields ...") before every document.
        self.instruction_ids = self.tokens.sample(self.text_rng, self.limits.prompt(64))

    def next(self, index: int) -> WorkloadRequest:
        total = self.limits.prompt(self.rng.randint(*self.document_tokens))
        document = self.tokens.sample(self.text_rng, max(total - len(self.instruction_ids), 1))
        max_tokens = self.output_tokens(10, 100)
        return self.request(index, self.instruction_ids + document, max_tokens, session_id="analytics-instruction",
                            shared_prefix_tokens=len(self.instruction_ids))  # fmt: skip


# Log-normal fits of ShareGPT (V3, first human turn and reply, Llama-2 tokens): medians and sigmas.
_CHAT_PROMPT_MEDIAN, _CHAT_PROMPT_SIGMA, _CHAT_PROMPT_MAX = 110.0, 1.1, 2048
_CHAT_OUTPUT_MEDIAN, _CHAT_OUTPUT_SIGMA, _CHAT_OUTPUT_MAX = 140.0, 0.9, 1024


@dataclass
class ChatProfile(_Base):
    name: str = "chat"
    length_pairs: list[tuple[int, int]] | None = None  # (prompt, output) pairs from a dataset

    def _lengths(self) -> tuple[int, int]:
        if self.length_pairs:
            return self.rng.choice(self.length_pairs)
        prompt = self.rng.lognormvariate(math.log(_CHAT_PROMPT_MEDIAN), _CHAT_PROMPT_SIGMA)
        output = self.rng.lognormvariate(math.log(_CHAT_OUTPUT_MEDIAN), _CHAT_OUTPUT_SIGMA)
        return min(max(round(prompt), 4), _CHAT_PROMPT_MAX), min(max(round(output), 4), _CHAT_OUTPUT_MAX)

    def next(self, index: int) -> WorkloadRequest:
        prompt, output = self._lengths()
        max_tokens = min(self.limits.output(output), self.limits.max_context // 2)
        return self.request(index, self.tokens.sample(self.text_rng, self.limits.prompt(prompt)), max_tokens)


def load_sharegpt_lengths(
    path: str | Path, tokens: TokenSource, max_pairs: int = 2000, seed: int = 0
) -> list[tuple[int, int]]:
    """(prompt, reply) token lengths of the first human/gpt exchange of up to max_pairs conversations."""
    conversations = json.loads(Path(path).read_text())
    random.Random(seed).shuffle(conversations)
    pairs: list[tuple[int, int]] = []
    for entry in conversations:
        turns = entry.get("conversations") or []
        if len(turns) >= 2 and turns[0].get("from") == "human" and turns[1].get("from") == "gpt":
            prompt, reply = tokens.count(turns[0]["value"]), tokens.count(turns[1]["value"])
            if prompt >= 4 and reply >= 4:
                pairs.append((prompt, reply))
        if len(pairs) >= max_pairs:
            break
    if not pairs:
        raise ValueError(f"no human/gpt exchanges in {path}: expected ShareGPT's JSON format")
    return pairs


_PROFILE_TYPES: dict[str, type[_Base]] = {
    "voice": VoiceProfile,
    "code": CodeProfile,
    "analytics": AnalyticsProfile,
    "chat": ChatProfile,
    "longchat": LongChatProfile,
}


def parse_range(value: tuple[int, int] | str, what: str) -> tuple[int, int]:
    """(low, high) or "LOW-HIGH" → (low, high) with 1 <= low <= high."""
    if isinstance(value, str):
        low_text, _, high_text = value.partition("-")
        if not low_text.strip().isdigit() or not high_text.strip().isdigit():
            raise ValueError(f"{what} wants LOW-HIGH (token counts), got {value!r}")
        value = (int(low_text), int(high_text))
    low, high = value
    if not 1 <= low <= high:
        raise ValueError(f"{what} wants 1 <= LOW <= HIGH, got {low}-{high}")
    return low, high


def parse_weights(spec: str) -> dict[str, float]:
    """`voice=0.4,code=0.3` → {"voice": 0.4, "code": 0.3}; names must be profiles, weights >= 0."""
    weights: dict[str, float] = {}
    for part in spec.split(","):
        name, _, value = part.partition("=")
        name = name.strip()
        if name not in _PROFILE_TYPES:
            raise ValueError(f"unknown profile {name!r} in weights {spec!r}: expected {sorted(_PROFILE_TYPES)}")
        weights[name] = float(value)
        if weights[name] < 0:
            raise ValueError(f"weight of {name} must be >= 0, got {weights[name]}")
    if sum(weights.values()) <= 0:
        raise ValueError(f"weights {spec!r} sum to zero")
    return weights


def parse_api_keys(spec: str) -> dict[str, str]:
    """`voice=KEY1,code=KEY2` → {"voice": "KEY1", ...}: the key each traffic class sends, so a mixed
    workload's classes map onto a server's tenants. Names must be profiles (or `trace`); a key is
    never echoed in an error."""
    keys: dict[str, str] = {}
    for part in spec.split(","):
        name, _, key = part.partition("=")
        name = name.strip()
        if name not in (*_PROFILE_TYPES, "trace"):
            raise ValueError(f"unknown profile {name!r} in --api-keys: expected {sorted([*_PROFILE_TYPES, 'trace'])}")
        if not key.strip():
            raise ValueError(f"--api-keys: profile {name!r} has an empty key (expected {name}=KEY)")
        keys[name] = key.strip()
    return keys


def build_workload(
    profile: str,
    num_requests: int,
    tokens: TokenSource,
    limits: LengthLimits,
    seed: int = 0,
    weights: dict[str, float] | None = None,
    chat_lengths: list[tuple[int, int]] | None = None,
    salt: int = 0,
    document_tokens: tuple[int, int] | None = None,
    voice_output_tokens: tuple[int, int] | None = None,
    sessions: int | None = None,
) -> list[WorkloadRequest]:
    """`num_requests` requests of one profile, or of `mixed` with `weights` (arrival times unset).

    Another `salt` gives the same lengths, sessions and sharing structure with other tokens: the
    steps of a sweep use it so that one step's prompts are not in the prefix cache of the next.
    `document_tokens` replaces the analytics documents' length range (a tenant sending long ones);
    `voice_output_tokens` the voice turns' output range (long spoken answers); `sessions` how many
    conversations the session profiles (voice, longchat) keep open at once (default 4): each turn
    waits for its conversation's previous one, so few sessions cap the rate a run can offer, and
    many make each conversation shorter within the run.
    """
    if sessions is not None and sessions < 1:
        raise ValueError(f"sessions must be >= 1, got {sessions}")
    if profile == "mixed":
        weights = {k: v for k, v in (weights or {}).items() if v > 0}
        if not weights:
            raise ValueError("the mixed profile needs weights, e.g. voice=0.4,code=0.3,analytics=0.2,chat=0.1")
    elif profile in _PROFILE_TYPES:
        weights = {profile: 1.0}
    else:
        raise ValueError(f"unknown profile {profile!r}: expected one of {[*PROFILES, 'mixed']}")
    generators: dict[str, _Base] = {}
    for name in weights:
        generator = _PROFILE_TYPES[name](tokens=tokens, limits=limits, seed=seed, salt=salt)
        if isinstance(generator, ChatProfile):
            generator.length_pairs = chat_lengths
        if isinstance(generator, AnalyticsProfile) and document_tokens is not None:
            generator.document_tokens = parse_range(document_tokens, "document_tokens")
        if name == "voice" and isinstance(generator, VoiceProfile) and voice_output_tokens is not None:
            generator.output = parse_range(voice_output_tokens, "voice_output_tokens")
        if isinstance(generator, VoiceProfile) and sessions is not None:
            generator.max_active = sessions
        generators[name] = generator
    mix = random.Random(f"{seed}:mix")
    names, values = list(weights), list(weights.values())
    return [generators[mix.choices(names, values)[0]].next(index) for index in range(num_requests)]
