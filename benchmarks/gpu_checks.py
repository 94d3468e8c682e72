"""The GPU checks of the GPU-path issue, in one prepared run for a lent device (or a CPU smoke run).

    1. exactness  the real engine (batching, paging, chunked prefill, the default attention backend
                  and CUDA graphs) against transformers on the same device and weights:
                  the tiny random Llama and the default model (SmolLM2-135M, its GGUF dequantised);
                  float32 — greedy tokens identical, prompt logits within 1e-4 relative;
                  bfloat16 — every token servelm picks is within `--bf16-tol` nats of the
                  float32 reference's best choice at that position (bf16 may break near-ties).
    2. kernels    every Triton kernel (paged decode and prefill attention, the KV write, fused
                  RMSNorm+residual, rotary) against its torch reference on fresh random inputs
                  (benchmarks/attention_kernel_checks.py, fused_ops_bench.py), and their speed.
    2b. graphs    decode step time with CUDA graphs vs `enforce_eager`, and the capture time.
    2c. fp8       the block-scaled FP8 GEMM (kernels/triton/fp8_gemm.py, DeepSeek-V3's 128 x 128
                  scale blocks) against the bf16 product of the same dequantized weight: relative
                  error, and its time and weight GB/s beside the bf16 GEMM at decode and prefill rows.
    3. syncs      host synchronisations per decode step (torch's sync debug mode; target: 1).
    4. decode     a random-weight Llama of a 1B-class shape (Llama-3.2-1B: hidden 2048, 16 layers,
                  32/8 heads, intermediate 8192, vocab 128256) in bfloat16: engine step time at
                  several batch sizes against the HBM roofline ((weight bytes + KV bytes read per
                  step) / bandwidth): the batch-1 share is the model-bandwidth utilisation (MBU,
                  target >= 60%), batch 64 gives decode throughput.
    5. prefill    the same model prefilling 16 x 1,024-token prompts: FLOP/s as a share of the
                  bf16 dense peak.
    6. offline    the offline workload of benchmarks/offline_throughput.py (64 prompts of
                  128-512 tokens, 128 output tokens each) on that model: total tokens/s.

    python benchmarks/gpu_checks.py                                   # CUDA, everything (< 8 min on an H200)
    python benchmarks/gpu_checks.py --device cpu --shape tiny         # the CPU smoke run the tests use

On the lent machine use benchmarks/gpu_run.sh (it installs what the device image lacks first).
Writes a markdown report to stdout and, if $OUT is set (the device tool), gpu_checks.md and
gpu_checks.json (every number) there. Exit status 1 if a correctness check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from servelm.config import EngineConfig
from servelm.datatypes import EngineRequest
from servelm.engine.builder import BuiltEngine, assemble_engine
from servelm.engine.llm import LLM
from servelm.models.arch import ModelArchConfig
from servelm.models.factory import build_model
from servelm.models.weights import expected_weight_shapes
from servelm.sampling_params import SamplingParams
from servelm.testing.tiny_model import write_tiny_checkpoint
from servelm.tokenization.loading import load_tokenizer

SHAPES = {
    "1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
           "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": True, "rope_theta": 500000.0},
    "tiny": {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 4096, "tie_word_embeddings": False, "rope_theta": 10000.0},
}  # fmt: skip

# H200 SXM datasheet figures; the measured copy bandwidth is reported beside them.
H200_HBM_TBPS = 4.8
H200_BF16_DENSE_TFLOPS = 989.4


@dataclass
class Report:
    """Every number the run measured (the JSON) and the markdown lines that present them."""

    results: dict[str, Any] = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)
    ok: bool = True

    def table(self, header: list[str], rows: list[list[Any]]) -> None:
        self.lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        self.lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
        self.lines.append("")


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


# -- 1. exactness --------------------------------------------------------------------------


@dataclass
class ExactnessCase:
    model: str
    dtype: str
    prompts: int
    identical: int
    measure: str  # what `value` is
    value: float
    limit: float
    passed: bool


def exactness(device: str, bf16_tol: float, with_default_model: bool, report: Report) -> None:
    import transformers

    cases: list[ExactnessCase] = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_tiny_checkpoint(Path(tmp) / "tiny", seed=0)
        reference = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device)
        rng = random.Random(0)
        prompts = [[rng.randrange(reference.config.vocab_size) for _ in range(n)] for n in (5, 40, 300, 700)]
        cases += _exactness_of("tiny", str(model_dir), reference.eval(), prompts, 24, device, bf16_tol)
        del reference
    if with_default_model:
        from servelm.default_model import default_model_path

        path = default_model_path()
        reference = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32, local_files_only=True
        ).to(device)
        tokenizer = load_tokenizer(str(path))
        questions = ["What is the capital of France?", "Write one sentence about the ocean.",
                     "Give me three tips for staying healthy.", "Explain what a computer does, briefly."]  # fmt: skip
        prompts = [
            list(
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=False
                )
            )  # fmt: skip
            for q in questions
        ]
        cases += _exactness_of("SmolLM2-135M (GGUF)", str(path), reference.eval(), prompts, 32, device, bf16_tol)
        del reference
    report.results["exactness"] = [asdict(c) for c in cases]
    report.ok &= all(c.passed for c in cases)
    report.table(["model", "dtype", "greedy identical", "measure", "value", "limit", "verdict"],
                 [[c.model, c.dtype, f"{c.identical}/{c.prompts}", c.measure, f"{c.value:.3g}", c.limit,
                   _verdict(c.passed)] for c in cases])  # fmt: skip


def _exactness_of(name: str, model: str, reference, prompts: list[list[int]], max_tokens: int, device: str,
                  bf16_tol: float) -> list[ExactnessCase]:  # fmt: skip
    expected = [_hf_greedy(reference, p, max_tokens, device) for p in prompts]
    # Small budget and pool: chunked prefill, paging and batching all take part.
    engine_flags = {"device": device, "num_blocks": 512, "max_num_batched_tokens": 256}
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm = LLM(model=model, dtype="float32", **engine_flags)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    same = sum(g == e for g, e in zip(got, expected))
    worst = _max_relative_logit_error(llm, reference, prompts, device)
    fp32 = ExactnessCase(name, "float32", len(prompts), same, "prompt logits max relative error", worst, 1e-4,
                         same == len(prompts) and worst <= 1e-4)  # fmt: skip
    del llm
    llm = LLM(model=model, dtype="bfloat16", **engine_flags)
    outputs = llm.generate(prompts, greedy)
    worst_gap, identical = 0.0, 0
    for prompt, output, exp in zip(prompts, outputs, expected):
        tokens = output.outputs[0].token_ids
        identical += tokens == exp
        worst_gap = max(worst_gap, _reference_regret(reference, prompt, tokens, device))
    bf16 = ExactnessCase(name, "bfloat16", len(prompts), identical, "largest fp32-logprob gap of a pick (nats)",
                         worst_gap, bf16_tol, worst_gap <= bf16_tol)  # fmt: skip
    return [fp32, bf16]


def _hf_greedy(model, prompt: list[int], max_tokens: int, device: str) -> list[int]:
    ids = torch.tensor([prompt], device=device)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False, min_new_tokens=max_tokens,
                             attention_mask=torch.ones_like(ids))  # fmt: skip
    return out[0, len(prompt) :].tolist()


def _max_relative_logit_error(llm: LLM, reference, prompts: list[list[int]], device: str) -> float:
    from servelm.testing.reference_decode import prompt_logits

    ours = prompt_logits(llm.engine.core.runner.model, prompts)
    worst = 0.0
    with torch.no_grad():
        for prompt, logits in zip(prompts, ours):
            theirs = reference(torch.tensor([prompt], device=device)).logits[0].float()
            worst = max(worst, ((logits.float() - theirs).abs().max() / theirs.abs().max()).item())
    return worst


def _reference_regret(reference, prompt: list[int], tokens: list[int], device: str) -> float:
    """Largest (best logprob − logprob of the chosen token) under the float32 reference,
    scoring servelm's own continuation position by position."""
    ids = torch.tensor([prompt + tokens], device=device)
    with torch.no_grad():
        logprobs = torch.log_softmax(reference(ids).logits[0].float(), dim=-1)
    rows = logprobs[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]
    chosen = rows.gather(1, torch.tensor(tokens, device=device)[:, None])[:, 0]
    return (rows.max(dim=1).values - chosen).max().item()


