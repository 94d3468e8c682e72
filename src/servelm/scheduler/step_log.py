"""StepLog: what the executed steps were, read off the boundary objects, for the API's metrics.

Fed once per step by Scheduler.update() with that step's SchedulerOutput and ModelOutput
(the runner timed its own execution); drained by the engine-core process loop into each
OutputBatch's CoreStats (servelm:engine_step_seconds, servelm:iteration_tokens,
servelm:num_preemptions_total, servelm:step_time_prediction_ratio). Torch-free and model-free, like the rest of the scheduler.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from servelm.datatypes import ModelOutput, SchedulerOutput
from servelm.scheduler.step_cost import StepShape

MAX_STEP_RECORDS = 4096  # bounded for callers that never take them (the offline LLM)


@dataclass(frozen=True)
class ExecutedStep:
    """The last step that ran work, as the cost model saw it (engine/step_trace.py writes it out)."""

    shape: StepShape
    forward_s: float
    rows: int  # requests in it


class StepLog:
    def __init__(self, max_records: int = MAX_STEP_RECORDS) -> None:
        self.num_preemptions = 0  # cumulative: requests that lost their blocks
        self._records: deque[tuple[int, float]] = deque(maxlen=max_records)
        # (kind, predicted seconds, measured seconds) of steps the cost model had a prediction for
        self._predictions: deque[tuple[str, float, float]] = deque(maxlen=max_records)
        self.last_step: ExecutedStep | None = None  # set by every step with work; a trace takes it

    def record(self, scheduler_output: SchedulerOutput, model_output: ModelOutput) -> None:
        """One executed step. Empty steps (nothing to compute) count their preemptions only; a step of
        layer slices alone (layered prefill) is a step, of 0 scheduled tokens."""
        self.num_preemptions += len(scheduler_output.preempted_request_ids)
        if scheduler_output.has_work:
            self._records.append((scheduler_output.total_num_scheduled_tokens, model_output.execute_seconds))

    def record_shape(self, shape: StepShape, forward_s: float, rows: int) -> None:
        self.last_step = ExecutedStep(shape, forward_s, rows)

    def record_prediction(self, kind: str, predicted_s: float | None, measured_s: float) -> None:
        """What the step-cost model predicted for an executed step and what it took (kinds:
        Scheduler.executed_shape); nothing while the model had no prediction."""
        if predicted_s is not None and predicted_s > 0 and measured_s > 0:
            self._predictions.append((kind, predicted_s, measured_s))

    def take_predictions(self) -> list[tuple[str, float, float]]:
        """(kind, predicted, measured) since the last call; clears them."""
        predictions = list(self._predictions)
        self._predictions.clear()
        return predictions

    def take_records(self) -> list[tuple[int, float]]:
        """(scheduled tokens, runner seconds) of the steps since the last call; clears them."""
        records = list(self._records)
        self._records.clear()
        return records
