"""Where a batch-1 decode step of the default model goes (issue 19): matmuls, attention, the
elementwise work (norms, rotary, activation, residuals) and the Python around them.

The engine runs in this process (no server): one request, a `--prompt-tokens` prompt prefilled,
`--warmup` decode steps, then `--steps` timed `EngineCore.step()` calls (schedule, the runner's
inputs, the forward, the logits of the sampled row, the sampler, update), for each thread count.

Each path the model has (fused layers: models/fused_decode.py, where it applies; op by op), and
two passes per thread count and path, each on a fresh request:
- plain: nothing patched; ms/token is the median step (best of `--repeats`);
- split: the methods below wrapped by timers that charge every call's *exclusive* time (its own,
  minus the wrapped calls inside it) to a bucket, so the buckets add up to the instrumented step.
  The timers cost ~1 us per wrapped call; "timer cost" is instrumented minus plain.

    bucket                      what it times (exclusive)
    matmul kernel               the compiled matmul calls (C, through ctypes)
    matmul wrapper              Linear.forward and its method around the kernel (checks, output alloc, bias)
    attention kernel            the paged decode attention's C passes (scores, then probabilities . V)
    attention wrapper           the attention backend's forward around them (KV write, checks, softmax)
    norm / rotary / activation  the model's norm_rotary_ops (rms_norm, add_rms_norm; rotate); LlamaMLP.forward around its matmuls
    residual                    LlamaDecoderLayer.forward and RMSNorm.add around the ops (the adds are fused in the norm)
    model glue                  LlamaForCausalLM.forward / compute_logits around their parts
                                (embedding, cos/sin, the layer loop, views, module-call dispatch)
    attention glue              LlamaAttention.forward around its parts (slices, views, reshape)
    fused layers                the one C call of every layer (csrc/decode_layers.c), where a step takes it
    fused wrapper               FusedDecodeLayers.run around it (argument checks, scratch)
    runner                      ModelRunner.execute around the forward (mirrors, inputs, metadata, row select)
    sampler                     Sampler.__call__
    engine                      EngineCore.step around execute (schedule, update)

    .venv/bin/python benchmarks/decode_step.py [--threads 1,2] [--steps 64] [--repeats 3]

Run it on a quiet machine (it uses up to the largest thread count of cores).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import platform
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from servelm.attention.torch_backend import TorchAttentionBackend
from servelm.config import EngineConfig
from servelm.datatypes import EngineRequest
from servelm.engine.builder import build_engine
from servelm.engine.core import EngineCore
from servelm.kernels import cpu as cpu_kernels
from servelm.models.fused_decode import FusedDecodeLayers
from servelm.models.llama import Linear, LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from servelm.sampling_params import SamplingParams
from servelm.worker.model_runner import ModelRunner
from servelm.worker.sampler import Sampler

# The C entry points that are matmuls (any present in the built library is timed): qgemm_small was
# the int8-code kernel before issue 19, so the script measures a build from before the change too.
MATMUL_SYMBOLS = ("qgemm_small", "block_gemm_small")
ATTENTION_SYMBOLS = ("decode_scores", "decode_pv")  # the paged decode kernel's two passes (C)
# wall: elapsed time; thread: the CPU time of this thread (at 1 thread every kernel and torch op runs on it).
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "thread": time.thread_time}
GROUPS = {
    "fused layers (one C call)": ("fused layers", "fused wrapper"),
    "matmuls": ("matmul kernel", "matmul wrapper"),
    "attention": ("attention kernel", "attention wrapper"),
    "norms + rotary + activation + residual": ("norm", "rotary", "activation", "residual"),
    "Python + dispatch": ("model glue", "attention glue", "runner", "sampler", "engine"),
}


class ExclusiveTimer:
    """A stack of open buckets: time passes to the innermost one, so nested calls are not counted twice."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.seconds: dict[str, float] = {}
        self._stack: list[str] = []
        self._since = 0.0

    def _charge(self, now: float) -> None:
        if self._stack:
            bucket = self._stack[-1]
            self.seconds[bucket] = self.seconds.get(bucket, 0.0) + now - self._since
        self._since = now

    def wrap(self, bucket: str, function: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(function)
        def timed(*args: Any, **kwargs: Any) -> Any:
            self._charge(self.clock())
            self._stack.append(bucket)
            try:
                return function(*args, **kwargs)
            finally:
                self._charge(self.clock())
                self._stack.pop()

        return timed


@contextlib.contextmanager
def instrumented(timer: ExclusiveTimer, model: LlamaForCausalLM) -> Iterator[None]:
    """Wrap the step's methods, `model`'s norm / rotary ops and the kernels' C entry points with
    `timer`; undone on exit."""
    ops = model.norm_rotary_ops  # a frozen set of functions the layers call: wrapped by replacing it
    model.norm_rotary_ops = dataclasses.replace(
        ops, rms_norm=timer.wrap("norm", ops.rms_norm), add_rms_norm=timer.wrap("norm", ops.add_rms_norm),
        rotate=timer.wrap("rotary", ops.rotate),
    )  # fmt: skip
    targets: list[tuple[Any, str, str]] = [
        (EngineCore, "step", "engine"), (ModelRunner, "execute", "runner"), (Sampler, "__call__", "sampler"),
        (LlamaForCausalLM, "forward", "model glue"), (LlamaForCausalLM, "compute_logits", "model glue"),
        (LlamaDecoderLayer, "forward", "residual"), (LlamaAttention, "forward", "attention glue"),
        (TorchAttentionBackend, "forward", "attention wrapper"), (FusedDecodeLayers, "run", "fused wrapper"),
        (LlamaMLP, "forward", "activation"), (Linear, "forward", "matmul wrapper"),
    ]  # fmt: skip
    kernels = cpu_kernels.load()
    if kernels is not None:
        library = kernels._lib  # the ctypes library: its functions are attributes once looked up
        targets += [(library, name, "matmul kernel") for name in MATMUL_SYMBOLS if hasattr(library, name)]
        targets += [(library, name, "attention kernel") for name in ATTENTION_SYMBOLS]
        targets += [(library, "decode_layers", "fused layers")]
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in targets]
    try:
        for owner, name, bucket in targets:
            setattr(owner, name, timer.wrap(bucket, getattr(owner, name)))
        yield
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)
        model.norm_rotary_ops = ops