# -- 4./5./6. a random-weight model of a real shape ----------------------------------------


def random_engine(shape: str, device: str, dtype: torch.dtype, kv_gib: float,
                  enforce_eager: bool = False, **engine_flags: Any) -> tuple[BuiltEngine, int]:  # fmt: skip
    config = {"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
              "hidden_act": "silu", **SHAPES[shape]}  # fmt: skip
    arch = ModelArchConfig.from_hf_config(config)
    generator = torch.Generator(device=device).manual_seed(0)
    weights = {}
    for name, size in expected_weight_shapes(arch).items():
        if len(size) == 1:  # norm weights: near 1 so activations stay sane
            weights[name] = torch.ones(size, dtype=dtype, device=device)
        else:
            weights[name] = (torch.randn(size, generator=generator, device=device, dtype=torch.float32) * 0.02).to(
                dtype
            )
    # Bytes a decode step reads: every weight once, except an untied embedding table (only the
    # batch's rows of it are read; tied, it is read whole as the lm_head).
    weight_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    if not arch.tie_word_embeddings:
        embedding = weights["model.embed_tokens.weight"]
        weight_bytes -= embedding.numel() * embedding.element_size()
    model = build_model(arch, weights, dtype, device)
    del weights
    flags = {"max_num_batched_tokens": 8192, **engine_flags}
    engine_config = EngineConfig.from_flat(model=None, device=device, kv_cache_memory_gib=kv_gib, max_num_seqs=256,
                                           enforce_eager=enforce_eager, **flags)  # fmt: skip
    return assemble_engine(engine_config, model, arch, load_tokenizer(None), f"random {shape}"), weight_bytes


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def add_random_requests(built: BuiltEngine, tag: str, count: int, prompt_len: int, max_tokens: int, seed: int) -> None:
    rng = random.Random(seed)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(count):
        prompt = [rng.randrange(built.arch.vocab_size) for _ in range(prompt_len)]
        built.core.add_request(EngineRequest(request_id=f"{tag}-{i}", prompt_token_ids=prompt, sampling_params=params))


