"""Structured-output requests in the scheduler: the wait for a grammar, and who samples under one.

A request that asks for structured output is queued at once, but its grammar compiles on the
compiler's thread, off the step loop: the request is not admitted before its matcher exists, and
others are scheduled meanwhile (a first-seen schema must never stall the batch). Each `schedule()`
collects the compiles that ended: a matcher for each, or the compile's error for the request.

A continuation of a migrated stream (router/continuation.py) carries the output its first replica
sent as the end of its prompt, with `structured_resume_tokens` saying how many tokens that is: its
matcher consumes them first, so the constraint goes on from where the stream was cut instead of
starting over. A token the grammar refuses there fails the request (the client sent output the
constraint never allowed).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass

from servelm.datatypes import EventType, SchedulerOutput
from servelm.scheduler.request import Request
from servelm.structured.grammars import CompiledGrammar, GrammarCompiler, GrammarMatcher, SamplingGrammar


@dataclass
class GrammarFailure:
    request: Request
    error: str  # the compile's message, for the request's error output


class GrammarWaits:
    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self._compiling: list[Request] = []
        self.num_structured_requests = 0  # cumulative: requests that asked for structured outputs

    def __bool__(self) -> bool:
        return bool(self._compiling)

    def submit(self, request: Request) -> None:
        """Start compiling the request's grammar (a cache hit is done at once)."""
        assert request.sampling_params.structured is not None
        request.grammar_compile = self.compiler.submit(request.sampling_params.structured)
        self.num_structured_requests += 1
        self._compiling.append(request)

    def collect(self, now: float, is_live: Callable[[str], bool]) -> list[GrammarFailure]:
        """Give each request whose compile ended its matcher (it may be admitted from now on);
        return those whose compile failed (the API checks specs first: this is the backstop).
        `is_live` says whether a request id is still unfinished: aborted ones are dropped."""
        compiling, failed = [], []
        for request in self._compiling:
            future = request.grammar_compile
            if not is_live(request.request_id) or future is None:
                continue
            if not future.done():
                compiling.append(request)
                continue
            request.grammar_compile = None
            error = future.exception()
            if error is not None:
                failed.append(GrammarFailure(request, f"structured output: {error}"))
                continue
            matcher = future.result().matcher()
            refused = _resume(matcher, request)
            if refused is not None:
                failed.append(GrammarFailure(request, refused))
                continue
            request.grammar = matcher
            request.record(EventType.GRAMMAR_READY, now)
        self._compiling = compiling
        return failed

    def compiles(self) -> list[Future[CompiledGrammar]]:
        """The compiles requests wait for (an idle engine waits on them instead of spinning)."""
        return [r.grammar_compile for r in self._compiling if r.grammar_compile is not None]


def _resume(matcher: GrammarMatcher, request: Request) -> str | None:
    """Feed the matcher the output the request resumes after; the error when it refuses a token."""
    num_resumed = request.sampling_params.structured_resume_tokens
    if num_resumed == 0:
        return None
    resumed = request.prompt_token_ids[-num_resumed:]
    for position, token_id in enumerate(resumed):
        if not matcher.accept(token_id):
            return (f"structured output: the resumed output's token {position} (id {token_id}) does not match "
                    "the constraint")  # fmt: skip
    return None


def sampling_grammars(requests: Mapping[str, Request], scheduler_output: SchedulerOutput) -> list[SamplingGrammar]:
    """The constrained requests that sample in this step (their scheduled tokens reach the end of
    what they hold), with the drafts they verify: their masks are filled while the step runs."""
    matchers = []
    drafts = scheduler_output.scheduled_draft_token_ids
    for request_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
        request = requests.get(request_id)
        if request is not None and request.grammar is not None:
            if request.num_computed_tokens + num_tokens >= request.num_tokens:
                matchers.append(SamplingGrammar(request_id, request.grammar, list(drafts.get(request_id, []))))
    return matchers
