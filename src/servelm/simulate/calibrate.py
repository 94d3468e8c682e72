"""`servelm simulate calibrate`: time the real engine on this host and fit the cost profile.

    1. build the engine as `servelm serve` would with the same flags (its start-up calibration
       runs: its timed steps become the profile's `calibration`, the simulated scheduler's prior)
    2. run a profiling plan through the real scheduler and runner, timing every step: prompts of
       several lengths alone (tokens, the pass over the weights, attention pairs, chunks deep in a
       long prompt under the step-time target), decode batches of several sizes over short and
       long contexts (rows, context read), a conversation's next turn (a prompt whose first
       tokens are cached: a chunk after context), and a long prompt chunked beside decoding streams
    3. fit the step-cost model's coefficients to the forwards (scheduler/step_cost.py's
       non-negative least squares on relative error) and the loop around each step to
       a + b x rows
    4. optionally probe a real `servelm serve` with the same flags: a one-token request's TTFT and a
       stream's token gaps beyond what the fit predicts are the request's and each step's cost
       outside the engine loop (HTTP, tokenization, the trip between processes)

The profile names the host (`lscpu`'s model name and the CPU count, or the CUDA device) and how
well the fit predicted the plan's own steps.
"""

from __future__ import annotations

import logging
import os
import platform
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from servelm.config import EngineConfig
from servelm.datatypes import EngineRequest
from servelm.default_model import DEFAULT_MODEL_FILE
from servelm.engine.builder import BuiltEngine, build_engine
from servelm.sampling_params import SamplingParams
from servelm.scheduler.step_cost import StepCostModel, StepShape
from servelm.simulate.profile import CALIBRATED, CostProfile, EngineShape
from servelm.simulate.server_probe import ServerCosts

logger = logging.getLogger(__name__)
LONG_PROMPT = 1024  # prompts this long are timed once whatever the plan's repeats
DISTINCT_TAIL = 8  # tokens of a decode batch's prompts that are each request's own


@dataclass(frozen=True)
class CalibrationPlan:
    prompt_lengths: tuple[int, ...] = (32, 128, 512, 1024, 2048, 4096)  # prompts alone (cut to the context window)
    decode_batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32)  # requests decoding together
    decode_contexts: tuple[int, ...] = (64, 1024)  # their prompts' length
    decode_tokens: int = 12  # tokens each decodes
    long_beside: int = 2048  # a prompt chunked beside `beside_streams` decoding ones (0: none)
    beside_streams: int = 4
    repeats: int = 2  # each prompt-alone length this many times (CPU timings jitter)
    # A conversation's next turn: a prompt whose first `depth` tokens are cached, then `chunk` new ones.
    hit_depths: tuple[int, ...] = (256, 1024, 2048)
    hit_chunks: tuple[int, ...] = (16, 64, 256)


# The CI size: a tiny model, a few seconds.
QUICK_PLAN = CalibrationPlan(prompt_lengths=(16, 64, 256), decode_batches=(1, 4, 8), decode_contexts=(32, 200),
                             decode_tokens=6, long_beside=400, beside_streams=2, repeats=1, hit_depths=(128,),
                             hit_chunks=(16, 64))  # fmt: skip


@dataclass(frozen=True)
class TimedStep:
    shape: StepShape
    forward_s: float  # the runner's own timing (execute_seconds)
    period_s: float  # schedule + execute + update, as the engine loop runs them
    num_rows: int  # requests in the step


def calibrate_profile(engine_flags: dict[str, Any], plan: CalibrationPlan = CalibrationPlan(),
                      probe: Callable[[CostProfile], ServerCosts] | None = None) -> CostProfile:  # fmt: skip
    """The profile of the engine `engine_flags` (EngineConfig.from_flat keywords) builds here.
    `probe`: measures what a real server adds to a profile without it (server_probe.py); None
    adds nothing."""
    built = build_engine(EngineConfig.from_flat(**engine_flags))
    try:
        steps = run_plan(built, plan)
    finally:
        built.core.close()
    scheduler = built.core.scheduler
    fitted = StepCostModel()
    fitted.calibrate([(step.shape, step.forward_s) for step in steps])
    coefficients = fitted.coefficients()
    if coefficients is None:
        raise RuntimeError("the profiling plan's steps could not be fitted (too few distinct step sizes)")
    step_overhead, row_overhead = _fit_overhead(steps)
    errors = [abs(fitted.predict(s.shape) or 0.0) / s.forward_s - 1.0 for s in steps if s.forward_s > 0]
    engine = EngineShape(
        model=str(engine_flags.get("model") or DEFAULT_MODEL_FILE), num_blocks=built.num_blocks,
        block_size=built.core.kv_manager.block_size, max_model_len=built.max_model_len,
        layered_prefill_layers=scheduler.layered_prefill_layers,
        engine_flags={k: v for k, v in engine_flags.items() if k != "model"},
    )  # fmt: skip
    profile = CostProfile(
        name=host_name(), kind=CALIBRATED, created=time.strftime("%Y-%m-%dT%H:%M:%S%z"), coefficients=coefficients,
        step_overhead_s=step_overhead, row_overhead_s=row_overhead, request_overhead_s=0.0,
        calibration=tuple(scheduler.step_cost.calibration()), engine=engine,
        notes=(f"{len(steps)} steps timed; the fit's relative error on them: median {statistics.median(map(abs, errors)):.3f}, "
               f"p90 {_p90(map(abs, errors)):.3f}"),
    )  # fmt: skip
    if probe is None:
        return profile
    server = probe(profile)
    return CostProfile(**{**profile.__dict__, "request_overhead_s": server.request_s,
                          "step_overhead_s": profile.step_overhead_s + server.step_s,
                          "row_overhead_s": profile.row_overhead_s + server.row_s,
                          "notes": profile.notes + f"; server probe: request +{server.request_s * 1e3:.1f} ms, "
                                                   f"step +{server.step_s * 1e3:.2f} ms, "
                                                   f"row +{server.row_s * 1e3:.2f} ms"})  # fmt: skip


