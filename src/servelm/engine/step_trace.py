"""Every engine step's shape and times, as JSON lines, while SERVELM_STEP_TRACE names a file.

    {"engine": {num_blocks, block_size, max_model_len, layered_prefill_layers, vocab_size},
     "calibration": [[counts..., seconds], ...]}                first line: what the engine is, and
                                                                the start-up calibration its scheduler's
                                                                step-cost model was seeded with
    {"counts": [...], "forward_s": F, "period_s": P, "rows": R}  one line per step that ran work

`counts` are scheduler/step_cost.StepShape's fields in order, `forward_s` the runner's own timing
(what the cost model learns from), `period_s` the engine loop's time for the step: scheduling,
the forward, the update and sending its outputs to the API process, in the process and on the
machine the server runs on (its other processes' load included). `servelm simulate calibrate`
fits its cost profile from them. Off by default: tracing costs a line of JSON a step.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TextIO

from servelm.engine.builder import BuiltEngine
from servelm.engine.core import EngineCore


class StepTrace:
    def __init__(self, path: Path, built: BuiltEngine) -> None:
        self._file: TextIO = path.open("a", buffering=1)  # line-buffered: a reader sees whole steps
        scheduler = built.core.scheduler
        header = {
            "engine": {"num_blocks": built.num_blocks, "block_size": built.core.kv_manager.block_size,
                       "max_model_len": built.max_model_len,
                       "layered_prefill_layers": scheduler.layered_prefill_layers, "vocab_size": built.arch.vocab_size},
            "calibration": [[*shape.counts(), seconds] for shape, seconds in scheduler.step_cost.calibration()],
        }  # fmt: skip
        self._file.write(json.dumps(header) + "\n")

    def write(self, core: EngineCore, period_s: float) -> None:
        """The step the core just ran (nothing if it ran no work)."""
        step = core.scheduler.step_log.last_step
        if step is None:
            return
        core.scheduler.step_log.last_step = None
        line = {"counts": list(step.shape.counts()), "forward_s": step.forward_s, "period_s": period_s, "rows": step.rows}
        self._file.write(json.dumps(line) + "\n")

    def close(self) -> None:
        self._file.close()