def decode_step_times(built: BuiltEngine, batch: int, device: str, tag: str, steps: int = 32) -> list[float]:
    """Wall time of every engine step in which all `batch` requests decoded one token each."""
    core = built.core
    add_random_requests(built, tag, batch, 128, steps + 8, seed=batch)
    times: list[float] = []
    while core.has_work():
        _sync(device)
        started = time.perf_counter()
        running_before = core.scheduler.num_running
        outputs = core.step()
        _sync(device)
        if running_before == batch and len(outputs) == batch and all(len(o.new_token_ids) == 1 for o in outputs):
            times.append(time.perf_counter() - started)
    return times


def host_syncs(built: BuiltEngine, device: str, report: Report) -> None:
    """Synchronising calls per decode step, as torch's sync debug mode reports them (CUDA only)."""
    if not device.startswith("cuda"):
        report.results["host_syncs"] = {"skipped": "CUDA only"}
        return
    core = built.core
    add_random_requests(built, "sync", 8, 64, 24, seed=7)
    decoding: set[str] = set()
    while len(decoding) < 8:  # every request past its prompt: the steps below are pure decodes
        decoding.update(o.request_id for o in core.step() if o.new_token_ids)
    counts: list[int] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(8):
                before = len(caught)
                core.step()
                counts.append(len(caught) - before)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    while core.has_work():
        core.step()
    per_step = statistics.median(counts)
    where = sorted({str(w.message).splitlines()[0][:120] for w in caught})[:5]
    report.results["host_syncs"] = {"per_decode_step_median": per_step, "per_step": counts, "target": 1,
                                    "examples": where}  # fmt: skip
    report.lines += [f"Host synchronisations per decode step (batch 8): median **{per_step}** (target 1); "
                     f"per step {counts}.", ""]  # fmt: skip


