"""One simulated engine: the real scheduler and KV cache manager, the forward replaced by a cost.

    plan_step()    Scheduler.schedule() at the virtual now; the step's period from the profile
    (the clock moves to the step's end: Fleet)
    finish_step()  Scheduler.update() with what the forward would have returned: one sampled token
                   for every request the step brought to its last token, the forward's time as the
                   runner's timing (the scheduler's step-cost model learns it as it learns a machine)

Everything the scheduler decides (admission, chunk sizes under the step-time target, decode pace,
preemption, prefix hits, priorities and aging) is the real code's decision on the simulated
state; only the forward is not run. Samples are a fixed token and EOS is never one: outputs run
to max_tokens, as `servelm bench` asks real servers to (ignore_eos).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from servelm.config import EngineConfig
from servelm.datatypes import EngineOutput, EngineRequest, ModelOutput, SchedulerOutput
from servelm.engine.kv_events import event_record
from servelm.kv.kv_cache_manager import KVCacheManager
from servelm.scheduler.scheduler import Scheduler
from servelm.schemas.kv_events import KVEventRecord
from servelm.simulate.profile import CostProfile

SIMULATED_TOKEN = 1  # what every simulated sample is (no EOS is configured: outputs run to max_tokens)


@dataclass(frozen=True)
class PlannedStep:
    output: SchedulerOutput
    forward_s: float  # what the runner's timing would be
    period_s: float  # the forward and the engine loop around it
    sampling: tuple[str, ...]  # requests whose step reaches their last token: they sample


class SimReplica:
    def __init__(self, profile: CostProfile, clock: Callable[[], float], kv_events: bool = False) -> None:
        engine = profile.engine
        config = EngineConfig.from_flat(None, **engine.engine_flags)
        self.profile = profile
        self.kv = KVCacheManager(engine.num_blocks, engine.block_size, config.cache.enable_prefix_caching, kv_events)
        self.scheduler = Scheduler(config.scheduler_for(engine.max_model_len), self.kv, eos_token_ids=(), clock=clock,
                                   num_layers=engine.layered_prefill_layers)  # fmt: skip
        self.scheduler.step_cost.calibrate(list(profile.calibration))
        self.step: PlannedStep | None = None  # the step running now
        self._inbox: list[EngineRequest] = []  # arrived during the step
        self.busy_s = 0.0  # virtual seconds spent in steps
        self.num_steps = 0

    @property
    def busy(self) -> bool:
        return self.step is not None

    def add(self, request: EngineRequest) -> None:
        """A request reaches the engine. Mid-step it waits for the step's end, as the engine loop
        reads its input only between steps."""
        if self.busy:
            self._inbox.append(request)
        else:
            self.scheduler.add_request(request)

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._inbox)

    def plan_step(self) -> PlannedStep:
        """Schedule the next step at the clock's now; call finish_step once its period has passed."""
        scheduler = self.scheduler
        output = scheduler.schedule()
        if not output.has_work:
            self.step = PlannedStep(output, 0.0, 0.0, ())
            return self.step
        shape, _ = scheduler.executed_shape(output)
        sampling = []
        for request_id, num_tokens in output.num_scheduled_tokens.items():
            request = scheduler.get_request(request_id)
            if request is not None and request.num_computed_tokens + num_tokens >= request.num_tokens:
                sampling.append(request_id)
        forward_s = self.profile.forward_s(shape)
        period_s = self.profile.step_s(shape, len(output.num_scheduled_tokens))
        self.step = PlannedStep(output, forward_s, period_s, tuple(sampling))
        return self.step

    def finish_step(self) -> list[EngineOutput]:
        step = self.step
        assert step is not None, "finish_step without a planned step"
        self.step = None
        if step.output.has_work:
            self.busy_s += step.period_s
            self.num_steps += 1
        sampled: dict[str, list[int]] = {request_id: [] for request_id in step.output.num_scheduled_tokens}
        sampled.update({request_id: [SIMULATED_TOKEN] for request_id in step.sampling})
        outputs = self.scheduler.update(step.output, ModelOutput(sampled_token_ids=sampled, execute_seconds=step.forward_s))
        for request in self._inbox:
            self.scheduler.add_request(request)
        self._inbox.clear()
        return outputs

    def take_kv_records(self) -> list[KVEventRecord]:
        """What the pool stored and evicted since the last call, as the replica would publish it."""
        return [event_record(event) for event in self.kv.take_events()]
