"""An answer decided once per process (until reset), thread-safe: whether a kernel is usable here."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class DecidedOnce(Generic[T]):
    """`get()` calls `decide` on its first call and returns that answer from then on; `reset()`
    forgets it, so the next `get()` decides again (tests, tools that change the environment)."""

    def __init__(self, decide: Callable[[], T]) -> None:
        self._decide = decide
        self._lock = threading.Lock()
        self._answer: list[T] = []  # empty: not decided yet; else the one answer

    def get(self) -> T:
        if not self._answer:
            with self._lock:
                if not self._answer:
                    self._answer.append(self._decide())
        return self._answer[0]

    def reset(self) -> None:
        with self._lock:
            self._answer.clear()