def decode_roofline(built: BuiltEngine, weight_bytes: int, device: str, hbm_tbps: float, batches: list[int],
                    report: Report) -> None:  # fmt: skip
    arch = built.arch
    kv_bytes_per_token = arch.num_hidden_layers * 2 * arch.num_key_value_heads * arch.head_dim * 2  # bf16 K and V
    rows, results = [], []
    for batch in batches:
        times = decode_step_times(built, batch, device, f"d{batch}")
        step_s = statistics.median(times[2:]) if len(times) > 4 else float("nan")
        context = 128 + 32 / 2
        bytes_read = weight_bytes + batch * context * kv_bytes_per_token
        roofline_s = bytes_read / (hbm_tbps * 1e12)
        share = roofline_s / step_s
        results.append({"batch": batch, "step_ms": step_s * 1e3, "tokens_per_s": batch / step_s,
                        "bytes_read": bytes_read, "roofline_ms": roofline_s * 1e3, "share_of_roofline": share})  # fmt: skip
        rows.append([batch, f"{step_s * 1e3:.3f}", f"{batch / step_s:.0f}", f"{bytes_read / 1e9:.3f}",
                     f"{roofline_s * 1e3:.3f}", f"{100 * share:.0f}%"])  # fmt: skip
    report.results["decode"] = {"hbm_tbps": hbm_tbps, "batches": results}
    mbu = next((r["share_of_roofline"] for r in results if r["batch"] == 1), None)
    if mbu is not None:
        report.results["decode"]["mbu_batch1"] = mbu
    report.table(["batch", "engine step (ms)", "tokens/s", "bytes read per step (GB)", "roofline (ms)",
                  "% of roofline (batch 1: MBU)"], rows)  # fmt: skip


def prefill_throughput(built: BuiltEngine, weight_bytes: int, device: str, peak_tflops: float, report: Report) -> None:
    """16 prompts of 1,024 tokens, one output token each: FLOP/s over the whole prefill."""
    arch = built.arch
    count, length = 16, 1024
    add_random_requests(built, "warm", 2, 256, 1, seed=3)  # kernels compiled before the clock starts
    while built.core.has_work():
        built.core.step()
    _sync(device)
    started = time.perf_counter()
    add_random_requests(built, "p", count, length, 1, seed=4)
    while built.core.has_work():
        built.core.step()
    _sync(device)
    seconds = time.perf_counter() - started
    # Matmul FLOPs: 2 per weight per token, the embedding table excepted (a lookup; the LM head
    # runs only for each prompt's last row); causal attention: 2 matmuls x 2 FLOPs x heads x
    # head_dim per (query, earlier key) pair.
    params = weight_bytes // 2 - arch.vocab_size * arch.hidden_size
    attention = 4 * arch.num_hidden_layers * arch.num_attention_heads * arch.head_dim * (length * (length + 1) // 2)
    flops = count * (2 * params * length + attention + 2 * arch.vocab_size * arch.hidden_size)
    tflops = flops / seconds / 1e12
    report.results["prefill"] = {"prompts": count, "prompt_len": length, "seconds": seconds,
                                 "tokens_per_s": count * length / seconds, "tflops": tflops,
                                 "peak_tflops": peak_tflops, "share_of_peak": tflops / peak_tflops}  # fmt: skip
    report.lines += [f"Prefill: {count} x {length} tokens in {seconds:.3f} s = {count * length / seconds:.0f} tokens/s, "
                     f"{tflops:.1f} TFLOP/s = **{100 * tflops / peak_tflops:.1f}% of the bf16 dense peak** "
                     f"({peak_tflops} TFLOP/s).", ""]  # fmt: skip


def offline_throughput(built: BuiltEngine, report: Report) -> None:
    core, vocab = built.core, built.arch.vocab_size
    rng = random.Random(2)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(128, 512))] for _ in range(64)]
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    started = time.perf_counter()
    for i, prompt in enumerate(prompts):
        core.add_request(EngineRequest(request_id=f"o{i}", prompt_token_ids=prompt, sampling_params=params))
    produced = 0
    while core.has_work():
        produced += sum(len(o.new_token_ids) for o in core.step())
    seconds = time.perf_counter() - started
    prompt_tokens = sum(len(p) for p in prompts)
    total = (prompt_tokens + produced) / seconds
    report.results["offline"] = {"prompt_tokens": prompt_tokens, "output_tokens": produced, "seconds": seconds,
                                 "total_tokens_per_s": total}  # fmt: skip
    report.lines += [f"Offline: 64 prompts ({prompt_tokens} tokens), {produced} output tokens in {seconds:.2f} s: "
                     f"**{total:.0f} total tokens/s**.", ""]  # fmt: skip


