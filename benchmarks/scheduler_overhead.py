"""What one scheduling step costs in Python: `Scheduler.schedule()` + `update()` with N requests
decoding and a long prompt chunking beside them, at the default config's pricing (a calibrated
step-cost model and a step-time target), no model and no runner: the time the engine loop spends
deciding a step, which a GPU's 10-30 ms step cannot hide.

    PYTHONPATH=src .venv/bin/python benchmarks/scheduler_overhead.py --running 8,64,256 --steps 200

Measured once every request decodes. Prints, for each N, the requests a step ran, the median and
p90 per step of schedule() and of update() (milliseconds), and the share of a 20 ms step that is.
"""

from __future__ import annotations

import argparse
import statistics
import time

from servelm.config import SchedulerConfig
from servelm.datatypes import EngineRequest, ModelOutput
from servelm.kv import KVCacheManager
from servelm.sampling_params import SamplingParams
from servelm.scheduler.scheduler import Scheduler
from servelm.scheduler.step_cost import StepShape
from servelm.schemas.ttft import percentile

BLOCK_SIZE = 16
# A calibration shaped like a small GPU model's (seconds): fixed, dense pass, per decode token,
# per decode context token, per prompt token, per attention pair, per chunk context token.
TRUTH = (0.004, 0.002, 2e-5, 2e-8, 1e-5, 1e-10, 1e-8)


def calibrated_scheduler(num_running: int, max_step_ms: float) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=num_running + 8, max_num_batched_tokens=8192, max_model_len=32768,
                             max_step_ms=max_step_ms)  # fmt: skip
    kv = KVCacheManager(num_blocks=(num_running + 8) * 2048 // BLOCK_SIZE, block_size=BLOCK_SIZE)
    scheduler = Scheduler(config, kv, eos_token_ids=[2], num_layers=32)
    shapes = [StepShape(dense_passes=1) + StepShape.chunk(n, d) for n in (64, 512, 2048) for d in (0, 2048, 8192)]
    shapes += [StepShape.decode(1, d) + StepShape.decode(1, d) for d in (128, 4096)]
    scheduler.step_cost.calibrate([(x, truth_seconds(x)) for x in shapes])
    return scheduler


def truth_seconds(shape: StepShape) -> float:
    """What a step of `shape` takes on the pretend machine: the calibration's and every step's time."""
    return sum(c * f for c, f in zip(TRUTH, shape.features()))


def measure(num_running: int, num_steps: int, max_step_ms: float) -> tuple[list[float], list[float], list[int]]:
    """Per measured step: schedule()'s and update()'s seconds and the requests the step ran."""
    scheduler = calibrated_scheduler(num_running, max_step_ms)
    never = SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True)
    for i in range(num_running):
        scheduler.add_request(EngineRequest(request_id=f"d{i}", prompt_token_ids=[3 + (i + j) % 500 for j in range(200)], sampling_params=never))
    decoding = [scheduler.get_request(f"d{i}") for i in range(num_running)]  # never finish: the same objects throughout
    long_prompt = 0
    schedule_s: list[float] = []
    update_s: list[float] = []
    rows: list[int] = []
    # Measured once every request decodes: admitted (the decode pace bound lets about one of these
    # prompts into a step beside the decodes, so a burst of 256 takes ~100 steps) and prefilled.
    warm = False
    step = 0
    while len(schedule_s) < num_steps:
        step += 1
        last_long = scheduler.get_request(f"long{long_prompt}")
        if warm and (last_long is None or not last_long.is_prefilling) and step % 20 == 0:  # a long prompt now and then
            long_prompt += 1
            scheduler.add_request(EngineRequest(request_id=f"long{long_prompt}", prompt_token_ids=[5 + j % 700 for j in range(8000)],
                                                sampling_params=SamplingParams(temperature=0.0, max_tokens=4)))  # fmt: skip
        start = time.perf_counter()
        output = scheduler.schedule()
        middle = time.perf_counter()
        sampled = {}
        for request_id, num in output.num_scheduled_tokens.items():
            request = scheduler.get_request(request_id)
            done = request is not None and request.num_computed_tokens + num >= request.num_tokens
            sampled[request_id] = [7] if done else []
        shape, _ = scheduler.executed_shape(output)  # the runner "took" what the calibration's truth says
        scheduler.update(output, ModelOutput(sampled, execute_seconds=truth_seconds(shape)))
        end = time.perf_counter()
        if warm:
            schedule_s.append(middle - start)
            update_s.append(end - middle)
            rows.append(len(output.num_scheduled_tokens))
        warm = warm or (scheduler.num_waiting == 0
                        and all(r is not None and r.num_output_tokens > 0 for r in decoding))
    return schedule_s, update_s, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--running", default="8,64,256")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--max-step-ms", type=float, default=30.0, help="the step-time target the pricing holds")
    args = parser.parse_args()
    print("| requests decoding | requests a step (median) | schedule() p50 / p90 (ms) | update() p50 / p90 (ms) "
          "| both (median), share of a 20 ms step |")
    print("|---:|---:|---:|---:|---:|")
    for num_running in (int(n) for n in args.running.split(",")):
        schedule_s, update_s, rows = measure(num_running, args.steps, args.max_step_ms)
        both = statistics.median(s + u for s, u in zip(schedule_s, update_s)) * 1000
        print(f"| {num_running} | {statistics.median(rows):.0f} | {ms(schedule_s, 50):.2f} / {ms(schedule_s, 90):.2f} "
              f"| {ms(update_s, 50):.2f} / {ms(update_s, 90):.2f} | {both:.2f} ms, {both / 20:.1%} |")  # fmt: skip


def ms(seconds: list[float], q: float) -> float:
    return (percentile(seconds, q) or 0.0) * 1000


if __name__ == "__main__":
    main()
