"""Replays a workload against a server: open loop at the requests' arrival times, or closed loop.

    open loop    one task per request sleeps until its arrival time, then sends; a session's next
                 turn also waits for the previous turn to finish (a user answers what they heard),
                 and resends the reply that turn actually got (workload.NextTurn)
    closed loop  `concurrency` workers, each sending the next request as soon as its last one ended

Every run is bounded: by the workload's length (the request count) and by `duration_s` of wall
clock. At the limit, or on Ctrl-C, nothing more is sent and requests in flight are cancelled
and recorded as `cancelled` with whatever they had received, so a report can always be written.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

import httpx
from tqdm import tqdm

from servelm.bench.client import ClientConfig, RequestRecord, send_request
from servelm.bench.slow_reader import slow_reader_transport
from servelm.bench.tokens import TokenSource
from servelm.bench.workload import WorkloadRequest


@dataclass(frozen=True)
class RunLimits:
    duration_s: float  # wall-clock limit of the whole run
    concurrency: int | None = None  # closed loop at this concurrency; None: open loop (arrival times)
    max_connections: int = 1024  # HTTP connection pool: more than the requests ever in flight at once
    progress: bool = True

    def __post_init__(self) -> None:
        if self.duration_s <= 0:
            raise ValueError(f"duration_s must be > 0, got {self.duration_s}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")


@dataclass
class RunResult:
    records: list[RequestRecord]  # every request that was sent, in workload order
    started_unix: float
    duration_s: float  # run start → last request ended (or the stop)
    num_not_sent: int  # workload requests never sent (limit reached or interrupted first)
    interrupted: bool = False  # Ctrl-C
    hit_time_limit: bool = False


@dataclass
class _Run:
    requests: list[WorkloadRequest]
    client: ClientConfig
    limits: RunLimits
    tokens: TokenSource | None
    t0: float = field(default_factory=time.perf_counter)
    records: dict[int, RequestRecord] = field(default_factory=dict)
    finished: dict[int, asyncio.Event] = field(default_factory=dict)
    interrupted: bool = False
    progress: tqdm | None = None
    slow_http: httpx.AsyncClient | None = None  # for requests marked slow_reader (bench.slow_reader)
    sent: dict[int, WorkloadRequest] = field(default_factory=dict)  # a continued turn's previous turn, as sent
    replies: dict[int, str] = field(default_factory=dict)  # ... and the text it got back
    continued: set[int] = field(default_factory=set)  # requests that a later turn continues

    def __post_init__(self) -> None:
        self.finished = {r.index: asyncio.Event() for r in self.requests}
        self.continued = {r.after for r in self.requests if r.turn is not None and r.after is not None}

    def as_sent(self, request: WorkloadRequest) -> WorkloadRequest:
        """`request` with its history as the server really saw it: the previous turn as sent, the
        reply it actually got, then this turn (NextTurn). Unchanged when it continues nothing."""
        turn, previous = request.turn, self.sent.get(request.after) if request.after is not None else None
        if turn is None or previous is None:
            return request
        reply = self.replies.get(previous.index, "")
        if previous.messages is not None:
            messages = turn.messages(previous.messages, reply)
            return replace(request, messages=messages, prompt_text="".join(m["content"] for m in messages))
        history = turn.history(previous.prompt_text, reply)
        if self.tokens is None:
            return replace(request, prompt_text=history + turn.text)
        # Counted as the server will count them: a reply's text need not re-tokenize into its tokens.
        return replace(request, prompt_text=history + turn.text, shared_prefix_tokens=self.tokens.count(history),
                       num_prompt_tokens=self.tokens.count(history + turn.text) + self.tokens.num_special_tokens)  # fmt: skip

    def clock(self) -> float:
        return time.perf_counter() - self.t0

    async def one(self, http: httpx.AsyncClient, request: WorkloadRequest, due_s: float) -> None:
        try:
            if request.after is not None and request.after in self.finished:
                await self.finished[request.after].wait()
            delay = due_s - self.clock()
            if delay > 0:
                await asyncio.sleep(delay)
            request = self.as_sent(request)
            record = RequestRecord(
                index=request.index, traffic_class=request.traffic_class, priority=request.priority,
                session_id=request.session_id, max_tokens=request.max_tokens,
                expected_prompt_tokens=request.num_prompt_tokens, shared_prefix_tokens=request.shared_prefix_tokens,
                scheduled_s=max(due_s, self.clock()),
            )  # fmt: skip
            self.records[request.index] = record
            record.slow_reader = request.slow_reader and self.slow_http is not None
            via = self.slow_http if record.slow_reader and self.slow_http is not None else http
            keep_text = request.index in self.continued
            await send_request(via, self.client, request, record, self.clock, self.tokens, keep_text=keep_text)
            if keep_text:
                self.sent[request.index], self.replies[request.index] = request, record.output_text or ""
                if not self.client.keep_output_text:
                    record.output_text = None
        except asyncio.CancelledError:
            started = self.records.get(request.index)  # None: cancelled before it was sent
            if started is not None and started.status == "pending":
                started.status, started.error, started.end_s = (
                    "cancelled",
                    "cut by the wall-clock limit or Ctrl-C",
                    self.clock(),
                )
            raise
        finally:
            self.finished[request.index].set()
            if request.index in self.records and self.progress is not None:
                self.progress.update(1)
                failed = sum(1 for r in self.records.values() if r.status == "error")
                self.progress.set_postfix(in_flight=sum(1 for r in self.records.values() if r.status == "pending"),
                                          errors=failed, refresh=False)  # fmt: skip

    async def worker(self, http: httpx.AsyncClient, queue: Iterator[WorkloadRequest]) -> None:
        for request in queue:  # a shared iterator: each request goes to exactly one worker
            await self.one(http, request, self.clock())

    def tasks(self, http: httpx.AsyncClient) -> list[asyncio.Task]:
        if self.limits.concurrency is not None:
            shared = iter(self.requests)
            return [asyncio.create_task(self.worker(http, shared)) for _ in range(self.limits.concurrency)]
        return [asyncio.create_task(self.one(http, r, r.arrival_s or 0.0)) for r in self.requests]


async def run_workload(
    requests: list[WorkloadRequest],
    client: ClientConfig,
    limits: RunLimits,
    tokens: TokenSource | None = None,
    after_warm_up: Callable[[], None] | None = None,
) -> RunResult:
    """Send the workload (see module doc); returns every sent request's record. `after_warm_up`
    runs once the warm-up request is done and before the clock starts (e.g. to snapshot the
    server's counters, so they count the workload alone)."""
    if not requests:
        raise ValueError("the workload is empty")
    if limits.concurrency is None and any(r.arrival_s is None for r in requests):
        raise ValueError("open-loop requests need arrival times (or give a concurrency)")
    headers = {"Authorization": f"Bearer {client.api_key}"} if client.api_key else {}
    pool = httpx.Limits(max_connections=limits.max_connections, max_keepalive_connections=limits.max_connections)
    timeout = httpx.Timeout(client.request_timeout_s, connect=30.0, pool=None)
    run = _Run(requests, client, limits, tokens)
    started_unix = time.time()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def interrupt() -> None:
        run.interrupted = True
        stop.set()

    with _sigint(loop, interrupt), tqdm(total=len(requests), unit="req", file=sys.stderr, disable=not limits.progress,
                                         dynamic_ncols=True) as progress:  # fmt: skip
        run.progress = progress
        async with contextlib.AsyncExitStack() as stack:
            http = await stack.enter_async_context(
                httpx.AsyncClient(base_url=client.base_url, headers=headers, limits=pool, timeout=timeout)
            )
            if client.slow_reading is not None and any(r.slow_reader for r in requests):
                transport = slow_reader_transport(client.slow_reading, pool)
                run.slow_http = await stack.enter_async_context(
                    httpx.AsyncClient(base_url=client.base_url, headers=headers, transport=transport, timeout=timeout)
                )
            await warm_up(http, client, tokens)
            if after_warm_up is not None:
                after_warm_up()
            run.t0 = time.perf_counter()
            tasks = run.tasks(http)
            everything = asyncio.create_task(asyncio.wait(tasks))  # never raises: failures surface below
            stopped = asyncio.create_task(stop.wait())
            done, _ = await asyncio.wait(
                {everything, stopped}, timeout=limits.duration_s, return_when=asyncio.FIRST_COMPLETED
            )
            hit_limit = not done
            stopped.cancel()
            everything.cancel()
            for task in tasks:  # at the limit or on Ctrl-C; also the rest when one task failed
                task.cancel()
            outcomes = await asyncio.gather(*tasks, return_exceptions=True)
            failure = next((o for o in outcomes if isinstance(o, Exception)), None)
            if failure is not None:  # a bug here, not a failed request (those are records)
                raise failure
    records = [run.records[r.index] for r in requests if r.index in run.records]
    ends = [r.end_s for r in records if r.end_s is not None]
    return RunResult(
        records=records,
        started_unix=started_unix,
        duration_s=max(ends, default=run.clock()),
        num_not_sent=len(requests) - len(records),
        interrupted=run.interrupted,
        hit_time_limit=hit_limit and not run.interrupted,
    )


async def warm_up(http: httpx.AsyncClient, client: ClientConfig, tokens: TokenSource | None) -> None:
    """One streamed 1-token request through the same code path, before the clock starts (as
    vLLM's benchmark sends a test prompt): first-use costs — a connection, lazy imports and,
    in a fresh environment, their bytecode compilation, measured at ~0.3 s — must not land in
    the first requests' send times or TTFTs. Its outcome is not a measurement and is dropped."""
    probe = WorkloadRequest(index=-1, traffic_class="warm-up", prompt_ids=[], num_prompt_tokens=0, max_tokens=1,
                            prompt_text="Hello")  # fmt: skip
    record = RequestRecord(index=-1, traffic_class="warm-up", priority=0, session_id=None, max_tokens=1,
                           expected_prompt_tokens=0, shared_prefix_tokens=0, scheduled_s=0.0)  # fmt: skip
    with contextlib.suppress(httpx.HTTPError):
        await send_request(http, client, probe, record, time.perf_counter, tokens)


@contextlib.contextmanager
def _sigint(loop: asyncio.AbstractEventLoop, handler: Callable[[], object]) -> Iterator[None]:
    """Ctrl-C stops the run (and keeps what was measured) instead of killing it; one run at a time."""
    try:
        loop.add_signal_handler(signal.SIGINT, handler)
        installed = True
    except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no signals here
        installed = False
    try:
        yield
    finally:
        if installed:
            loop.remove_signal_handler(signal.SIGINT)