def kernels(device: str, report: Report) -> None:
    """Triton attention vs the torch backend (correctness everywhere; speed on CUDA), fused ops."""
    import attention_kernel_checks as attention
    from fused_ops_bench import fused_op_microbench

    on_cuda = device.startswith("cuda")
    # The interpreter (CPU) runs the same kernels thousands of times slower: one small geometry and
    # short prompts there (still every kind of row: decodes, chunks after context, a fresh prompt).
    if on_cuda:
        checks = attention.check_backends(device)
    else:
        checks = attention.check_backends(device, max_context=96, geometries=attention.GEOMETRIES[-1:], max_prompt=80)
    report.results["kernels"] = {"attention": attention.as_dicts(checks)}
    report.ok &= all(c.passed for c in checks)
    report.table(["attention (triton vs torch)", "dtype", "requests / tokens", "relative error", "limit",
                  "pools equal", "verdict"],
                 [[c.geometry, c.dtype, f"{c.requests} / {c.tokens}", f"{c.relative_error:.2e}", c.limit,
                   c.pools_equal, _verdict(c.passed)] for c in checks])  # fmt: skip
    if not on_cuda:
        return
    timings = attention.decode_timings(device)
    report.results["kernels"]["decode_attention_timings"] = timings
    report.table(["decode attention, bf16 32/8 x 128", "torch (us)", "triton (us)", "triton KV GB/s"],
                 [[f"batch {t['batch']}, context {t['context']}", f"{t['torch_us']:.1f}", f"{t['triton_us']:.1f}",
                   f"{t['triton_gbps']:.0f}"] for t in timings])  # fmt: skip
    fused = fused_op_microbench(device)
    report.results["kernels"]["fused_ops"] = fused
    worst = max(row["max_abs_diff"] for row in fused["rows"])
    report.table(["fused op", "shape", "tokens", "torch graph (us)", "triton graph (us)", "max |diff|"],
                 [[r["op"], r["shape"], r["tokens"], _us(r["torch_graph_us"]), _us(r["triton_graph_us"]),
                   f"{r['max_abs_diff']:.2e}"] for r in fused["rows"]])  # fmt: skip
    report.lines += [f"Fused ops: largest |fused - unfused| {worst:.2e} (bf16).", ""]


# (rows, N, K): decode batches and a prefill chunk over a DeepSeek-V3-sized projection (hidden 7168
# into the 2,048-wide expert MLP and back); the CPU smoke run takes the smallest, interpreted.
FP8_GEMM_SHAPES = [(1, 4096, 7168), (16, 4096, 7168), (256, 7168, 2048), (2048, 4096, 7168)]


