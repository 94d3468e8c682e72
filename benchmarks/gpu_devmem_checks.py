"""Device checks of the sampling path and GPU memory handling (issue 18), in one prepared run.

    1. seeded    the tiny random Llama in float32 on CPU and on the device, seeded top-p sampling:
                 the same tokens (the noise is each seed's CPU stream on both)
    2. syncs     host syncs per step on the device (torch.cuda.set_sync_debug_mode counts them),
                 inside ModelRunner._sample (want: exactly 1) and in the whole step
    3. memory    a float32 SmolLM2-shaped checkpoint loaded as bf16 onto the device: peak device
                 memory against the bf16 weights (want: no float32 copy there); an engine sized by
                 --gpu-memory-utilization (blocks, what the device holds after); a utilization too
                 small for one request (the error's text)
    4. oom       the device filled but for 48 MiB: a long prompt runs out of memory and fails with
                 the out-of-memory error, a short one in the same step still finishes

    python benchmarks/gpu_devmem_checks.py              # CUDA (~1-2 min)
    python benchmarks/gpu_devmem_checks.py --device cpu  # smoke run of 1 and 2 (CPU against CPU)

Writes a markdown report to stdout and, if $OUT is set, to $OUT/gpu_devmem_checks.md. Exit 1 if a
check fails.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from servelm.config import EngineConfig
from servelm.datatypes import EngineRequest
from servelm.engine.builder import build_engine
from servelm.engine.llm import LLM
from servelm.models.factory import build_model
from servelm.models.loader import load_checkpoint
from servelm.sampling_params import SamplingParams
from servelm.testing.tiny_model import write_random_checkpoint, write_tiny_checkpoint
from servelm.worker.kv_cache import InsufficientKVMemoryError

GIB = 2**30
MIXED = [
    SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=3),
    SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=1.1, top_k=40, max_tokens=24, ignore_eos=True, repetition_penalty=1.2),
    SamplingParams(temperature=0.7, seed=8, min_p=0.05, max_tokens=24, ignore_eos=True, logprobs=0),
]


def seeded(model_dir: Path, device: str, lines: list[str]) -> tuple[bool, LLM]:
    prompts = [[(7 * i + j) % 4000 + 10 for j in range(5 + 9 * i)] for i in range(8)]
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i, max_tokens=32, ignore_eos=True)
              for i in range(len(prompts))]  # fmt: skip
    on_cpu = LLM(model=str(model_dir), dtype="float32", device="cpu", num_blocks=256)
    on_device = LLM(model=str(model_dir), dtype="float32", device=device, num_blocks=256)
    want = [o.outputs[0].token_ids for o in on_cpu.generate(prompts, params)]
    got = [o.outputs[0].token_ids for o in on_device.generate(prompts, params)]
    same = sum(g == w for g, w in zip(got, want))
    lines.append(f"| seeded | {same}/{len(prompts)} seeded requests give the same 32 tokens on cpu and {device} | "
                 f"{'ok' if same == len(prompts) else 'FAIL'} |")  # fmt: skip
    return same == len(prompts), on_device


def syncs(llm: LLM, device: str, lines: list[str]) -> bool:
    if not device.startswith("cuda"):
        lines.append("| syncs | skipped (CUDA only) | - |")
        return True
    core = llm.engine.core
    in_sample: list[int] = []
    real_sample = core.runner._sample

    def counted_sample(*args: Any) -> None:
        in_sample.append(_count_syncs(lambda: real_sample(*args)))

    core.runner._sample = counted_sample  # type: ignore[method-assign]
    for i, params in enumerate(MIXED * 4):
        prompt = [(11 * i + j) % 4000 + 10 for j in range(20 + 13 * i)]
        core.add_request(EngineRequest(request_id=f"s{i}", prompt_token_ids=prompt, sampling_params=params))
    per_step: list[int] = []
    while core.has_work():
        per_step.append(_count_syncs(core.step))
    core.runner._sample = real_sample  # type: ignore[method-assign]
    ok = set(in_sample) == {1}
    lines.append(f"| syncs | in _sample: {sorted(set(in_sample))} over {len(in_sample)} steps; whole step: "
                 f"min {min(per_step)}, max {max(per_step)} | {'ok' if ok else 'FAIL'} |")  # fmt: skip
    return ok


def _count_syncs(run: Callable[[], object]) -> int:
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def memory(tmp: Path, lines: list[str]) -> tuple[bool, Any]:
    model_dir = write_random_checkpoint(tmp / "f32", dtype=torch.float32)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    checkpoint = load_checkpoint(model_dir)
    model = build_model(checkpoint.arch, checkpoint.weights, torch.bfloat16, "cuda")
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    peak = torch.cuda.max_memory_allocated() - before
    load_ok = peak <= 1.1 * params
    lines.append(f"| load | float32 file into bf16 on the device: peak {peak / 1e6:.0f} MB for {params / 1e6:.0f} MB "
                 f"of bf16 weights | {'ok' if load_ok else 'FAIL'} |")  # fmt: skip
    del model, checkpoint
    torch.cuda.empty_cache()
    config = EngineConfig.from_flat(model=str(model_dir), device="cuda", dtype="bfloat16", max_num_batched_tokens=16384)
    built = build_engine(config)
    free, total = torch.cuda.mem_get_info()
    used = (total - free) / total
    sized_ok = used <= 0.9 + 0.01
    lines.append(f"| sizing | utilization 0.9: {built.num_blocks} blocks, the device {100 * used:.1f}% used after "
                 f"start-up | {'ok' if sized_ok else 'FAIL'} |")  # fmt: skip
    try:
        build_engine(EngineConfig.from_flat(model=str(model_dir), device="cuda", gpu_memory_utilization=0.001))
        error = "no error"
    except InsufficientKVMemoryError as exc:
        error = str(exc)
    lines.append(f"| too little | `{error}` | {'ok' if 'gpu-memory-utilization' in error else 'FAIL'} |")
    return load_ok and sized_ok and error != "no error", built


def oom(built: Any, lines: list[str]) -> bool:
    core = built.core
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    ballast = torch.empty(free - 48 * 2**20, dtype=torch.uint8, device="cuda")  # noqa: F841 - holds the memory
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    core.add_request(EngineRequest(request_id="long", prompt_token_ids=[5] * 8000, sampling_params=params))
    core.add_request(EngineRequest(request_id="short", prompt_token_ids=[5] * 16, sampling_params=params))
    outputs: dict[str, list[Any]] = {"long": [], "short": []}
    while core.has_work():
        for output in core.step():
            outputs[output.request_id].append(output)
    long_error = next((o.error for o in outputs["long"] if o.error), None) or "none"
    short_tokens = sum(len(o.new_token_ids) for o in outputs["short"])
    ok = "OutOfMemoryError" in long_error and short_tokens == 4
    lines.append(f"| oom | long prompt: `{long_error}`; short one in the same step: {short_tokens} tokens | "
                 f"{'ok' if ok else 'FAIL'} |")  # fmt: skip
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    device = args.device
    name = torch.cuda.get_device_name(0) if device.startswith("cuda") else "CPU"
    lines = [f"### GPU memory and sampling checks — {name}, torch {torch.__version__}", "",
             "| check | result | verdict |", "|---|---|---|"]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        ok, llm = seeded(write_tiny_checkpoint(Path(tmp) / "tiny", seed=0), device, lines)
        ok &= syncs(llm, device, lines)
        del llm
        if device.startswith("cuda"):
            memory_ok, built = memory(Path(tmp), lines)
            ok &= memory_ok
            ok &= oom(built, lines)
    report = "\n".join(lines)
    print(report)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_devmem_checks.md").write_text(report + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
