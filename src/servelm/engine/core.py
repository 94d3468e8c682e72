"""EngineCore: the step loop. schedule → execute → update, and nothing else.

Runs wherever it is put: in the caller's process (offline LLM, tests) or in its own
process behind ZMQ (the server). It never tokenizes or detokenizes.
"""

from __future__ import annotations

from servelm.datatypes import EngineOutput, EngineRequest
from servelm.kv.kv_cache_manager import KVCacheManager
from servelm.scheduler.scheduler import Scheduler
from servelm.schemas.core_stats import CoreStats
from servelm.worker.model_runner import ModelRunner


class EngineCore:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner, kv_manager: KVCacheManager) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.kv_manager = kv_manager  # read-only here: for stats and invariant checks

    def add_request(self, request: EngineRequest) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.abort_requests(request_ids)

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineOutput]:
        scheduler_output = self.scheduler.schedule()
        model_output = self.runner.execute(scheduler_output)
        return self.scheduler.update(scheduler_output, model_output)

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
            num_preemptions=self.scheduler.step_log.num_preemptions,
        )

    def take_step_records(self) -> list[tuple[int, float]]:
        """(scheduled tokens, runner seconds) of the steps since the last call (Scheduler.step_log)."""
        return self.scheduler.step_log.take_records()