def fp8_gemm(device: str, report: Report) -> None:
    """The block-scaled FP8 GEMM against x @ dequant(W)^T in bf16 (error: relative to the largest
    output; limit 2e-2, bf16's rounding of the weight and the sum order), and on CUDA its speed."""
    import attention_kernel_checks as attention

    from servelm.kernels.triton.fp8_gemm import fp8_block_gemm
    from servelm.models.fp8_blocks import Fp8BlockScheme, quantize_fp8_blocks

    on_cuda = device.startswith("cuda")
    shapes = FP8_GEMM_SHAPES if on_cuda else [(5, 192, 200)]
    dtype = torch.bfloat16 if on_cuda else torch.float32
    rows_out, results = [], []
    for m, n, k in shapes:
        generator = torch.Generator().manual_seed(m + n + k)
        weight = quantize_fp8_blocks(torch.randn(n, k, generator=generator), Fp8BlockScheme(128, 128))
        codes, scales = weight.codes.to(device), weight.scales.to(device)
        dense = weight.dequantize().to(device=device, dtype=dtype)
        x = torch.randn(m, k, generator=generator).to(device=device, dtype=dtype)
        expected = x.float() @ dense.float().T
        error = ((fp8_block_gemm(x, codes, scales, 128, 128).float() - expected).abs().max() / expected.abs().max()).item()
        row: dict[str, Any] = {"rows": m, "n": n, "k": k, "relative_error": error, "passed": error <= 2e-2}
        if on_cuda:
            row["fp8_us"] = attention.time_us(partial(fp8_block_gemm, x, codes, scales, 128, 128), device, 50)
            row["bf16_us"] = attention.time_us(partial(torch.matmul, x, dense.T), device, 50)
            row["fp8_weight_gbps"] = n * k / (row["fp8_us"] * 1e3)
        results.append(row)
        rows_out.append([f"{m} x {n} x {k}", f"{error:.2e}", _us(row.get("fp8_us")), _us(row.get("bf16_us")),
                         f"{row.get('fp8_weight_gbps', float('nan')):.0f}", _verdict(row["passed"])])  # fmt: skip
    report.results["fp8_gemm"] = results
    report.ok &= all(row["passed"] for row in results)
    report.table(["FP8 block GEMM (rows x N x K)", "relative error", "fp8 (us)", "bf16 (us)", "fp8 weight GB/s",
                  "verdict"], rows_out)  # fmt: skip


