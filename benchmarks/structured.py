"""Structured outputs (issue 40): validity, decode speed, mask time, compile isolation.

    PYTHONPATH=src .venv/bin/python benchmarks/structured.py --out /tmp/structured
    PYTHONPATH=src .venv/bin/python benchmarks/structured.py --family llama3 --parts validity,speed,compile --out DIR

Families (--family): smollm2, the default model (49,152 tokens); llama3, a second family: Llama 3's
real tokenizer (128,256 tokens, from Meta's llama-models package: servelm.testing.llama3_tokenizer)
on a tiny random Llama. Its outputs are noise shaped by the grammar alone (temperature 1.0 over
random logits: every token the mask allows is in play), which tests the mask harder than a
trained model does; its decode steps are tiny, so of `speed` only the mask fill times speak for
a 128k vocabulary (the step ratio's target is the default model's).

Parts (--parts, default all):
  validity   every schema of structured_schemas.CORPUS, --samples seeds each, at temperature 1.0
             through the chat template: the share that parses and validates (target 100%)
  speed      decode step time with every request constrained vs none, at batch 8 and 32 (target
             <= 1.05x), and the mask fill time per step (p50 / p99)
  compile    compile time of each corpus schema and of large first-seen ones, per backend
  isolation  over HTTP: a free stream's token gaps while 20 requests with first-seen large schemas
             arrive, vs the same 20 with one already-compiled schema (target p99 <= 1.1x), and the
             TTFT a repeated schema adds (target <= 10 ms)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import jsonschema

sys.path.insert(0, str(Path(__file__).resolve().parent))
from structured_schemas import CORPUS, obj

from servelm.default_model import default_model_path
from servelm.engine.llm import LLM
from servelm.sampling_params import SamplingParams, StructuredSpec
from servelm.server.launcher import launch_server
from servelm.structured.backends import make_backend
from servelm.testing.llama3_tokenizer import llama3_tokenizer, write_llama3_tiny_checkpoint
from servelm.tokenization.loading import load_tokenizer

MODEL = "SmolLM2-135M-Instruct"
FAMILIES = ("smollm2", "llama3")


def family_model(family: str, scratch: Path) -> tuple[str | None, Any]:
    """(the model path for LLM, None for the default; its tokenizer) of a --family."""
    if family == "smollm2":
        return None, load_tokenizer(default_model_path())
    tokenizer = llama3_tokenizer()
    return str(write_llama3_tiny_checkpoint(scratch / "llama3-tiny", tokenizer=tokenizer)), tokenizer


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def json_spec(schema: Any) -> StructuredSpec:
    return StructuredSpec(kind="json", text=json.dumps(schema))


def large_schema(salt: int, num_fields: int = 40) -> dict[str, Any]:
    """A form of `num_fields` nested fields (enums, patterns, bounds), its names salted: first-seen."""
    fields = {}
    for i in range(num_fields):
        fields[f"f{salt}_{i}"] = obj({
            "code": {"type": "string", "pattern": f"^[A-Z]{{2}}{i % 10}-[0-9]{{{1 + i % 4}}}$"},
            "kind": {"enum": [f"k{salt}_{i}_{j}" for j in range(4)]},
            "value": {"type": ["number", "null"], "minimum": -i, "maximum": 1000 + i},
        })  # fmt: skip
    return obj(fields)


def validity(llm: LLM, samples: int) -> dict[str, Any]:
    prompts, params, schemas = [], [], []
    for name, prompt, schema in CORPUS:
        messages = [{"role": "user", "content": f"{prompt} Answer with the JSON arguments of {name}."}]
        for seed in range(samples):
            prompts.append({"prompt_token_ids": llm.chat_prompt(messages)})
            params.append(SamplingParams(temperature=1.0, seed=seed, max_tokens=256, structured=json_spec(schema)))
            schemas.append((name, schema))
    started = time.perf_counter()
    outputs = llm.generate(prompts, params)
    failures = []
    for (name, schema), output in zip(schemas, outputs):
        completion = output.outputs[0]
        try:
            jsonschema.validate(json.loads(completion.text), schema)
        except (ValueError, jsonschema.ValidationError) as exc:
            failures.append({"schema": name, "finish_reason": completion.finish_reason, "text": completion.text,
                             "error": str(exc)[:200]})  # fmt: skip
    total = len(outputs)
    return {"schemas": len(CORPUS), "samples": total, "valid": total - len(failures),
            "valid_share": (total - len(failures)) / total, "failures": failures,
            "seconds": time.perf_counter() - started}  # fmt: skip


def decode_steps(llm: LLM, batch: int, constrained: bool, max_tokens: int) -> list[float]:
    """Step times of a batch decoding together (prefill steps dropped)."""
    core = llm.engine.core
    times: list[float] = []
    real_step = core.step

    def timed_step() -> Any:
        started = time.perf_counter()
        outputs = real_step()
        times.append(time.perf_counter() - started)
        return outputs

    core.step = timed_step  # type: ignore[method-assign]
    try:
        # At least 100 integers: the array cannot close (and the request end) within max_tokens, so
        # both runs decode the same number of steps.
        spec = json_spec({"type": "array", "items": {"type": "integer"}, "minItems": 100}) if constrained else None
        params = SamplingParams(temperature=1.0, seed=0, max_tokens=max_tokens, ignore_eos=True, structured=spec)
        outputs = llm.generate([f"Numbers, list {i}:" for i in range(batch)], params)
        assert all(len(o.outputs[0].token_ids) == max_tokens for o in outputs), "a request ended early"
    finally:
        core.step = real_step  # type: ignore[method-assign]
    return times[3:]


def speed(llm: LLM, batches: list[int], rounds: int, max_tokens: int) -> dict[str, Any]:
    core = llm.engine.core
    results: dict[str, Any] = {}
    decode_steps(llm, 4, True, 8)  # the backend built, the grammar compiled
    for batch in batches:
        free: list[float] = []
        constrained: list[float] = []
        core.take_mask_fills()
        for _ in range(rounds):  # interleaved: a noisy host hits both alike
            free += decode_steps(llm, batch, False, max_tokens)
            constrained += decode_steps(llm, batch, True, max_tokens)
        fills = core.take_mask_fills()
        results[str(batch)] = {
            "free_step_p50_ms": 1e3 * statistics.median(free),
            "constrained_step_p50_ms": 1e3 * statistics.median(constrained),
            "ratio_p50": statistics.median(constrained) / statistics.median(free),
            "free_step_mean_ms": 1e3 * statistics.fmean(free),
            "constrained_step_mean_ms": 1e3 * statistics.fmean(constrained),
            "ratio_mean": statistics.fmean(constrained) / statistics.fmean(free),
            "mask_fill_p50_ms": 1e3 * percentile(fills, 0.5),
            "mask_fill_p99_ms": 1e3 * percentile(fills, 0.99),
            "mask_fill_per_row_p50_ms": 1e3 * percentile(fills, 0.5) / batch,
        }
    return results


def compile_times(tokenizer: Any, backends: list[str], num_large: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name in backends:
        started = time.perf_counter()
        backend = make_backend(name, tokenizer, len(tokenizer))
        built = time.perf_counter() - started
        corpus, errors = [], []
        for schema_name, _, schema in CORPUS:
            started = time.perf_counter()
            try:
                backend.compile(json_spec(schema)).matcher()
            except ValueError as exc:
                errors.append(f"{schema_name}: {str(exc)[:120]}")
            corpus.append(time.perf_counter() - started)
        large = []
        for salt in range(num_large):
            started = time.perf_counter()
            backend.compile(json_spec(large_schema(1000 + salt))).matcher()
            large.append(time.perf_counter() - started)
        results[name] = {"backend_build_s": built, "corpus_p50_ms": 1e3 * percentile(corpus, 0.5),
                         "corpus_max_ms": 1e3 * max(corpus), "large_p50_ms": 1e3 * percentile(large, 0.5),
                         "large_max_ms": 1e3 * max(large), "errors": errors}  # fmt: skip
    return results


def stream_gaps(base_url: str, max_tokens: int, started: threading.Event) -> list[float]:
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0.0, "stream": True}  # fmt: skip
    arrivals = []
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=300) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                arrivals.append(time.perf_counter())
                if len(arrivals) == 3:
                    started.set()
    return [b - a for a, b in zip(arrivals[1:], arrivals[2:])]


def constrained_burst(base_url: str, schemas: list[dict[str, Any]]) -> list[float]:
    def one(schema: dict[str, Any], out: list[float]) -> None:
        started = time.perf_counter()
        response = httpx.post(f"{base_url}/v1/chat/completions", timeout=300, json={
            "model": MODEL, "messages": [{"role": "user", "content": "Fill the form."}], "max_tokens": 2,
            "response_format": {"type": "json_schema", "json_schema": {"name": "form", "schema": schema}}})  # fmt: skip
        response.raise_for_status()
        out.append(time.perf_counter() - started)

    latencies: list[float] = []
    threads = [threading.Thread(target=one, args=(schema, latencies)) for schema in schemas]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return latencies


def isolation(num_schemas: int, stream_tokens: int) -> dict[str, Any]:
    server = launch_server(None, ["--max-num-seqs", "32"])
    try:
        base_url = server.base_url
        warm = large_schema(0)
        constrained_burst(base_url, [warm])  # both backends' tables built, this schema compiled

        def phase(schemas: list[dict[str, Any]] | None) -> dict[str, Any]:
            started = threading.Event()
            gaps: list[float] = []
            streamer = threading.Thread(target=lambda: gaps.extend(stream_gaps(base_url, stream_tokens, started)))
            streamer.start()
            started.wait(60)
            burst = constrained_burst(base_url, schemas) if schemas else []
            streamer.join()
            return {"gap_p50_ms": 1e3 * percentile(gaps, 0.5), "gap_p99_ms": 1e3 * percentile(gaps, 0.99),
                    "burst_latency_max_s": max(burst) if burst else 0.0}  # fmt: skip

        alone = phase(None)
        repeated = phase([warm] * num_schemas)
        first_seen = phase([large_schema(100 + i) for i in range(num_schemas)])
        ttft = {}
        for label, fmt in (("free", None), ("repeated_schema", warm)):
            times = []
            for _ in range(10):
                body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "Fill the form."}],
                                        "max_tokens": 1}  # fmt: skip
                if fmt is not None:
                    body["response_format"] = {"type": "json_schema", "json_schema": {"name": "form", "schema": fmt}}
                started_at = time.perf_counter()
                httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=60).raise_for_status()
                times.append(time.perf_counter() - started_at)
            ttft[label] = 1e3 * statistics.median(times)
        return {"alone": alone, "repeated_schema_burst": repeated, "first_seen_burst": first_seen,
                "gap_p99_first_seen_over_repeated": first_seen["gap_p99_ms"] / repeated["gap_p99_ms"],
                "gap_p99_first_seen_over_alone": first_seen["gap_p99_ms"] / alone["gap_p99_ms"],
                "ttft_median_ms": ttft, "repeated_schema_adds_ms": ttft["repeated_schema"] - ttft["free"]}  # fmt: skip
    finally:
        server.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--parts", default="validity,speed,compile,isolation")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--samples", type=int, default=4, help="validity: seeds per schema")
    parser.add_argument("--batches", default="8,32")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=48, help="speed: decode steps per run")
    parser.add_argument("--family", choices=FAMILIES, default="smollm2", help="the model family (module doc)")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    if args.family != "smollm2" and "isolation" in parts:
        parser.error("isolation serves the default model: run it with --family smollm2")
    args.out.mkdir(parents=True, exist_ok=True)
    model, tokenizer = family_model(args.family, args.out)
    results: dict[str, Any] = {"backend": args.backend, "family": args.family, "vocab": len(tokenizer)}
    if parts & {"validity", "speed"}:
        llm = LLM(model, max_num_seqs=max(int(b) for b in args.batches.split(",")),
                  structured_outputs_backend=args.backend)  # fmt: skip
        try:
            if "validity" in parts:
                results["validity"] = validity(llm, args.samples)
                print("validity", {k: v for k, v in results["validity"].items() if k != "failures"}, flush=True)
            if "speed" in parts:
                results["speed"] = speed(llm, [int(b) for b in args.batches.split(",")], args.rounds, args.max_tokens)
                print("speed", results["speed"], flush=True)
        finally:
            llm.shutdown()
    if "compile" in parts:
        results["compile"] = compile_times(tokenizer, ["guidance", "xgrammar"], 5)
        print("compile", results["compile"], flush=True)
    if "isolation" in parts:
        results["isolation"] = isolation(20, 150)
        print("isolation", results["isolation"], flush=True)
    (args.out / "structured.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
