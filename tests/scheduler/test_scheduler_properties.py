"""Random add / abort / step sequences: invariants after every step, no block leaked at the end.

A tiny reference runner mirror is rebuilt from SchedulerOutputs alone, checking the diff
protocol: what the runner would see must match what the scheduler holds. After every
schedule() the admission guarantees are checked too: aging never blocks admission, and a
request that waited aging_s starts as soon as blocks for a first chunk are free. Requests come
from random tenants in random SLO classes, so the deadline order and fair share are exercised.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from servelm.config import SchedulerConfig
from servelm.datatypes import EngineRequest, ModelOutput, RequestSlo, SchedulerOutput
from servelm.kv import KVCacheManager
from servelm.sampling_params import SamplingParams
from servelm.scheduler.request import RequestStatus
from servelm.scheduler.scheduler import Scheduler
from servelm.scheduler.step_cost import StepShape

EOS = 2
BLOCK_SIZE = 4
NUM_BLOCKS = 12
MAX_NUM_SEQS = 4
NUM_LAYERS = 4  # the model's layers, for layered prefill
PREFIXES = [[3] * 12, [3] * 4 + [4] * 8, [5, 6, 5, 6, 5, 6, 5, 6]]
# (class, TTFT target, TBT target): tight, loose and none (the deadline is then arrival + aging_s)
CLASSES = [("realtime", 0.3, 0.1), ("batch", 30.0, None), ("default", None, None)]
SLOS = st.builds(
    lambda tenant, cls: RequestSlo(tenant=tenant, slo_class=cls[0], ttft_target_s=cls[1], tbt_target_s=cls[2]),
    st.sampled_from(["t1", "t2", "t3"]),
    st.sampled_from(CLASSES),
)
Drawn = tuple[list[int], int, SamplingParams, str | None, RequestSlo]


@st.composite
def _request(draw: st.DrawFn) -> Drawn:
    prefix = draw(st.sampled_from(PREFIXES))
    prompt = prefix[: draw(st.integers(0, 12))] + draw(st.lists(st.integers(3, 6), min_size=1, max_size=14))
    max_tokens = draw(st.integers(1, 20))
    params = SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        min_tokens=draw(st.integers(0, min(2, max_tokens))),
        stop_token_ids=draw(st.sampled_from([[], [6]])),
    )
    return prompt, draw(st.integers(0, 2)), params, draw(st.sampled_from([None, "t1"])), draw(SLOS)


REQUESTS = _request()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Mirror:
    """The runner's view of a request, built only from SchedulerOutput."""

    token_ids: list[int]
    num_computed_tokens: int
    block_ids: list[int]


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        self.next_id = 0
        self.mirrors: dict[str, Mirror] = {}
        self.finished: set[str] = set()
        self.scheduler = self._make(True, 0, (4, 4), True)
        self.layers_run: dict[str, int] = {}  # layered chunks in flight: layers the runner has run
        # Tokens each request's KV was allocated for: a layered chunk started over smaller (below)
        # keeps the blocks of the one it replaced.
        self.allocated_to: dict[str, int] = {}

    def _make(self, chunked: bool, cap: int | None, slots: tuple[int, int], prefix_caching: bool,
              max_step_ms: float = 0.0) -> Scheduler:  # fmt: skip
        config = SchedulerConfig(
            max_num_batched_tokens=32 if chunked else 40,
            max_num_seqs=MAX_NUM_SEQS,
            max_model_len=40,
            max_num_partial_prefills=slots[0],
            max_long_partial_prefills=slots[1],
            long_prefill_token_threshold=cap if chunked else 0,
            enable_chunked_prefill=chunked,
            aging_s=3.0,
            max_step_ms=max_step_ms,
        )
        self.kv = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, enable_prefix_caching=prefix_caching)
        scheduler = Scheduler(config, self.kv, eos_token_ids=[EOS], clock=self.clock, num_layers=NUM_LAYERS)
        # Priced steps (max_step_ms > 0) need a cost model: taught an exact linear truth in which a
        # chunk's pass over the weights is most of a small chunk (so the time bound makes layered ones).
        truth = (0.001, 0.005, 0.001, 1e-6, 0.0005, 1e-5, 1e-4)
        shapes = [StepShape(dense_passes=1) + StepShape.chunk(n, d) for n in (4, 16, 32) for d in (0, 8, 24)]
        shapes += [StepShape.decode(n, d) for n in (1, 3) for d in (4, 30)]
        scheduler.step_cost.calibrate([(x, sum(c * f for c, f in zip(truth, x.features()))) for x in shapes])
        return scheduler

    @initialize(
        chunked=st.booleans(),
        cap=st.sampled_from([None, 0, 3, 8]),  # None: derived from the budget
        slots=st.sampled_from([(4, 4), (2, 1), (1, 1)]),  # (max_num_partial_prefills, max_long_partial_prefills)
        prefix_caching=st.booleans(),
        max_step_ms=st.sampled_from([0.0, 0.0, 8.0, 20.0]),  # 0: unpriced, the token budget alone
    )
    def setup(self, chunked: bool, cap: int | None, slots: tuple[int, int], prefix_caching: bool,
              max_step_ms: float) -> None:  # fmt: skip
        self.scheduler = self._make(chunked, cap, slots, prefix_caching, max_step_ms if chunked else 0.0)

    @rule(requests=st.lists(REQUESTS, min_size=1, max_size=3))
    def add(self, requests: list[Drawn]) -> None:
        """A burst of arrivals: several at once is what fills the cache and forces preemption."""
        for prompt, priority, params, salt, slo in requests:
            self.next_id += 1
            self.scheduler.add_request(
                EngineRequest(
                    request_id=f"r{self.next_id}",
                    prompt_token_ids=prompt,
                    sampling_params=params,
                    priority=priority,
                    cache_salt=salt,
                    slo=slo,
                )
            )

    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        every = [f"r{i}" for i in range(1, self.next_id + 1)]
        live = [r for r in every if self.scheduler.get_request(r) is not None]
        preempted = [r for r in live if self.scheduler.get_request(r).status is RequestStatus.PREEMPTED]
        # Mostly live requests, preempted ones first (the runner has already dropped them);
        # sometimes finished or unknown ids.
        pools = [p for p in (preempted, live, every + ["nobody"]) if p]
        pool = pools[data.draw(st.integers(0, len(pools) - 1))]
        self.scheduler.abort_requests([data.draw(st.sampled_from(pool))])

    @rule(
        tokens=st.lists(st.sampled_from([3, 4, 3, 4, 3, 6, EOS]), min_size=8, max_size=8),  # stops are rarer
        dt=st.sampled_from([0.0, 1.0, 4.0]),
        num_steps=st.integers(1, 3),
    )
    def step(self, tokens: list[int], dt: float, num_steps: int) -> None:
        for i in range(num_steps):
            self.clock.now += dt
            self._step(tokens[i:] + tokens[:i])

    def _step(self, tokens: list[int]) -> None:
        s = self.scheduler
        so = s.schedule()
        s.check_invariants()
        # The token budget bounds one forward's rows: a layered chunk runs in a forward of its own.
        completing = sum(so.num_scheduled_tokens[r] for r in so.layer_slices if r in so.num_scheduled_tokens)
        assert so.total_num_scheduled_tokens - completing <= s.config.max_num_batched_tokens
        assert all(layers.num_tokens <= s.config.max_num_batched_tokens for layers in so.layer_slices.values())
        self._check_admission(so)
        self._apply_to_mirrors(so)
        # A chunk sized while its prompt was alone may start over when decodes' pace binds the step
        # (Scheduler._schedule_layers): as a new layered chunk from layer 0 or as a token chunk.
        started_over = {r for r in self.layers_run if r in so.num_scheduled_tokens and r not in so.layer_slices}
        started_over |= {r for r, layers in so.layer_slices.items() if layers.start_layer == 0 and r in self.layers_run}
        if started_over:
            decodes = [r for r in so.num_scheduled_tokens if (q := s.get_request(r)) is not None and q.num_output_tokens]
            assert decodes, f"{started_over} started their chunks over in a step with no decode to pace"
        for request_id in started_over:
            self.layers_run.pop(request_id)
        for request_id, layers in so.layer_slices.items():  # the runner's layered chunks
            mirror = self.mirrors[request_id]
            assert layers.start_layer == self.layers_run.get(request_id, 0) < layers.end_layer <= NUM_LAYERS
            end = mirror.num_computed_tokens + layers.num_tokens
            self.allocated_to[request_id] = max(self.allocated_to.get(request_id, 0), end)
            assert end <= len(mirror.token_ids) and len(mirror.block_ids) * BLOCK_SIZE >= end
            assert (request_id in so.num_scheduled_tokens) == (layers.end_layer == NUM_LAYERS)
            if layers.end_layer == NUM_LAYERS:
                assert so.num_scheduled_tokens[request_id] == layers.num_tokens
                self.layers_run.pop(request_id, None)
            else:
                self.layers_run[request_id] = layers.end_layer
        sampled = {}
        for i, (request_id, num) in enumerate(so.num_scheduled_tokens.items()):
            mirror = self.mirrors[request_id]
            end = mirror.num_computed_tokens + num
            assert 0 < num and end <= len(mirror.token_ids)
            assert len(mirror.block_ids) * BLOCK_SIZE >= end  # slots exist for every scheduled token
            sampled[request_id] = [tokens[i % len(tokens)]] if end == len(mirror.token_ids) else []
            mirror.num_computed_tokens = end  # the runner computed them
        outputs = s.update(so, ModelOutput(sampled))
        s.check_invariants()
        for output in outputs:
            assert output.request_id not in self.finished
            if output.finish_reason is not None:
                self.finished.add(output.request_id)
        for request_id in so.num_scheduled_tokens:
            request = s.get_request(request_id)
            if request is not None:  # still running: KV exactly covers what is computed (and a chunk in flight)
                covered = max(request.num_computed_tokens + request.layered_tokens, self.allocated_to.get(request_id, 0))
                assert len(self.kv.get_block_ids(request_id)) == -(-covered // BLOCK_SIZE)

    def _check_admission(self, so: SchedulerOutput) -> None:
        """After a step that preempted nobody and left budget and a seat, every request still
        waiting has a reason of its own: no request that does not fit holds back one that does."""
        s = self.scheduler
        budget_left = s.config.max_num_batched_tokens - so.total_num_scheduled_tokens
        if so.preempted_request_ids or budget_left <= 0 or s.num_running >= MAX_NUM_SEQS or s.config.max_step_ms:
            return  # (a priced step leaves requests out for want of time: test_step_time_bound.py)
        num_free = self.kv.num_free_blocks
        cap = s.config.prefill_chunk_cap
        # With a slot for every seat, a starving prompt can always have one.
        slots_never_bind = s.config.max_long_partial_prefills >= MAX_NUM_SEQS
        for request_id in (f"r{i}" for i in range(1, self.next_id + 1)):
            request = s.get_request(request_id)
            if request is None or request.status is RequestStatus.RUNNING:
                continue
            num_tokens = request.num_tokens
            # Conservative: the whole of it in fresh blocks, short enough for no chunk cap.
            fits_whole = num_tokens <= budget_left and -(-num_tokens // BLOCK_SIZE) <= num_free
            assert not (fits_whole and (not cap or num_tokens <= cap)), f"{request_id} fits but was skipped"
            if s.config.enable_chunked_prefill and slots_never_bind:
                starving = self.clock.now - request.arrival_time >= s.config.aging_s
                # Its prefix hits (cached-free blocks it would revive) are at most its full blocks;
                # any free block beyond them holds a first chunk.
                num_hit_blocks = (num_tokens - 1) // BLOCK_SIZE if self.kv.enable_prefix_caching else 0
                assert not (starving and num_free > num_hit_blocks), (
                    f"{request_id} has waited {self.clock.now - request.arrival_time} s and is still not started "
                    f"with {num_free} blocks free"
                )

    def _apply_to_mirrors(self, so: SchedulerOutput) -> None:
        assert not so.finished_request_ids & so.preempted_request_ids
        for request_id in so.finished_request_ids | so.preempted_request_ids:
            del self.mirrors[request_id]  # only ids the runner knows
            self.layers_run.pop(request_id, None)  # ... and its chunk in flight with it
            self.allocated_to.pop(request_id, None)
        for new in so.new_requests:
            assert new.request_id not in self.mirrors
            self.mirrors[new.request_id] = Mirror(
                new.prompt_token_ids + new.output_token_ids, new.num_computed_tokens, list(new.block_ids)
            )
        for diff in so.cached_requests:
            mirror = self.mirrors[diff.request_id]
            assert diff.num_computed_tokens == mirror.num_computed_tokens
            mirror.token_ids += diff.new_token_ids
            mirror.block_ids += diff.new_block_ids
            mirror.num_computed_tokens = diff.num_computed_tokens
        s = self.scheduler
        for request_id, mirror in self.mirrors.items():
            if request_id in so.num_scheduled_tokens:
                request = s.get_request(request_id)
                assert request is not None
                assert mirror.token_ids == request.all_token_ids
                assert mirror.num_computed_tokens == request.num_computed_tokens
                assert mirror.block_ids == self.kv.get_block_ids(request_id)

    @invariant()
    def consistent(self) -> None:
        self.scheduler.check_invariants()

    def teardown(self) -> None:
        s = self.scheduler
        # Generous but finite: a request alone needs at most max_model_len steps, and the
        # top-priority running request advances every step, so everything drains.
        max_steps = 50 * (1 + self.next_id - len(self.finished))
        for _ in range(max_steps):
            if not s.has_unfinished_requests():
                break
            self._step([3, 4, EOS])
        assert not s.has_unfinished_requests()
        assert self.finished == {f"r{i}" for i in range(1, self.next_id + 1)}  # each finished exactly once
        s.check_invariants()
        assert s.kv_cache_usage == 0.0 and self.kv.num_free_blocks == NUM_BLOCKS
        assert all(block.ref_count == 0 for block in self.kv.pool.blocks)


SchedulerMachine.TestCase.settings = settings(
    max_examples=120, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestSchedulerMachine = SchedulerMachine.TestCase
