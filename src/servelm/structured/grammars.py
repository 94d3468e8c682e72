"""Backend-neutral grammar handling: what a backend offers, and compiling off the step loop.

A request with a StructuredSpec waits in the queue until its grammar is compiled (in a worker
thread): it never holds up a step, and other requests run meanwhile. Compiled grammars are
cached by spec, so a repeated schema costs nothing; each request gets its own matcher from one.
No torch here: the scheduler imports this (masks.py holds the tensors).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from servelm.sampling_params import StructuredSpec

GRAMMAR_CACHE_SIZE = 512  # compiled grammars kept (least recently used go first)


class GrammarError(ValueError):
    """A spec that cannot be compiled or enforced; the message says why (for a 400)."""


class GrammarMatcher(Protocol):
    """One request's position in its grammar."""

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False if the grammar refuses it."""

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        """Write the allowed next tokens into row `row` of an int32 [rows, ceil(vocab/32)] CPU tensor."""

    def is_terminated(self) -> bool:
        """The grammar is complete and allows nothing more: the request is done."""

    def num_acceptable(self, token_ids: list[int]) -> int:
        """How many of `token_ids`, in order, the grammar would accept from here (it does not advance):
        speculative drafts are cut at the first it refuses."""

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (the masks of draft positions are filled ahead)."""


@dataclass(frozen=True)
class SamplingGrammar:
    """A constrained request that samples in a step: its matcher and the drafts it verifies."""

    request_id: str
    matcher: GrammarMatcher
    drafts: list[int]


class CompiledGrammar(Protocol):
    def matcher(self) -> GrammarMatcher: ...


class GrammarBackend(Protocol):
    name: str

    def compile(self, spec: StructuredSpec) -> CompiledGrammar:
        """Raises GrammarError for a spec it cannot compile or enforce."""


class GrammarCompiler:
    """Compiles specs on one worker thread, cached by spec. `submit` never blocks.

    The backend is built by the first compile, on that thread: its vocabulary tables take about
    half a second to build, which an engine that never sees a structured request should not pay
    at start-up (the first such request does, once)."""

    def __init__(self, make_backend: Callable[[], GrammarBackend], cache_size: int = GRAMMAR_CACHE_SIZE) -> None:
        self._make_backend = make_backend
        self._backend: GrammarBackend | None = None
        self._cache: OrderedDict[StructuredSpec, Future[CompiledGrammar]] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        self._compile_started: dict[StructuredSpec, float] = {}  # monotonic start of a spec's own compile
        self.num_compiled = 0  # distinct specs compiled (cache misses)
        self.compile_seconds = 0.0  # their compiles' time, summed (written by the compile thread)

    def submit(self, spec: StructuredSpec) -> Future[CompiledGrammar]:
        with self._lock:
            future = self._cache.get(spec)
            if future is not None:
                self._cache.move_to_end(spec)
                return future
            future = self._executor.submit(self._compile, spec)
            self.num_compiled += 1
            self._cache[spec] = future
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            return future

    def _backend_built(self) -> GrammarBackend:
        if self._backend is None:  # only the compile thread touches it
            self._backend = self._make_backend()
        return self._backend

    def compiling_for_s(self, spec: StructuredSpec) -> float | None:
        """How long `spec`'s own compile has run; None while it waits its turn or for the backend
        to be built (neither is the spec's cost), and once it is over."""
        started = self._compile_started.get(spec)
        return None if started is None else time.monotonic() - started

    def _compile(self, spec: StructuredSpec) -> CompiledGrammar:
        backend = self._backend_built()
        started = time.perf_counter()
        self._compile_started[spec] = time.monotonic()
        try:
            return backend.compile(spec)
        finally:
            self._compile_started.pop(spec, None)
            self.compile_seconds += time.perf_counter() - started

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
