"""`servelm simulate calibrate`: time a real server on this host and fit the cost profile.

    1. start `servelm serve` with the engine flags given and SERVELM_STEP_TRACE set: its engine
       core writes what it is, the start-up calibration its scheduler was seeded with (the
       simulated scheduler's prior), and every step's shape, forward time and loop period
       (engine/step_trace.py)
    2. send it the profiling plan over HTTP (plan_driver.py): prompts alone, decode batches,
       a conversation's next turns, a long prompt beside streams
    3. fit the step-cost model's coefficients to the steps' forward times (scheduler/step_cost.py's
       non-negative least squares on relative error), the loop around each forward to a + b x rows,
       and the request's cost outside the engine to what the short prompts' TTFT had beyond their
       one step

The steps are timed where they run in production: in the engine-core process, beside the API
process that tokenizes, detokenizes and streams, and beside this command's own client, as a
benchmark's load runs beside a server on the same host. The profile names the host (the CPU's
model and count, or the CUDA device) and how well the fit predicts the plan's own steps.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from servelm import envs
from servelm.config import flag_arguments
from servelm.default_model import DEFAULT_MODEL_FILE
from servelm.scheduler.step_cost import StepCostModel, StepShape
from servelm.schemas.ttft import percentile
from servelm.server.launcher import launch_server
from servelm.simulate.plan_driver import CalibrationPlan, OneStepPrompt, drive_plan
from servelm.simulate.profile import CALIBRATED, CostProfile, EngineShape

TRACE_WAIT_S = 60.0  # for the engine core to write the trace's first line once the server is ready


@dataclass(frozen=True)
class TimedStep:
    shape: StepShape
    forward_s: float  # the runner's own timing (execute_seconds)
    period_s: float  # the engine loop's: schedule, forward, update, outputs sent
    num_rows: int  # requests in the step


@dataclass(frozen=True)
class StepTraceFile:
    engine: dict[str, int]
    calibration: tuple[tuple[StepShape, float], ...]
    steps: list[TimedStep]


def read_trace(path: Path) -> StepTraceFile:
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not lines or "engine" not in lines[0]:
        raise RuntimeError(f"{path}: not an engine step trace (no header line)")
    header = lines[0]
    calibration = tuple((StepShape(*row[:-1]), float(row[-1])) for row in header["calibration"])
    steps = [TimedStep(StepShape(*line["counts"]), float(line["forward_s"]), float(line["period_s"]), int(line["rows"]))
             for line in lines[1:]]  # fmt: skip
    return StepTraceFile(header["engine"], calibration, steps)


def calibrate_profile(engine_flags: dict[str, Any], plan: CalibrationPlan | None = None) -> CostProfile:
    """The profile of the server `engine_flags` (EngineConfig.from_flat keywords, as servelm.cli
    reads them from the flags) starts here, under `plan` (default: the full CalibrationPlan)."""
    plan = plan or CalibrationPlan()
    arguments = flag_arguments({k: v for k, v in engine_flags.items() if k != "model"})
    with tempfile.TemporaryDirectory(prefix="servelm-calibrate-") as directory:
        trace_path = Path(directory) / "steps.jsonl"
        env = {envs.STEP_TRACE: str(trace_path)}
        with launch_server(engine_flags.get("model"), arguments, env=env) as server:
            engine = _wait_for_header(trace_path)
            one_step = drive_plan(server.base_url, plan, engine["vocab_size"], engine["max_model_len"])
        trace = read_trace(trace_path)
    return fit_profile(trace, one_step, str(engine_flags.get("model") or DEFAULT_MODEL_FILE),
                       {k: v for k, v in engine_flags.items() if k != "model"})  # fmt: skip


def fit_profile(trace: StepTraceFile, one_step: list[OneStepPrompt], model: str,
                engine_flags: dict[str, Any]) -> CostProfile:  # fmt: skip
    steps = trace.steps
    fitted = StepCostModel()
    fitted.calibrate([(step.shape, step.forward_s) for step in steps])
    coefficients = fitted.coefficients()
    if coefficients is None:
        raise RuntimeError("the profiling plan's steps could not be fitted (too few distinct step sizes)")
    step_overhead, row_overhead = _fit_overhead(steps)
    errors = [abs((fitted.predict(s.shape) or 0.0) / s.forward_s - 1.0) for s in steps if s.forward_s > 0]
    engine = EngineShape(model=model, num_blocks=trace.engine["num_blocks"], block_size=trace.engine["block_size"],
                         max_model_len=trace.engine["max_model_len"],
                         layered_prefill_layers=trace.engine["layered_prefill_layers"], engine_flags=engine_flags)  # fmt: skip
    profile = CostProfile(
        name=host_name(), kind=CALIBRATED, created=time.strftime("%Y-%m-%dT%H:%M:%S%z"), coefficients=coefficients,
        step_overhead_s=step_overhead, row_overhead_s=row_overhead, request_overhead_s=0.0,
        calibration=trace.calibration, engine=engine, notes="",
    )  # fmt: skip
    # A short prompt alone is one step of one row: what its client waited beyond that step is the
    # request's way into the engine and its first token's way out.
    beyond = [p.ttft_s - profile.step_s(StepShape(dense_passes=1.0) + StepShape.chunk(p.num_tokens, 0), 1) for p in one_step]
    request_overhead = max(0.0, statistics.median(beyond)) if beyond else 0.0
    notes = (f"{len(steps)} steps of a traced server; the fit's relative error on their forwards: median "
             f"{statistics.median(errors):.3f}, p90 {percentile(errors, 90) or 0.0:.3f}; a step's loop {step_overhead * 1e3:.2f} ms "
             f"+ {row_overhead * 1e3:.3f} ms a row beyond its forward; a request +{request_overhead * 1e3:.1f} ms")  # fmt: skip
    return replace(profile, request_overhead_s=request_overhead, notes=notes)


def _wait_for_header(path: Path) -> dict[str, int]:
    deadline = time.monotonic() + TRACE_WAIT_S
    while time.monotonic() < deadline:
        if path.exists() and (first := path.read_text().split("\n", 1)[0]).strip():
            return json.loads(first)["engine"]
        time.sleep(0.05)
    raise RuntimeError(f"the server wrote no step trace to {path} (is SERVELM_STEP_TRACE reaching its engine core?)")


def _fit_overhead(steps: list[TimedStep]) -> tuple[float, float]:
    """(a, b) of period - forward = a + b x rows, least squares, neither below 0."""
    xs = [float(s.num_rows) for s in steps]
    ys = [max(0.0, s.period_s - s.forward_s) for s in steps]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    slope = max(0.0, sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / spread if spread else 0.0)
    return max(0.0, mean_y - slope * mean_x), slope


def host_name() -> str:
    """The CUDA device's name, or the CPU's model (family and model numbers) and count."""
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    model = fields.get("model name") or platform.processor() or "cpu"
    detail = f" family {fields['cpu family']} model {fields['model']}" if "cpu family" in fields and "model" in fields else ""
    return f"{model}{detail}, {os.cpu_count()} CPUs"
