"""Limits on who may send how much, in the API process: requests in flight (in all, per client
address, per tenant) and tokens per minute (per tenant).

    HTTP request ──enter(tenant, client)──▶ Lease  429 if the process (--max-concurrent-requests), the
                                                   client address (--max-concurrent-requests-per-client)
                                                   or the tenant (max_concurrent_requests) is at its limit
    tokenized    ──lease.reserve(prompt, max new)  429 if the bucket lacks them; 400 if they exceed the whole bucket
    stream ends  ──lease.release()                 the slot frees; unused max-new tokens go back to the bucket

"In flight" is an HTTP request from the moment it is let in until its response's last byte is
sent or its client is gone, whatever it is doing meanwhile (waiting, running, streaming out):
what holds a connection, a stream's buffers and, for most of it, KV blocks. HTTP/1.1 serializes
requests on a connection, so a per-connection limit is a per-client one: clients are counted by
address (one client may open many connections); behind a proxy that address is the proxy's
unless it sends X-Forwarded-For and the server trusts it (uvicorn's $FORWARDED_ALLOW_IPS).

Tokens per minute is a token bucket, not a sliding window: it holds at most tokens_per_minute
and refills at tokens_per_minute / 60 per second, so a tenant may burst a minute's worth and
then sustains its rate. A request takes prompt tokens + max_tokens (per choice) at admission,
as OpenAI estimates, and gives back what it did not generate when it ends (never above the
bucket's size). Retry-After is when the bucket will hold what the request needs; for the
concurrency limit it is 1 s (when a running request ends is unknown).

One event loop calls everything here (the API process's, or the router's): no locks. Tenants
share only the process's in-flight limits, so one tenant at its own limit leaves the others untouched.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from servelm.tenancy.config import Tenant

CONCURRENCY_RETRY_AFTER_S = 1


class LimitExceeded(Exception):
    """A limit refused a request. `retry_after_s` None: it can never fit (a 400, not a 429)."""

    def __init__(self, message: str, limit: str, retry_after_s: int | None) -> None:
        super().__init__(message)
        self.message = message
        # What refused: a tenants-file field (max_concurrent_requests | tokens_per_minute), or the
        # process's flag (--max-concurrent-requests | --max-concurrent-requests-per-client).
        self.limit = limit
        self.retry_after_s = retry_after_s


@dataclass
class TokenBucket:
    capacity: int  # tokens_per_minute
    clock: Callable[[], float]
    level: float = field(init=False)
    updated: float = field(init=False)

    def __post_init__(self) -> None:
        self.level, self.updated = float(self.capacity), self.clock()

    @property
    def rate(self) -> float:  # tokens per second
        return self.capacity / 60.0

    def _refill(self) -> None:
        now = self.clock()
        self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
        self.updated = now

    def take(self, num_tokens: int) -> float:
        """Take `num_tokens` and return 0, or take nothing and return the seconds until they are there."""
        self._refill()
        if num_tokens <= self.level:
            self.level -= num_tokens
            return 0.0
        return (num_tokens - self.level) / self.rate

    def give_back(self, num_tokens: int) -> None:
        self._refill()
        self.level = min(self.capacity, self.level + num_tokens)


@dataclass(eq=False)
class InFlightSlot:
    """One request's place in InFlightLimits; `release()` is idempotent."""

    _limits: InFlightLimits
    _client: str
    _released: bool = False

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self._limits.leave(self._client)


