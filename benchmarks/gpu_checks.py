"""The GPU checks of the engine issue, in one prepared run for a lent device (or a CPU smoke run).

    1. exactness  the tiny random Llama through the real engine (batching, paging, chunked
                  prefill) on the device, against transformers on the same device:
                  float32 — greedy tokens identical, prompt logits within 1e-4 relative;
                  bfloat16 — every token servelm picks is within `--bf16-tol` nats of the
                  float32 reference's best choice at that position (bf16 may break near-ties).
    2. roofline   a random-weight Llama of a 1B-class shape (Llama-3.2-1B: hidden 2048,
                  16 layers, 32/8 heads, intermediate 8192, vocab 128256) in bfloat16: decode
                  step time at several batch sizes against the HBM roofline, i.e. (weight bytes
                  + KV bytes read per step) / `--hbm-tbps`.
    3. offline    the offline workload of benchmarks/offline_throughput.py (64 prompts of
                  128-512 tokens, 128 output tokens each) on that model: total tokens/s.

    python benchmarks/gpu_checks.py                                   # CUDA, everything (~2-4 min on an H200)
    python benchmarks/gpu_checks.py --device cpu --shape tiny         # the CPU smoke run the tests use

Writes a markdown report to stdout and, if $OUT is set (the device tool), to $OUT/gpu_checks.md.
Exit status 1 if an exactness check fails.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

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


# -- 1. exactness --------------------------------------------------------------------------


def exactness(device: str, bf16_tol: float, lines: list[str]) -> bool:
    import transformers

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_tiny_checkpoint(Path(tmp) / "tiny", seed=0)
        reference = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device)
        reference.eval()
        rng = random.Random(0)
        vocab = reference.config.vocab_size
        prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (5, 40, 300, 700)]
        max_tokens = 24
        expected = [_hf_greedy(reference, p, max_tokens, device) for p in prompts]

        ok = True
        # Small budget and pool: chunked prefill, paging and batching all take part.
        engine_flags = {"device": device, "num_blocks": 256, "max_num_batched_tokens": 256}
        llm = LLM(model=str(model_dir), dtype="float32", **engine_flags)
        greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        same = sum(g == e for g, e in zip(got, expected))
        worst = _max_relative_logit_error(llm, reference, prompts, device)
        fp32_ok = same == len(prompts) and worst <= 1e-4
        ok &= fp32_ok
        lines.append(f"| float32 | greedy tokens identical for {same}/{len(prompts)} prompts (lengths 5-700, "
                     f"{max_tokens} tokens each); prompt logits max relative error {worst:.2e} (limit 1e-4) | "
                     f"{'PASS' if fp32_ok else 'FAIL'} |")  # fmt: skip
        del llm

        llm = LLM(model=str(model_dir), dtype="bfloat16", **engine_flags)
        outputs = llm.generate(prompts, greedy)
        worst_gap, identical = 0.0, 0
        for prompt, output, exp in zip(prompts, outputs, expected):
            tokens = output.outputs[0].token_ids
            identical += tokens == exp
            worst_gap = max(worst_gap, _reference_regret(reference, prompt, tokens, device))
        bf16_ok = worst_gap <= bf16_tol
        ok &= bf16_ok
        lines.append(f"| bfloat16 | {identical}/{len(prompts)} prompts token-identical to float32; largest "
                     f"float32-logprob gap between servelm's pick and the best token {worst_gap:.3f} nats "
                     f"(limit {bf16_tol}) | {'PASS' if bf16_ok else 'FAIL'} |")  # fmt: skip
        return ok


def _hf_greedy(model, prompt: list[int], max_tokens: int, device: str) -> list[int]:
    ids = torch.tensor([prompt], device=device)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False, min_new_tokens=max_tokens,
                             attention_mask=torch.ones_like(ids))  # fmt: skip
    return out[0, len(prompt):].tolist()


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


# -- 2./3. a random-weight model of a real shape ----------------------------------------


def random_engine(shape: str, device: str, dtype: torch.dtype, kv_gib: float) -> tuple[BuiltEngine, int]:
    config = {"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
              "hidden_act": "silu", **SHAPES[shape]}  # fmt: skip
    arch = ModelArchConfig.from_hf_config(config)
    generator = torch.Generator(device=device).manual_seed(0)
    weights = {}
    for name, size in expected_weight_shapes(arch).items():
        if len(size) == 1:  # norm weights: near 1 so activations stay sane
            weights[name] = torch.ones(size, dtype=dtype, device=device)
        else:
            weights[name] = (torch.randn(size, generator=generator, device=device, dtype=torch.float32) * 0.02).to(dtype)
    # Bytes a decode step reads: every weight once, except an untied embedding table (only the
    # batch's rows of it are read; tied, it is read whole as the lm_head).
    weight_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    if not arch.tie_word_embeddings:
        embedding = weights["model.embed_tokens.weight"]
        weight_bytes -= embedding.numel() * embedding.element_size()
    model = build_model(arch, weights, dtype, device)
    del weights
    engine_config = EngineConfig.from_flat(model=None, device=device, kv_cache_memory_gib=kv_gib, max_num_seqs=256,
                                           max_num_batched_tokens=8192)  # fmt: skip
    return assemble_engine(engine_config, model, arch, load_tokenizer(None), f"random {shape}"), weight_bytes


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def decode_roofline(built: BuiltEngine, weight_bytes: int, device: str, hbm_tbps: float, batches: list[int],
                    lines: list[str]) -> None:  # fmt: skip
    arch, core = built.arch, built.core
    rng = random.Random(1)
    prompt_len, steps = 128, 32
    kv_bytes_per_token = arch.num_hidden_layers * 2 * arch.num_key_value_heads * arch.head_dim * 2  # bf16 K and V
    for batch in batches:
        for i in range(batch):
            prompt = [rng.randrange(arch.vocab_size) for _ in range(prompt_len)]
            params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
            core.add_request(EngineRequest(request_id=f"d{batch}-{i}", prompt_token_ids=prompt, sampling_params=params))
        times: list[float] = []
        while core.has_work():
            _sync(device)
            started = time.perf_counter()
            running_before = core.scheduler.num_running
            outputs = core.step()
            _sync(device)
            if running_before == batch and all(o.new_token_ids for o in outputs) and len(outputs) == batch:
                times.append(time.perf_counter() - started)
        step_s = statistics.median(times[2:]) if len(times) > 4 else float("nan")
        context = prompt_len + steps / 2
        bytes_read = weight_bytes + batch * context * kv_bytes_per_token
        roofline_s = bytes_read / (hbm_tbps * 1e12)
        lines.append(f"| {batch} | {step_s * 1000:.2f} | {batch / step_s:.0f} | {bytes_read / 1e9:.2f} | "
                     f"{roofline_s * 1000:.3f} | {100 * roofline_s / step_s:.0f}% |")  # fmt: skip


def offline_throughput(built: BuiltEngine, lines: list[str]) -> None:
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
    lines.append(f"64 prompts ({prompt_tokens} tokens), {produced} output tokens in {seconds:.2f} s: "
                 f"{prompt_tokens / seconds:.0f} prompt + {produced / seconds:.0f} output = "
                 f"**{(prompt_tokens + produced) / seconds:.0f} total tokens/s**.")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shape", default="1b", choices=sorted(SHAPES))
    parser.add_argument("--hbm-tbps", type=float, default=4.8, help="HBM bandwidth for the roofline (H200: 4.8)")
    parser.add_argument("--bf16-tol", type=float, default=0.1, help="nats; see the module doc")
    parser.add_argument("--batches", default="1,8,32,64,128")
    parser.add_argument("--kv-gib", type=float, default=16.0)
    parser.add_argument("--skip", default="", help="comma-separated: exactness, roofline, offline")
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    device = args.device
    name = torch.cuda.get_device_name(0) if device.startswith("cuda") else "CPU"
    lines = [f"### {time.strftime('%Y-%m-%d %H:%M')} — {name}, torch {torch.__version__}", ""]
    ok = True
    if "exactness" not in skip:
        lines += ["| dtype | exactness vs transformers on the same device | verdict |", "|---|---|---|"]
        ok = exactness(device, args.bf16_tol, lines)
        lines.append("")
    if not {"roofline", "offline"} <= skip:
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        built, weight_bytes = random_engine(args.shape, device, dtype, args.kv_gib)
        lines.append(f"Random-weight {args.shape} Llama, {dtype}, {weight_bytes / 1e9:.2f} GB of weights read per step.")
        lines.append("")
        if "roofline" not in skip:
            lines += ["| batch | decode step (ms) | tokens/s | bytes read per step (GB) | roofline (ms) | % of roofline |",
                      "|---|---|---|---|---|---|"]  # fmt: skip
            decode_roofline(built, weight_bytes, device, args.hbm_tbps, [int(b) for b in args.batches.split(",")], lines)
            lines.append("")
        if "offline" not in skip:
            offline_throughput(built, lines)
            lines.append("")
    report = "\n".join(lines)
    print(report)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_checks.md").write_text(report + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