def run_steps(
    core: EngineCore, args: argparse.Namespace, request_id: str, timer: ExclusiveTimer | None = None
) -> tuple[list[float], dict[str, float]]:
    """A fresh request: prefill, warmup, then the wall time of each timed decode step (seconds), and
    what `timer`'s buckets gathered during the timed steps only (empty without a timer)."""
    prompt = torch.randint(100, 10000, (args.prompt_tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=args.warmup + args.steps + 2, ignore_eos=True)
    core.add_request(EngineRequest(request_id=request_id, prompt_token_ids=prompt, sampling_params=params))
    produced = 0
    while produced < 1 + args.warmup:  # the prefill's token, then the warmup steps
        produced += sum(len(o.new_token_ids) for o in core.step())
    times = []
    if timer is not None:
        timer.seconds.clear()
    for _ in range(args.steps):
        started = CLOCKS[args.clock]()
        core.step()
        times.append(CLOCKS[args.clock]() - started)
    buckets = dict(timer.seconds) if timer is not None else {}
    core.abort_requests([request_id])
    core.step()
    return times, buckets


def measure(core: EngineCore, args: argparse.Namespace, threads: int) -> tuple[float, float, dict[str, float]]:
    """(plain ms/step, instrumented ms/step, ms per bucket per step) at `threads` threads."""
    torch.set_num_threads(threads)
    plain = min(statistics.median(run_steps(core, args, f"plain-{threads}-{r}")[0]) for r in range(args.repeats))
    timer = ExclusiveTimer(CLOCKS[args.clock])
    with instrumented(timer, core.runner.model):
        split_times, buckets = run_steps(core, args, f"split-{threads}", timer)
    per_step = {bucket: 1e3 * s / args.steps for bucket, s in buckets.items()}
    return 1e3 * plain, 1e3 * statistics.mean(split_times), per_step


def cpu_model_name() -> str:
    with contextlib.suppress(OSError):
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    return platform.processor() or "unknown CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF dir or .gguf (default: the embedded SmolLM2)")
    parser.add_argument("--threads", default="1,2", help="torch thread counts, comma-separated")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--clock", choices=sorted(CLOCKS), default="wall",
        help="wall: elapsed time (the figure that counts, on a quiet machine); thread: this thread's CPU time, "
        "which a busy machine's other processes do not inflate (meaningful at 1 thread only: the others' work is not counted)",
    )  # fmt: skip
    args = parser.parse_args()
    core = build_engine(EngineConfig.from_flat(model=args.model)).core
    kernels = cpu_kernels.load()
    flags = " ".join(kernels.library.flags) if kernels is not None else "off (pure torch)"
    print(f"{datetime.date.today()}  {cpu_model_name()}  kernels: {flags}  clock: {args.clock}")
    print(
        f"batch-1 decode after a {args.prompt_tokens}-token prompt, {args.steps} steps; split from one instrumented pass"
    )
    model = core.runner.model
    fused = model.fused_decode
    paths = {"fused layers": fused, "op by op": None} if fused is not None else {"op by op": None}
    for threads in (int(t) for t in args.threads.split(",")):
        for path, fused_decode in paths.items():
            model.fused_decode = fused_decode
            plain, instrumented_ms, buckets = measure(core, args, threads)
            print(f"\n{threads} thread(s), {path}: {plain:.2f} ms/token (median step, best of {args.repeats}); "
                  f"instrumented {instrumented_ms:.2f} ms, timer cost {instrumented_ms - plain:+.2f} ms")  # fmt: skip
            for group, members in GROUPS.items():
                total = sum(buckets.get(m, 0.0) for m in members)
                if total == 0.0:
                    continue
                detail = ", ".join(f"{m} {buckets.get(m, 0.0):.2f}" for m in members)
                print(f"  {group:<40} {total:6.2f} ms  {100 * total / instrumented_ms:4.1f}%  ({detail})")
            unaccounted = instrumented_ms - sum(buckets.values())
            print(f"  {'outside the wrapped calls':<40} {unaccounted:6.2f} ms")
    model.fused_decode = fused


if __name__ == "__main__":
    main()
