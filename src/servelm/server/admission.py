"""A bounded waiting queue: beyond `max_waiting` requests not yet running, answer 429 at once.

Waiting means everything admitted and not yet computing:

    waiting = requests being tokenized (API thread pool)
            + engine requests in flight − those the core reports running

`num_running` comes from the core's latest stats (one step old at most), so right after a
burst the estimate errs high: it rejects early rather than letting a pile-up form, which
is the property that matters. While the server drains for shutdown, or after the engine
died, every new request gets 503 instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from servelm.server.errors import overloaded, unavailable


@dataclass
class Admission:
    max_waiting: int
    num_tokenizing: Callable[[], int]
    num_engine_in_flight: Callable[[], int]
    num_running: Callable[[], int]
    engine_error: Callable[[], str | None]
    draining: bool = False
    retry_after_s: int = 1

    def num_waiting(self) -> int:
        return self.num_tokenizing() + max(0, self.num_engine_in_flight() - self.num_running())

    def admit(self, num_engine_requests: int) -> None:
        """Raise the 503/429 APIError when the request may not enter; return when it may."""
        if self.draining:
            raise unavailable("The server is shutting down and takes no new requests.")
        error = self.engine_error()
        if error is not None:
            raise unavailable(f"The engine is not running: {error}", retry_after_s=30)
        waiting = self.num_waiting()
        if waiting + num_engine_requests > self.max_waiting:
            raise overloaded(self.retry_after_s, waiting, self.max_waiting)
