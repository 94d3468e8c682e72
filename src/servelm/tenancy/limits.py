"""Per-tenant limits in the API process: requests in flight and tokens per minute.

    HTTP request ──enter(tenant)──▶ Lease          429 if the tenant has max_concurrent_requests in flight
    tokenized    ──lease.reserve(prompt, max new)  429 if the bucket lacks them; 400 if they exceed the whole bucket
    stream ends  ──lease.release()                 the slot frees; unused max-new tokens go back to the bucket

Tokens per minute is a token bucket, not a sliding window: it holds at most tokens_per_minute
and refills at tokens_per_minute / 60 per second, so a tenant may burst a minute's worth and
then sustains its rate. A request takes prompt tokens + max_tokens (per choice) at admission,
as OpenAI estimates, and gives back what it did not generate when it ends (never above the
bucket's size). Retry-After is when the bucket will hold what the request needs; for the
concurrency limit it is 1 s (when a running request ends is unknown).

One event loop calls everything here (the API process's): no locks. Tenants never share a
limiter, so one tenant at its limit leaves the others untouched.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from servelm.tenancy.config import Tenant

CONCURRENCY_RETRY_AFTER_S = 1


class LimitExceeded(Exception):
    """A tenant's limit refused a request. `retry_after_s` None: it can never fit (a 400, not a 429)."""

    def __init__(self, message: str, limit: str, retry_after_s: int | None) -> None:
        super().__init__(message)
        self.message = message
        self.limit = limit  # the tenants-file field that refused: max_concurrent_requests | tokens_per_minute
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


@dataclass
class _TenantState:
    tenant: Tenant
    bucket: TokenBucket | None
    num_in_flight: int = 0


@dataclass
class Lease:
    """One HTTP request's hold on its tenant's limits, from `TenantLimits.enter` to `release`."""

    _state: _TenantState
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
        if self._state.bucket is not None and self._reserved:
            used = self._generated() if self._generated is not None else 0
            self._state.bucket.give_back(max(self._reserved - used, 0))


class TenantLimits:
    def __init__(self, tenants: Sequence[Tenant], clock: Callable[[], float] = time.monotonic) -> None:
        self._states = {
            t.name: _TenantState(t, TokenBucket(t.tokens_per_minute, clock) if t.tokens_per_minute else None)
            for t in tenants
        }

    def num_in_flight(self, tenant: Tenant) -> int:
        return self._states[tenant.name].num_in_flight

    def enter(self, tenant: Tenant) -> Lease:
        """A slot for one request of `tenant`, or LimitExceeded at its max_concurrent_requests.
        The caller must `release()` the lease on every path (finish, disconnect, error)."""
        state = self._states[tenant.name]
        limit = tenant.max_concurrent_requests
        if limit is not None and state.num_in_flight >= limit:
            raise LimitExceeded(f"Tenant {tenant.name!r} has {state.num_in_flight} requests in flight, its limit "
                                f"(max_concurrent_requests). Retry after {CONCURRENCY_RETRY_AFTER_S} s.",
                                "max_concurrent_requests", CONCURRENCY_RETRY_AFTER_S)  # fmt: skip
        state.num_in_flight += 1
        return Lease(state)
