"""EngineCore: the step loop. schedule → execute → update, and nothing else.

Runs wherever it is put: in the caller's process (offline LLM, tests) or in its own
process behind ZMQ (the server). It never tokenizes or detokenizes.

A step whose execution raises fails only the requests it scheduled (ERROR outputs, blocks
freed, the traceback logged): the engine serves the next step as if they had been aborted.
The fronts validate inputs first; this is what keeps one bad request (or a bug it triggers)
from poisoning every later step, which is what a request left in the scheduler would do.
"""

from __future__ import annotations

import logging

from servelm.datatypes import EngineOutput, EngineRequest
from servelm.kv.kv_cache_manager import KVCacheManager
from servelm.scheduler.scheduler import Scheduler
from servelm.schemas.core_stats import CoreStats
from servelm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


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
        try:
            model_output = self.runner.execute(scheduler_output)
        except Exception as exc:
            failed = sorted(scheduler_output.num_scheduled_tokens)
            logger.exception("engine step failed; failing its %d requests: %s", len(failed), failed)
            return self.scheduler.fail_step(scheduler_output, f"the engine step failed: {type(exc).__name__}")
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
