"""benchmarks/speculative.py's pure parts: the workloads it sends and the arithmetic of its tables
(no servers here; the script itself is run by hand, see its docstring)."""

from __future__ import annotations

from pathlib import Path

import pytest

from servelm.bench.tokens import load_token_source
from servelm.testing.benchmark_script import load_benchmark_script

ROOT = Path(__file__).resolve().parents[2]


bench = load_benchmark_script(ROOT / "benchmarks" / "speculative.py", "speculative_bench")


@pytest.fixture(scope="module")
def tokens():
    return load_token_source(None)  # the default model's tokenizer, as the script uses


@pytest.fixture(scope="module")
def count_tokens(tokens):
    return tokens.count


def test_code_edit_requests_carry_whole_real_files_and_are_seeded(count_tokens):
    files = bench.pick_source_files(ROOT, count_tokens, 4, (1000, 3000), seed=3)
    requests = bench.code_edit_requests(files, max_tokens=1024, seed=3)
    assert len(requests) == 4 and len({f.path for f in files}) == 4
    for request, source in zip(requests, files):
        assert 1000 <= source.num_tokens <= 3000 and source.text == (ROOT / source.path).read_text()
        assert request.messages is not None and request.messages[-1]["role"] == "user"
        task = request.messages[-1]["content"]
        assert task.startswith(f"```python\n{source.text}```") and request.max_tokens == 1024
        renamed = task.split("with the function `")[1].split("`")[0]
        assert f"def {renamed}(" in source.text and f"`{renamed}_renamed`" in task
    again = bench.code_edit_requests(bench.pick_source_files(ROOT, count_tokens, 4, (1000, 3000), seed=3), 1024, 3)
    assert [r.messages for r in again] == [r.messages for r in requests]
    other = bench.pick_source_files(ROOT, count_tokens, 4, (1000, 3000), seed=4)
    assert [f.path for f in other] != [f.path for f in files]


def test_too_few_files_of_the_size_is_an_error(count_tokens):
    with pytest.raises(ValueError, match="only"):
        bench.pick_source_files(ROOT, count_tokens, 3, (10**6, 10**7), seed=0)


def test_chat_requests_count_cap_and_salt(tokens):
    first = bench.chat_requests(tokens, 12, max_tokens=64, seed=0, salt=0)
    assert len(first) == 12 and all(1 <= r.max_tokens <= 64 for r in first)
    assert [r.prompt_text for r in bench.chat_requests(tokens, 12, 64, 0, 0)] == [r.prompt_text for r in first]
    salted = bench.chat_requests(tokens, 12, 64, 0, 1)  # the next concurrency level: same lengths, new words
    assert [r.max_tokens for r in salted] == [r.max_tokens for r in first]
    assert all(a.prompt_text != b.prompt_text for a, b in zip(salted, first))


METRICS = """\
# HELP servelm:spec_decode_num_drafts_total Speculative decoding: request-steps that verified draft tokens.
# TYPE servelm:spec_decode_num_drafts_total counter
servelm:spec_decode_num_drafts_total{model_name="m"} 10.0
# TYPE servelm:spec_decode_num_draft_tokens_total counter
servelm:spec_decode_num_draft_tokens_total{model_name="m"} 40.0
# TYPE servelm:spec_decode_num_accepted_tokens_total counter
servelm:spec_decode_num_accepted_tokens_total{model_name="m"} 25.0
# TYPE servelm:spec_decode_num_accepted_tokens_per_pos_total counter
servelm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 9.0
servelm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 7.0
servelm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="2"} 5.0
servelm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="3"} 4.0
# TYPE servelm:num_preemptions_total counter
servelm:num_preemptions_total{model_name="m"} 3.0
"""


def test_spec_counters_parse_and_derive_vllms_figures():
    after = bench.parse_spec_counters(METRICS)
    assert (after.num_drafts, after.num_draft_tokens, after.num_accepted_tokens) == (10, 40, 25)
    assert after.accepted_per_position == [9, 7, 5, 4]
    before = bench.parse_spec_counters(METRICS.replace(" 10.0", " 5.0").replace(" 40.0", " 20.0")
                                       .replace(" 25.0", " 15.0").replace('"0"} 9.0', '"0"} 4.0'))  # fmt: skip
    run = after.minus(before).summary()
    assert run["acceptance_rate"] == pytest.approx(10 / 20)
    assert run["mean_acceptance_length"] == pytest.approx(1 + 10 / 5)
    assert run["per_position_rate"] == pytest.approx([5 / 5, 0, 0, 0])
    vllm = bench.parse_spec_counters(METRICS.replace("servelm:", "vllm:"))
    assert vllm.num_accepted_tokens == 25 and vllm.accepted_per_position == [9, 7, 5, 4]
    nothing = bench.parse_spec_counters("").summary()
    assert nothing["acceptance_rate"] is None and nothing["per_position_rate"] == []


def _measurement(tok_s: float, texts: list[str | None], accepted: float = 0.0) -> object:
    spec = bench.SpecCounters(num_drafts=4.0 if accepted else 0.0, num_draft_tokens=8.0 if accepted else 0.0,
                              num_accepted_tokens=accepted, accepted_per_position=[accepted] if accepted else [])  # fmt: skip
    return bench.Measurement(num_requests=len(texts), num_ok=len(texts), num_output_tokens=100, duration_s=1.0,
                             output_tok_s=tok_s, tpot_mean_s=0.02, spec=spec.summary(), output_texts=texts)  # fmt: skip


def test_code_table_ratios_identity_and_acceptance():
    table = bench.code_table({
        "servelm": _measurement(20.0, ["a", "b", "c"]),
        "servelm-ngram": _measurement(50.0, ["a", "x", "c"], accepted=4.0),
        "vllm-ngram": _measurement(30.0, ["p", "q", "r"], accepted=2.0),
    })  # fmt: skip
    rows = {line.split(" | ")[0].lstrip("| "): line for line in table.splitlines()[2:]}
    assert "| 20.0 | 1.00x |" in rows["servelm"] and "| 50.0 | 2.50x |" in rows["servelm-ngram"]
    assert "| 2/3 |" in rows["servelm-ngram"] and "| 1.50x |" in rows["vllm-ngram"]
    assert "50.0% (len 2.00; by position 1.00)" in rows["servelm-ngram"]
    assert "| — |" in rows["vllm-ngram"]  # vLLM's text is not compared (other weights' precision)


def test_identical_outputs_counts_a_failed_request_as_different():
    assert bench.identical_outputs(["a", None, "c"], ["a", None, "d"]) == [True, False, False]
    with pytest.raises(ValueError):
        bench.identical_outputs(["a"], ["a", "b"])


def test_chat_table_ratio_per_concurrency():
    table = bench.chat_table({
        "servelm": {1: _measurement(10.0, ["a"]), 8: _measurement(40.0, ["a"])},
        "servelm-ngram": {1: _measurement(15.0, ["a"], accepted=1.0), 8: _measurement(38.0, ["a"], accepted=1.0)},
    })  # fmt: skip
    lines = table.splitlines()[2:]
    assert [line.split(" | ")[:2] for line in lines] == [["| 1", "servelm"], ["| 1", "servelm-ngram"],
                                                         ["| 8", "servelm"], ["| 8", "servelm-ngram"]]  # fmt: skip
    assert "| 15.0 | 1.50x |" in lines[1] and "| 38.0 | 0.95x |" in lines[3]