@dataclass
class InFlightLimits:
    """Requests in flight in this process: at most `max_total` in all and `max_per_client` per
    client address (None: no limit). Holds an entry only per client with requests in flight."""

    max_total: int | None = None
    max_per_client: int | None = None
    num_total: int = 0
    _per_client: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("max_total", "max_per_client"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1 (or None: no limit), got {value}")

    def num_in_flight(self, client: str) -> int:
        return self._per_client.get(client, 0)

    def enter(self, client: str) -> InFlightSlot:
        """A slot for one request from `client`, or LimitExceeded (429, Retry-After 1 s)."""
        if self.max_total is not None and self.num_total >= self.max_total:
            raise LimitExceeded(f"The server has {self.num_total} requests in flight, its limit "
                                f"(--max-concurrent-requests). Retry after {CONCURRENCY_RETRY_AFTER_S} s.",
                                "--max-concurrent-requests", CONCURRENCY_RETRY_AFTER_S)  # fmt: skip
        mine = self._per_client.get(client, 0)
        if self.max_per_client is not None and mine >= self.max_per_client:
            raise LimitExceeded(f"This client ({client}) has {mine} requests in flight, the limit per client "
                                f"(--max-concurrent-requests-per-client). Retry after {CONCURRENCY_RETRY_AFTER_S} s.",
                                "--max-concurrent-requests-per-client", CONCURRENCY_RETRY_AFTER_S)  # fmt: skip
        self.num_total += 1
        self._per_client[client] = mine + 1
        return InFlightSlot(self, client)

    def leave(self, client: str) -> None:
        """Called by InFlightSlot.release, once per enter."""
        self.num_total -= 1
        left = self._per_client[client] - 1
        if left:
            self._per_client[client] = left
        else:
            del self._per_client[client]  # the map stays as small as the set of clients in flight


@dataclass
class _TenantState:
    tenant: Tenant
    bucket: TokenBucket | None
    num_in_flight: int = 0


@dataclass
class Lease:
    """One HTTP request's hold on its tenant's limits, from `TenantLimits.enter` to `release`."""

    _state: _TenantState
    _slot: InFlightSlot | None = None  # the request's place in the process's InFlightLimits
    _reserved: int = 0  # max-new tokens taken from the bucket that the request may not use
    _generated: Callable[[], int] | None = None
    _released: bool = False

    @property
    def tenant(self) -> Tenant:
        return self._state.tenant

    def reserve(self, num_prompt_tokens: int, num_max_new_tokens: int) -> None:
        """Take prompt + max-new tokens from the tenant's bucket, or raise LimitExceeded. Call once."""
        bucket = self._state.bucket
        if bucket is None:
            return
        needed = num_prompt_tokens + num_max_new_tokens
        name = self.tenant.name
        if needed > bucket.capacity:
            raise LimitExceeded(f"This request needs {needed} tokens (prompt + max_tokens) but tenant {name!r} may use "
                                f"{bucket.capacity} per minute (tokens_per_minute): lower max_tokens or split it.",
                                "tokens_per_minute", None)  # fmt: skip
        wait_s = bucket.take(needed)
        if wait_s > 0:
            retry = max(1, math.ceil(wait_s))
            raise LimitExceeded(f"Tenant {name!r} is at its limit of {bucket.capacity} tokens per minute "
                                f"(tokens_per_minute): this request needs {needed}. Retry after {retry} s.",
                                "tokens_per_minute", retry)  # fmt: skip
        self._reserved = num_max_new_tokens

    def count_generated(self, generated: Callable[[], int]) -> None:
        """How to learn, at release, how many of the reserved max-new tokens were generated."""
        self._generated = generated

    def release(self) -> None:
        """Free the request's slot and give back what it did not generate; idempotent."""
        if self._released:
            return
        self._released = True
        self._state.num_in_flight -= 1
        if self._slot is not None:
            self._slot.release()
        if self._state.bucket is not None and self._reserved:
            used = self._generated() if self._generated is not None else 0
            self._state.bucket.give_back(max(self._reserved - used, 0))


class TenantLimits:
    def __init__(
        self, tenants: Sequence[Tenant], clock: Callable[[], float] = time.monotonic,
        in_flight: InFlightLimits | None = None,
    ) -> None:  # fmt: skip
        self.in_flight = in_flight if in_flight is not None else InFlightLimits()
        self._states = {
            t.name: _TenantState(t, TokenBucket(t.tokens_per_minute, clock) if t.tokens_per_minute else None)
            for t in tenants
        }

    def num_in_flight(self, tenant: Tenant) -> int:
        return self._states[tenant.name].num_in_flight

    def enter(self, tenant: Tenant, client: str = "") -> Lease:
        """A slot for one request of `tenant` from `client` (its address), or LimitExceeded at the
        process's, the client's or the tenant's limit of requests in flight (checked in that
        order). The caller must `release()` the lease on every path (finish, disconnect, error)."""
        state = self._states[tenant.name]
        limit = tenant.max_concurrent_requests
        slot = self.in_flight.enter(client)
        if limit is not None and state.num_in_flight >= limit:
            slot.release()
            raise LimitExceeded(f"Tenant {tenant.name!r} has {state.num_in_flight} requests in flight, its limit "
                                f"(max_concurrent_requests). Retry after {CONCURRENCY_RETRY_AFTER_S} s.",
                                "max_concurrent_requests", CONCURRENCY_RETRY_AFTER_S)  # fmt: skip
        state.num_in_flight += 1
        return Lease(state, slot)
