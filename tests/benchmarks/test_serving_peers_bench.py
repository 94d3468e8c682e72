"""benchmarks/serving_peers.py's pure parts: the requests every system is sent, and the tables
built from a report (no servers here; the script itself is run by hand, see its docstring)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from servelm.bench.client import ClientConfig, RequestRecord, request_body, send_request
from servelm.bench.stats import summarize_group
from servelm.bench.tokens import load_token_source
from servelm.bench.workload import WorkloadRequest
from servelm.testing.benchmark_script import load_benchmark_script

ROOT = Path(__file__).resolve().parents[2]

bench = load_benchmark_script(ROOT / "benchmarks" / "serving_peers.py", "serving_peers_bench")


@pytest.fixture(scope="module")
def tokens():
    return load_token_source(None)  # the default model's tokenizer, as the script uses


def test_requests_have_the_issues_lengths_and_are_seeded(tokens):
    built = {w.name: bench.build_requests(w, 12, tokens, seed=0) for w in bench.WORKLOADS}
    assert {(r.num_prompt_tokens, r.max_tokens) for r in built["single"]} == {(128, 128)}
    for name in ("poisson", "chat8"):
        assert all(100 <= r.num_prompt_tokens <= 400 and 64 <= r.max_tokens <= 128 for r in built[name])
        assert len({r.num_prompt_tokens for r in built[name]}) > 6  # drawn, not one length
    assert {(r.num_prompt_tokens, r.max_tokens) for r in built["long"]} == {(3000, 8)}
    prefix = built["prefix"]
    assert {(r.num_prompt_tokens, r.max_tokens) for r in prefix} == {(1050, 32)}
    assert len({tuple(r.prompt_ids[:1000]) for r in prefix}) == 1  # one shared prefix
    assert len({tuple(r.prompt_ids[1000:]) for r in prefix}) == 12  # each its own tail
    assert {r.traffic_class for r in built["mixed"]} <= {"voice", "code", "analytics", "chat"}
    # Open loop where the issue says Poisson: arrival times set; closed loop otherwise.
    assert all(r.arrival_s is not None for r in built["poisson"] + built["mixed"])
    assert all(r.arrival_s is None for r in built["chat8"] + built["prefix"])
    # Every workload its own words: no workload's prompts sit in a cache that an earlier one filled.
    firsts = [tuple(rs[0].prompt_ids[:16]) for rs in built.values()]
    assert len(set(firsts)) == len(firsts)
    again = bench.build_requests(bench.workload_of("poisson"), 12, tokens, seed=0)
    assert [r.prompt_text for r in again] == [r.prompt_text for r in built["poisson"]]
    assert [r.arrival_s for r in again] == [r.arrival_s for r in built["poisson"]]


def test_min_tokens_goes_out_only_when_asked():
    request = WorkloadRequest(index=0, traffic_class="single", prompt_ids=[], num_prompt_tokens=3, max_tokens=77,
                              prompt_text=" a b")  # fmt: skip
    assert "min_tokens" not in request_body(ClientConfig(base_url="http://x"), request)
    body = request_body(ClientConfig(base_url="http://x", send_min_tokens=True), request)
    assert body["min_tokens"] == 77 and body["ignore_eos"] is True


def _peer_stream(finish_reason: str) -> httpx.MockTransport:
    """An OpenAI-compatible server whose stream carries no usage (as llama-cpp-python's): two
    chunks, " the" and "re", which re-tokenize as one token (" there")."""
    chunks = [{"choices": [{"text": " the", "finish_reason": None}]},
              {"choices": [{"text": "re", "finish_reason": finish_reason}]}]  # fmt: skip
    body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    return httpx.MockTransport(lambda _: httpx.Response(200, text=body, headers={"content-type": "text/event-stream"}))


@pytest.mark.parametrize(("finish_reason", "expected"), [("length", 2), ("stop", 1)])
def test_a_stream_without_usage_that_ended_for_length_counts_max_tokens(tokens, finish_reason, expected):
    assert tokens.count(" there") == 1  # what re-tokenizing the text would say
    request = WorkloadRequest(index=0, traffic_class="x", prompt_ids=[], num_prompt_tokens=2, max_tokens=2,
                              prompt_text=" a b")  # fmt: skip
    record = RequestRecord(index=0, traffic_class="x", priority=0, session_id=None, max_tokens=2,
                           expected_prompt_tokens=2, shared_prefix_tokens=0, scheduled_s=0.0)  # fmt: skip

    async def send() -> None:
        async with httpx.AsyncClient(base_url="http://peer", transport=_peer_stream(finish_reason)) as http:
            await send_request(http, ClientConfig(base_url="http://peer"), request, record, time.perf_counter, tokens)

    asyncio.run(send())
    assert record.ok and record.token_source == "tokenizer" and len(record.chunk_times_s) == 2
    assert record.num_output_tokens == expected


def _measured(ttft_s: float, gap_s: float, num: int, duration_s: float, ok: int | None = None) -> dict[str, Any]:
    """What run_system records for one workload, from real records of `num` requests of
    10 tokens each (each with the given TTFT and inter-token gap); the last ones fail past `ok`."""
    records = []
    for index in range(num):
        record = RequestRecord(index=index, traffic_class="w", priority=0, session_id=None, max_tokens=10,
                               expected_prompt_tokens=5, shared_prefix_tokens=0, scheduled_s=0.0, sent_s=0.0)  # fmt: skip
        if ok is not None and index >= ok:
            record.status, record.error, record.end_s = "error", "HTTP 500", 1.0
        else:
            record.first_token_s = ttft_s
            record.chunk_times_s = [ttft_s + i * gap_s for i in range(10)]
            record.end_s = record.chunk_times_s[-1]
            record.status, record.num_prompt_tokens, record.num_output_tokens = "ok", 5, 10
        records.append(record)
    summary = summarize_group("overall", records, lambda _: None, duration_s).to_dict()
    return {"summary": summary, "duration_s": duration_s, "num_not_sent": 0, "hit_time_limit": False,
            "expected_output_tokens": 10 * (ok if ok is not None else num), "token_sources": ["usage"]}  # fmt: skip


def _system(workloads: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {"settings": "s", "load_at_start": 0.5, "startup_s": 3.0, "wall_s": 60.0, "workloads": workloads,
            "sanity": {"greeting": "q", "answer": "Paris", "prompt_tokens": [{"expected": 128, "counted": 128}]}}  # fmt: skip


def _cells(line: str) -> list[str]:
    """A Markdown table row's cells ([] for any other line)."""
    return [cell.strip() for cell in line.strip()[1:-1].split(" | ")] if line.startswith("| ") else []


def test_tables_put_systems_side_by_side_with_ratios_and_targets():
    report = {
        "config": {"seed": 0, "duration_s": 1200.0, "smoke": False},
        "requests": {"single": 4, "chat8": 4},
        "systems": {
            "servelm": _system({"single": _measured(0.2, 0.030, 4, 10.0), "chat8": _measured(1.0, 0.050, 4, 2.0)}),
            "vllm": _system({"single": _measured(0.4, 0.045, 4, 10.0), "chat8": _measured(2.0, 0.200, 4, 4.0, ok=3)}),
            "llama.cpp": {"error": "no llama-cpp-python at /x (run benchmarks/llama_cpp/setup.sh)"},
        },
    }
    text = bench.markdown(report)
    rows = {cells[0]: cells for cells in map(_cells, text.splitlines()) if cells}
    single = rows["single stream, 128-token prompt → 128 tokens (4)"]
    assert single[1] == "TTFT p50 200 ms, TBT p50 30.0 ms" and single[2] == "TTFT p50 400 ms, TBT p50 45.0 ms"
    assert single[3] == "not run" and single[4] == "0.50x, 0.67x" and single[5] == "—"
    chat8 = rows["chat, 8 in flight, prompts 100-400, outputs 64-128 (4)"]
    assert chat8[1].startswith("output tok/s 20.0 tok/s") and chat8[2].endswith("(ok 3/4)")
    assert chat8[4].startswith("2.67x")  # 40 tokens in 2 s against 30 in 4 s
    targets = {name: row for name, row in rows.items() if name.startswith(("single:", "chat8:", "long:"))}
    assert targets["single: TTFT p50 ≤ 0.7x vllm's"][3:5] == ["0.50x", "yes"]
    assert targets["chat8: output tok/s ≥ 1.5x vllm's"][4] == "yes"
    assert targets["chat8: TBT p99 ≤ 0.5x vllm's"][3:5] == ["0.25x", "yes"]
    assert targets["single: TBT p50 ≤ 1x llama.cpp's"][4].startswith("not measured")
    assert targets["long: TTFT p50 ≤ 0.6x vllm's"][4].startswith("not measured")
    assert "- llama.cpp: not run (no llama-cpp-python at /x" in text
    assert "Greedy answer to 'q': 'Paris'" in text


def test_a_target_missed_says_so():
    report = {
        "config": {"seed": 0, "duration_s": 1200.0, "smoke": False},
        "requests": {"single": 2},
        "systems": {"servelm": _system({"single": _measured(0.5, 0.030, 2, 5.0)}),
                    "vllm": _system({"single": _measured(0.5, 0.045, 2, 5.0)})},
    }  # fmt: skip
    rows = {cells[0]: cells for cells in map(_cells, bench.targets_table(report).splitlines()) if cells}
    assert rows["single: TTFT p50 ≤ 0.7x vllm's"][3:] == ["1.00x", "**no**"]
    assert rows["single: TBT p50 ≤ 1x llama.cpp's"][4] == "not measured"  # no llama.cpp in this report


def test_interleaved_order_rotates_the_systems_and_says_how_each_started():
    assert [bench.rotated(["servelm", "vllm", "llama.cpp"], turn) for turn in range(4)] == [
        ["servelm", "vllm", "llama.cpp"], ["vllm", "llama.cpp", "servelm"], ["llama.cpp", "servelm", "vllm"],
        ["servelm", "vllm", "llama.cpp"],
    ]  # fmt: skip
    start = {"startup_s": 9.0, "load_at_start": 0.25, "started_unix": 0.0}
    servelm = _system({"single": {**_measured(0.2, 0.03, 2, 5.0), "start": start},
                       "long": {**_measured(4.0, 0.1, 2, 9.0), "start": {**start, "startup_s": 12.0}}})  # fmt: skip
    report = {
        "config": {"seed": 0, "duration_s": 1200.0, "smoke": False, "order": "workload"},
        "requests": {"single": 2, "long": 2},
        "systems": {"servelm": servelm,
                    "vllm": {**_system({"single": _measured(0.5, 0.04, 2, 5.0)}), "error": "vllm died: OOM"}},
    }  # fmt: skip
    text = bench.markdown(report)
    assert "each system in turn on a fresh server" in text
    assert "A fresh server per workload (2 starts, up in 9-12 s, load average 0.25-0.25 at the starts)" in text
    assert "- vllm: stopped (" in text  # its rows so far stay in the table
    assert _cells([line for line in text.splitlines() if line.startswith("| single stream")][0])[3] == "0.40x, 0.75x"


def test_skip_option_names_system_and_workload():
    assert bench.parse_skip("llama.cpp:poisson,llama.cpp:mixed", ["servelm", "llama.cpp"]) == {
        ("llama.cpp", "poisson"), ("llama.cpp", "mixed")}  # fmt: skip
    with pytest.raises(SystemExit, match="SYSTEM:WORKLOAD"):
        bench.parse_skip("llama.cpp:nope", ["llama.cpp"])


def test_requests_option_overrides_and_drops():
    counts = bench.parse_requests("single=3,mixed=0", bench.REQUESTS)
    assert counts["single"] == 3 and "mixed" not in counts and counts["poisson"] == bench.REQUESTS["poisson"]
    with pytest.raises(SystemExit, match="NAME=COUNT"):
        bench.parse_requests("nope=3", bench.REQUESTS)


def test_sigterm_unwinds_a_benchmark_so_its_servers_stop(tmp_path: Path):
    """`timeout` or `kill` on a benchmark: every `with` block on the way out runs its exit (where a
    server is stopped), and the process ends with 128 + SIGTERM."""
    import signal
    import subprocess
    import sys

    stopped = tmp_path / "stopped"
    script = f"""
import contextlib, sys, time
sys.path.insert(0, {str(ROOT / "benchmarks")!r})
from peer_servers import stop_servers_on_sigterm
stop_servers_on_sigterm()

@contextlib.contextmanager
def server():
    try:
        yield
    finally:
        open({str(stopped)!r}, "w").write("stopped")

with server():
    print("serving", flush=True)
    time.sleep(60)
"""
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stdout.readline().strip() == "serving"
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 128 + signal.SIGTERM
    assert stopped.read_text() == "stopped"