def _us(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def graphs_vs_eager(graphs: BuiltEngine, args: argparse.Namespace, report: Report) -> None:
    """Decode step time at batch 1 and 32 with CUDA graphs (the default) and with enforce_eager."""
    eager, _ = random_engine(args.shape, args.device, torch.bfloat16, args.kv_gib, enforce_eager=True)
    rows, results = [], []
    for batch in (1, 32):
        with_graphs = statistics.median(decode_step_times(graphs, batch, args.device, f"g{batch}")[2:])
        without = statistics.median(decode_step_times(eager, batch, args.device, f"e{batch}")[2:])
        results.append({"batch": batch, "graphs_ms": with_graphs * 1e3, "eager_ms": without * 1e3,
                        "speedup": without / with_graphs})  # fmt: skip
        rows.append([batch, f"{with_graphs * 1e3:.3f}", f"{without * 1e3:.3f}", f"{without / with_graphs:.2f}x"])
    del eager
    runner = graphs.core.runner.decode_graphs
    stats = runner.stats() if runner is not None else None
    report.results["graphs"] = {"steps": results, "stats": None if stats is None else {
        "capturing": stats.capturing, "captured": list(stats.captured), "capture_seconds": stats.capture_seconds}}  # fmt: skip
    report.table(["batch", "engine step, graphs (ms)", "engine step, enforce_eager (ms)", "speed-up"], rows)
    if stats is not None:
        report.lines += [f"CUDA graphs: capturing {stats.capturing}, buckets captured {list(stats.captured)}, "
                         f"{stats.capture_seconds:.2f} s of capture in all.", ""]  # fmt: skip


def copy_bandwidth_tbps(device: str) -> float | None:
    """A device-to-device copy's bytes read + written per second (the practical HBM ceiling)."""
    if not device.startswith("cuda"):
        return None
    src = torch.randn(2**30 // 4, device=device)  # 1 GiB of float32
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / 10
    return 2 * src.numel() * 4 / seconds / 1e12


# -- main ----------------------------------------------------------------------------------

SECTIONS = ("exactness", "kernels", "fp8", "syncs", "graphs", "roofline", "prefill", "offline")


def main() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling check modules
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shape", default="1b", choices=sorted(SHAPES))
    parser.add_argument("--hbm-tbps", type=float, default=H200_HBM_TBPS, help="HBM bandwidth for the roofline")
    parser.add_argument("--peak-tflops", type=float, default=H200_BF16_DENSE_TFLOPS, help="bf16 dense peak")
    parser.add_argument("--bf16-tol", type=float, default=0.1, help="nats; see the module doc")
    parser.add_argument("--batches", default="1,8,32,64,128")
    parser.add_argument("--kv-gib", type=float, default=16.0)
    parser.add_argument("--no-default-model", action="store_true", help="exactness on the tiny model only")
    parser.add_argument("--skip", default="", help=f"comma-separated, of: {', '.join(SECTIONS)}")
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    unknown = skip - set(SECTIONS)
    if unknown:
        parser.error(f"unknown --skip {sorted(unknown)}; valid: {', '.join(SECTIONS)}")
    device = args.device
    on_cuda = device.startswith("cuda")
    if not on_cuda:  # the Triton kernels run under the interpreter (read when triton is imported)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    name = torch.cuda.get_device_name(0) if on_cuda else "CPU"
    report = Report()
    report.results["environment"] = {"device": name, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M"),
                                     "triton": _version("triton"), "shape": args.shape}  # fmt: skip
    report.lines += [f"### {time.strftime('%Y-%m-%d %H:%M')} — {name}, torch {torch.__version__}, "
                     f"triton {_version('triton')}", ""]  # fmt: skip
    started = time.perf_counter()
    if "exactness" not in skip:
        exactness(device, args.bf16_tol, not args.no_default_model, report)
    if "kernels" not in skip:
        kernels(device, report)
    if "fp8" not in skip:
        fp8_gemm(device, report)
    if not {"syncs", "graphs", "roofline", "prefill", "offline"} <= skip:
        dtype = torch.bfloat16 if on_cuda else torch.float32
        built, weight_bytes = random_engine(args.shape, device, dtype, args.kv_gib)
        measured = copy_bandwidth_tbps(device)
        report.results["model"] = {"shape": args.shape, "dtype": str(dtype), "weight_bytes_per_step": weight_bytes,
                                   "copy_bandwidth_tbps": measured}  # fmt: skip
        report.lines += [f"Random-weight {args.shape} Llama, {dtype}, {weight_bytes / 1e9:.2f} GB of weights read "
                         f"per step; device copy bandwidth {measured or float('nan'):.2f} TB/s "
                         f"(roofline uses {args.hbm_tbps}).", ""]  # fmt: skip
        if "syncs" not in skip:
            host_syncs(built, device, report)
        if "graphs" not in skip and on_cuda:
            graphs_vs_eager(built, args, report)
        if "roofline" not in skip:
            decode_roofline(
                built, weight_bytes, device, args.hbm_tbps, [int(b) for b in args.batches.split(",")], report
            )
        if "prefill" not in skip:
            prefill_throughput(built, weight_bytes, device, args.peak_tflops, report)
        if "offline" not in skip:
            offline_throughput(built, report)
    report.results["seconds"] = time.perf_counter() - started
    report.results["passed"] = report.ok
    text = "\n".join(report.lines)
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_checks.md").write_text(text + "\n")
        Path(os.environ["OUT"], "gpu_checks.json").write_text(json.dumps(report.results, indent=2) + "\n")
    return 0 if report.ok else 1


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main())