def run_plan(built: BuiltEngine, plan: CalibrationPlan) -> list[TimedStep]:
    """Every step of the plan's phases, timed; the engine is left empty (every request finished)."""
    core, scheduler = built.core, built.core.scheduler
    vocab = built.arch.vocab_size
    rng = random.Random(0)
    longest = built.max_model_len - plan.decode_tokens - 1
    steps: list[TimedStep] = []
    counter = iter(range(1 << 30))

    def prompt(num_tokens: int) -> list[int]:  # distinct tokens: no prefix hits between requests
        return [rng.randrange(100, vocab) for _ in range(num_tokens)]

    def send(tokens: list[int], max_tokens: int) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        core.add_request(EngineRequest(request_id=f"calibrate-{next(counter)}", prompt_token_ids=tokens,
                                       sampling_params=params))  # fmt: skip

    def drain() -> None:
        while core.has_work():
            started = time.perf_counter()
            output = scheduler.schedule()
            shape, _ = scheduler.executed_shape(output)
            model_output = core.runner.execute(output)
            scheduler.update(output, model_output)
            period = time.perf_counter() - started
            if output.has_work:
                steps.append(TimedStep(shape, model_output.execute_seconds, period, len(output.num_scheduled_tokens)))

    for length in plan.prompt_lengths:
        # Long prompts' times jitter little relative to themselves: once is enough, and costs seconds.
        for _ in range(plan.repeats if length < LONG_PROMPT else 1):
            send(prompt(min(length, longest)), 1)
            drain()
    for context in plan.decode_contexts:
        # The batch's prompts share all but their last tokens: one prefill of the context, then every
        # row still reads its whole context in each decode (what the decode-context price is of).
        shared = prompt(max(0, min(context, longest) - DISTINCT_TAIL))
        for batch in plan.decode_batches:
            for _ in range(batch):
                send(shared + prompt(DISTINCT_TAIL), plan.decode_tokens)
            drain()
    for depth in plan.hit_depths:
        cached = prompt(min(depth, longest - max(plan.hit_chunks, default=0)))
        send(cached, 1)
        drain()
        for chunk in plan.hit_chunks:
            send(cached + prompt(chunk), 1)
            drain()
    if plan.long_beside:
        for _ in range(plan.beside_streams):
            send(prompt(32), 4 * plan.decode_tokens)
        send(prompt(min(plan.long_beside, longest)), 1)
        drain()
    return steps


def _fit_overhead(steps: list[TimedStep]) -> tuple[float, float]:
    """(a, b) of period - forward = a + b x rows, least squares, neither below 0."""
    xs = [float(s.num_rows) for s in steps]
    ys = [max(0.0, s.period_s - s.forward_s) for s in steps]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / spread if spread else 0.0
    slope = max(0.0, slope)
    return max(0.0, mean_y - slope * mean_x), slope


def _p90(values: Any) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))] if ordered else 0.0


def host_name() -> str:
    """The CPU's model name and count (lscpu's, from /proc/cpuinfo), or the CUDA device's name."""
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    model, family, number = platform.processor() or "cpu", "", ""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                key, value = key.strip(), value.strip()
                if key == "model name" and model in ("cpu", platform.processor()):
                    model = value
                elif key == "cpu family" and not family:
                    family = value
                elif key == "model" and not number:
                    number = value
    except OSError:
        pass
    detail = f" family {family} model {number}" if family and number else ""
    return f"{model}{detail}, {os.cpu_count()} CPUs"
