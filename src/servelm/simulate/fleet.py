"""A fleet of simulated replicas behind the real routing policy, driven by a bench workload in virtual time.

Events, earliest first (ties in the order they were scheduled):

    send       a request is due (its arrival time; a session's next turn once the turn before it
               ended; a closed-loop slot that freed): the router's policy picks a replica, exactly
               as the router does (router.policies over router.replicas.Replica records, whose
               in-flight counts this fleet keeps as the proxy does)
    admit      request_overhead_s later the replica's scheduler has it; an idle replica starts a step
    step_end   the replica's step is over: its outputs become the records' token times (one
               stream chunk per step, as servelm sends them), finished requests free their
               router slot and start what waited for them, the replica's KV events reach the
               `kv` policy's index, and the replica plans its next step at once

One replica is served without a router, as `servelm serve` alone is. What is measured is what
`servelm bench run` measures (bench.client.RequestRecord), so the same summary, report and plots
follow; times are virtual seconds after the run started.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from servelm.bench.client import RequestRecord
from servelm.bench.workload import WorkloadRequest
from servelm.datatypes import EngineOutput, EngineRequest, FinishReason
from servelm.kv.block_hash import hash_block_tokens
from servelm.router.policies import PolicyContext, RequestView, RoutingPolicy, make_policy
from servelm.router.prefix_index import PrefixIndex
from servelm.router.replicas import Replica, ReplicaSpec
from servelm.sampling_params import SamplingParams
from servelm.schemas.kv_events import KVEventBatch
from servelm.simulate.profile import CostProfile
from servelm.simulate.replica import SimReplica
from servelm.tenancy.config import Tenant
from servelm.tenancy.registry import TenantRegistry, request_slo

# A step with nothing to run while requests remain (all waiting for blocks that a finishing
# request frees): the real engine loop spins; the simulation looks again this much later.
IDLE_POLL_S = 0.001
# Prompt positions the server's tokenization adds beyond the workload's token ids (a BOS, a chat
# template's markers): stand-ins, the same for every request, so shared prefixes stay shared.
STAND_IN_TOKEN = 0


@dataclass(frozen=True)
class FleetConfig:
    num_replicas: int = 1
    policy: str = "round_robin"  # the router's --policy (more than one replica)
    duration_s: float = 3600.0  # virtual seconds: requests still in flight then are cancelled, as bench's limit does
    concurrency: int | None = None  # closed loop at this concurrency; None: the requests' arrival times
    # The replicas' --tenants: a request runs as the tenant its traffic class's key names (bench's
    # --api-keys; `default_key` for classes without one), at the priority and in the SLO class the
    # server would give it. None: no tenants file, the request's own priority.
    tenants: TenantRegistry | None = None
    class_keys: Mapping[str, str] = field(default_factory=dict)
    default_key: str | None = None

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError(f"a fleet needs at least one replica, got {self.num_replicas}")
        if self.duration_s <= 0:
            raise ValueError(f"duration_s must be > 0, got {self.duration_s}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")


@dataclass
class FleetResult:
    records: list[RequestRecord]  # every request sent, in workload order
    duration_s: float  # first send to the last request's end (or the limit)
    num_not_sent: int
    replica_busy_s: list[float]  # per replica: virtual seconds in steps
    num_steps: int
    num_prompt_tokens: int  # prompt tokens the replicas were asked for
    num_cached_tokens: int  # of those, served from their prefix caches
    peak_kv_usage: list[float] = field(default_factory=list)  # per replica: the fullest its pool was

    @property
    def prefix_hit_rate(self) -> float | None:
        return self.num_cached_tokens / self.num_prompt_tokens if self.num_prompt_tokens else None

    def utilization(self) -> list[float]:
        return [busy / self.duration_s if self.duration_s else 0.0 for busy in self.replica_busy_s]


@dataclass
class _Flight:
    """A request sent and not finished: where it went and what it has received."""

    request: WorkloadRequest
    record: RequestRecord
    replica: int
    tokens: int  # its router load in tokens (prompt + max_tokens), as the proxy counts it


class Fleet:
    def __init__(self, profile: CostProfile, config: FleetConfig) -> None:
        self.profile = profile
        self.config = config
        self.now = 0.0
        routed = config.num_replicas > 1
        self.replicas = [SimReplica(profile, self.clock, kv_events=routed and config.policy == "kv")
                         for _ in range(config.num_replicas)]  # fmt: skip
        self.routes = [Replica(ReplicaSpec(f"http://sim-{i}"), healthy=True) for i in range(config.num_replicas)]
        self.context = PolicyContext(prefix_index=PrefixIndex(clock=self.clock))
        self.policy: RoutingPolicy | None = make_policy(config.policy, self.context) if routed else None
        self._events: list[tuple[float, int, str, int]] = []  # (time, seq, kind, index)
        self._seq = itertools.count()
        self._kv_seq = [0] * config.num_replicas
        self._registry = config.tenants or TenantRegistry.build(None, None)  # no file: the client's priority

    def clock(self) -> float:
        return self.now

    def run(self, requests: list[WorkloadRequest]) -> FleetResult:
        by_index = {r.index: r for r in requests}
        flights: dict[int, _Flight] = {}
        records: dict[int, RequestRecord] = {}
        ended: dict[int, float] = {}  # request index → when it ended
        waiting_on: dict[int, list[int]] = {}  # request index → the turns that wait for it to end
        closed_loop: Iterator[WorkloadRequest] | None = None
        prompt_tokens = cached_tokens = 0

        def due(request: WorkloadRequest, at: float) -> None:
            """Send `request` at `at`, or once the turn it follows has ended."""
            after = request.after
            if after is not None and after in by_index and after not in ended:
                waiting_on.setdefault(after, []).append(request.index)
                return
            when = max(at, request.arrival_s or 0.0, ended.get(after, 0.0) if after is not None else 0.0)
            self._push(when, "send", request.index)

        def next_in_loop() -> None:
            if closed_loop is not None:
                request = next(closed_loop, None)
                if request is not None:
                    due(request, self.now)

        if self.config.concurrency is not None:
            closed_loop = iter(requests)
            for _ in range(self.config.concurrency):
                next_in_loop()
        else:
            for request in requests:
                due(request, request.arrival_s or 0.0)

        limit = self.config.duration_s
        last_end = 0.0
        peak_kv = [0.0] * len(self.replicas)
        while self._events and self._events[0][0] <= limit:
            self.now, _, kind, index = heapq.heappop(self._events)
            if kind == "send":
                flights[index] = self._send(by_index[index], records)
                self._push(self.now + self.profile.request_overhead_s, "admit", index)
            elif kind == "admit":
                flight = flights[index]
                replica = self.replicas[flight.replica]
                replica.add(self._engine_request(flight.request))
                if not replica.busy:
                    self._start_step(flight.replica)
            else:  # step_end
                replica = self.replicas[index]
                peak_kv[index] = max(peak_kv[index], replica.kv.usage)  # the step's blocks are still held
                for output in replica.finish_step():
                    flight = flights[int(output.request_id)]
                    if self._record_output(flight, output):
                        del flights[flight.request.index]
                        ended[flight.request.index] = last_end = self.now
                        self.routes[flight.replica].in_flight -= 1
                        self.routes[flight.replica].outstanding_tokens -= flight.tokens
                        prompt_tokens += flight.record.num_prompt_tokens or 0
                        cached_tokens += flight.record.num_cached_tokens or 0
                        for follower in waiting_on.pop(flight.request.index, []):
                            due(by_index[follower], self.now)
                        next_in_loop()
                self._publish_kv(index)
                if replica.has_work():
                    self._start_step(index)
        for flight in flights.values():  # the limit: cut, as bench's wall-clock limit cuts
            flight.record.status, flight.record.error, flight.record.end_s = "cancelled", "cut by the time limit", limit
            last_end = limit
        ordered = [records[i] for i in sorted(records)]
        return FleetResult(
            records=ordered, duration_s=last_end, num_not_sent=len(requests) - len(ordered),
            replica_busy_s=[r.busy_s for r in self.replicas], num_steps=sum(r.num_steps for r in self.replicas),
            num_prompt_tokens=prompt_tokens, num_cached_tokens=cached_tokens, peak_kv_usage=peak_kv,
        )  # fmt: skip

    # -- events -------------------------------------------------------------------------

    def _push(self, at: float, kind: str, index: int) -> None:
        heapq.heappush(self._events, (at, next(self._seq), kind, index))

    def _start_step(self, index: int) -> None:
        step = self.replicas[index].plan_step()
        if step.output.has_work:
            self._push(self.now + step.period_s, "step_end", index)
        elif self.replicas[index].has_work():
            # Nothing runnable now (e.g. every waiting request needs blocks a running one holds):
            # close this empty step (its pending outputs go out) and look again shortly.
            self._push(self.now + IDLE_POLL_S, "step_end", index)
        else:
            self._push(self.now, "step_end", index)

    def _send(self, request: WorkloadRequest, records: dict[int, RequestRecord]) -> _Flight:
        record = RequestRecord(
            index=request.index, traffic_class=request.traffic_class, priority=request.priority,
            session_id=request.session_id, max_tokens=request.max_tokens,
            expected_prompt_tokens=request.num_prompt_tokens, shared_prefix_tokens=request.shared_prefix_tokens,
            scheduled_s=self.now, sent_s=self.now,
        )  # fmt: skip
        records[request.index] = record
        replica = self._route(request)
        tokens = request.num_prompt_tokens + request.max_tokens
        self.routes[replica].in_flight += 1
        self.routes[replica].outstanding_tokens += tokens
        self.routes[replica].num_requests += 1
        return _Flight(request, record, replica, tokens)

    def _route(self, request: WorkloadRequest) -> int:
        if self.policy is None:
            return 0
        token_ids = prompt_token_ids(request)
        hashes = hash_block_tokens(token_ids, self.profile.engine.block_size)
        view = RequestView(
            block_hashes=hashes, num_prompt_tokens=len(token_ids), num_output_tokens=request.max_tokens,
            session_id=request.session_id,
            routing_key=hashes[0] if hashes else hashlib.sha256(repr(token_ids).encode()).digest(),
        )  # fmt: skip
        chosen = self.policy.choose(view, self.routes).replica
        return self.routes.index(chosen)

    def _engine_request(self, request: WorkloadRequest) -> EngineRequest:
        priority, slo = request_slo(self._tenant_of(request), request.priority)
        params = SamplingParams(temperature=0.0, max_tokens=request.max_tokens, ignore_eos=True)
        return EngineRequest(request_id=str(request.index), prompt_token_ids=prompt_token_ids(request),
                             sampling_params=params, priority=priority, arrival_time=self.now, slo=slo)  # fmt: skip

    def _tenant_of(self, request: WorkloadRequest) -> Tenant:
        """Who the server would take the request to be, from the key its class sends (ValueError: none)."""
        key = self.config.class_keys.get(request.traffic_class, self.config.default_key)
        tenant = self._registry.authenticate(f"Bearer {key}".encode() if key else b"")
        if tenant is None:
            raise ValueError(f"no tenant has the API key the {request.traffic_class!r} requests send (--api-keys, --api-key)")
        return tenant

    def _record_output(self, flight: _Flight, output: EngineOutput) -> bool:
        """The output's tokens as one stream chunk at now; True when the request has ended."""
        record = flight.record
        if output.new_token_ids:
            if record.first_token_s is None:
                record.first_token_s = self.now
                record.num_cached_tokens = output.num_cached_tokens
            record.chunk_times_s.append(self.now)
            record.num_output_tokens = (record.num_output_tokens or 0) + len(output.new_token_ids)
        if output.finish_reason is None:
            return False
        record.end_s = self.now
        record.num_prompt_tokens = output.num_prompt_tokens or flight.request.num_prompt_tokens
        record.finish_reason = output.finish_reason.value
        record.status = "error" if output.finish_reason is FinishReason.ERROR else "ok"
        record.error = output.error
        return True

    def _publish_kv(self, index: int) -> None:
        """The replica's KV events of the step, into the `kv` policy's index (the subscriber's job)."""
        records = self.replicas[index].take_kv_records()
        if not records:
            return
        self._kv_seq[index] += 1
        batch = KVEventBatch(epoch="simulated", seq=self._kv_seq[index], timestamp=self.now,
                             block_size=self.profile.engine.block_size, events=records)  # fmt: skip
        self.context.kv_index.apply_batch(self.routes[index].url, batch)


def prompt_token_ids(request: WorkloadRequest) -> list[int]:
    """The prompt as the server would tokenize it: the workload's ids, with stand-ins for the
    positions its tokenization adds (a BOS first; a chat template's markers after the content)."""
    extra = request.num_prompt_tokens - len(request.prompt_ids)
    if extra <= 0:
        return list(request.prompt_ids)
    return [STAND_IN_TOKEN, *request.prompt_ids, *([STAND_IN_TOKEN] * (extra - 1))]
