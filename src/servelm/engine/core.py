"""EngineCore: the step loop. schedule → execute → update, and nothing else.

Runs wherever it is put: in the caller's process (offline LLM, tests) or in its own
process behind ZMQ (the server). It never tokenizes or detokenizes.
"""

from __future__ import annotations

import time
from collections import deque

from servelm.datatypes import EngineOutput, EngineRequest
from servelm.engine.messages import CoreStats
from servelm.kv.kv_cache_manager import KVCacheManager
from servelm.scheduler.scheduler import Scheduler
from servelm.worker.model_runner import ModelRunner


MAX_STEP_RECORDS = 4096


class EngineCore:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner, kv_manager: KVCacheManager) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.kv_manager = kv_manager  # read-only here: for stats and invariant checks
        self.num_preemptions = 0  # cumulative, read off each step's SchedulerOutput
        # Steps not yet reported (see take_step_records); bounded for callers that never take them.
        self._step_records: deque[tuple[int, float]] = deque(maxlen=MAX_STEP_RECORDS)

    def add_request(self, request: EngineRequest) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.abort_requests(request_ids)

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineOutput]:
        scheduler_output = self.scheduler.schedule()
        started = time.perf_counter()
        model_output = self.runner.execute(scheduler_output)
        seconds = time.perf_counter() - started
        self.scheduler.observe_step(scheduler_output.total_num_scheduled_tokens, seconds)
        if scheduler_output.total_num_scheduled_tokens:
            self._step_records.append((scheduler_output.total_num_scheduled_tokens, seconds))
        self.num_preemptions += len(scheduler_output.preempted_request_ids)
        return self.scheduler.update(scheduler_output, model_output)

    def take_step_records(self) -> list[tuple[int, float]]:
        """(scheduled tokens, runner seconds) of the steps since the last call."""
        records = list(self._step_records)
        self._step_records.clear()
        return records

    def stats(self) -> CoreStats:
        kv = self.kv_manager
        prefix = kv.stats
        return CoreStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_usage=kv.usage,
            num_used_blocks=kv.num_blocks - kv.num_free_blocks,
            prefix_queries=prefix.num_queried_tokens,
            prefix_hits=prefix.num_hit_tokens,
            num_preemptions=self.num_preemptions,
        )
