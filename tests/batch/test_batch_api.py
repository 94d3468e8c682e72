"""The Files and Batch APIs over real HTTP with the unmodified openai client: `servelm serve` on
the tiny model with two tenants, its batches kept under a --data-dir of the test's own.

Every batch's output is checked against the same requests sent directly (greedy: the batching
of lines must not change a token); bad lines go to the error file while the rest run; a bad
batch fails validation in OpenAI's shape; cancel keeps the partial output; a window that runs
out expires the lines not run; a tenant never sees another's files or batches.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import openai
import pytest

from servelm.server.launcher import launch_server

KEYS = {"analytics": "sk-analytics-1", "other": "sk-other-1"}
TENANTS = f"""
tenants:
  analytics: {{api_keys: [{KEYS["analytics"]}], class: interactive}}
  other: {{api_keys: [{KEYS["other"]}], class: interactive}}
"""
SERVER_ARGS = ["--num-blocks", "1024", "--max-num-seqs", "32", "--num-threads", "1", "--max-batch-file-mb", "0.25"]
DONE = ("completed", "failed", "expired", "cancelled")


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    directory = tmp_path_factory.mktemp("batch-server")
    (directory / "tenants.yaml").write_text(TENANTS)
    args = [*SERVER_ARGS, "--tenants", str(directory / "tenants.yaml"), "--data-dir", str(directory / "data")]
    process = launch_server(tiny_model_dir, args)
    yield process
    assert process.stop() == 0, process.log_tail()


def client_for(server, tenant: str = "analytics") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEYS[tenant], max_retries=0, timeout=60)


def line(custom_id: str, prompt: str, max_tokens: int = 8, url: str = "/v1/completions", **extra) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra}
    if url == "/v1/chat/completions":
        body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, **extra}  # fmt: skip
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def upload(client: openai.OpenAI, tmp_path: Path, lines: list[dict | str]) -> str:
    path = tmp_path / f"input-{time.monotonic_ns()}.jsonl"
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    with path.open("rb") as f:
        return client.files.create(file=f, purpose="batch").id


def wait_done(client: openai.OpenAI, batch_id: str, timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in DONE:
            return batch
        time.sleep(0.2)
    raise AssertionError(f"batch {batch_id} not done after {timeout_s} s: {batch}")


def read_lines(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


def direct_text(server, body: dict, url: str) -> str:
    reply = httpx.post(f"{server.base_url}{url}", json=body, headers={"Authorization": f"Bearer {KEYS['analytics']}"},
                       timeout=60).json()  # fmt: skip
    choice = reply["choices"][0]
    return choice["text"] if url == "/v1/completions" else choice["message"]["content"]


@pytest.mark.parametrize("url", ["/v1/completions", "/v1/chat/completions"])
def test_lifecycle_outputs_equal_direct_requests_and_bad_lines_go_to_the_error_file(server, tmp_path, url):
    client = client_for(server)
    good = [line(f"req-{i}", f"Document {i}: the quick brown fox " * (1 + i % 3), max_tokens=4 + i % 5, url=url) for i in range(12)]
    bad_body = line("bad-body", "x", url=url)
    bad_body["body"]["max_tokens"] = -1
    file_id = upload(client, tmp_path, [*good[:6], "{not json", bad_body, *good[6:]])
    batch = client.batches.create(input_file_id=file_id, endpoint=url, completion_window="24h", metadata={"job": "t1"})
    assert batch.status == "validating" and batch.metadata == {"job": "t1"} and batch.endpoint == url
    batch = wait_done(client, batch.id)
    assert batch.status == "completed", batch
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (14, 12, 2)
    assert batch.in_progress_at and batch.finalizing_at and batch.completed_at and batch.expires_at == batch.created_at + 86400
    assert batch.usage.output_tokens == sum(item["body"]["max_tokens"] for item in good)  # the error lines used none
    assert batch.usage.input_tokens > 12 and batch.usage.total_tokens == batch.usage.input_tokens + batch.usage.output_tokens
    outputs = read_lines(client, batch.output_file_id)
    assert [o["custom_id"] for o in outputs] == [g["custom_id"] for g in good]  # input order, each once
    for item, output in zip(good, outputs, strict=True):
        response = output["response"]
        assert response["status_code"] == 200 and output["error"] is None and output["id"].startswith("batch_req_")
        assert response["request_id"] == response["body"]["id"]
        choice = response["body"]["choices"][0]
        text = choice["text"] if url == "/v1/completions" else choice["message"]["content"]
        assert text == direct_text(server, item["body"], url), item["custom_id"]
        assert response["body"]["usage"]["completion_tokens"] == item["body"]["max_tokens"]
    errors = read_lines(client, batch.error_file_id)
    assert [e["custom_id"] for e in errors] == [None, "bad-body"]
    assert errors[0]["error"]["code"] == "invalid_json" and errors[0]["response"] is None
    assert errors[1]["response"]["status_code"] == 400 and errors[1]["response"]["body"]["error"]["param"] == "max_tokens"
    assert batch.id in [b.id for b in client.batches.list(limit=100).data]
    metrics = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    [finished] = [line for line in metrics.splitlines()
                  if line.startswith("servelm:batch_lines_finished_total{") and 'file="output"' in line]  # fmt: skip
    assert float(finished.rsplit(" ", 1)[1]) >= 12, metrics
    assert "servelm:batch_lines_allowed{" in metrics and "servelm:batch_lines_in_flight{" in metrics
    output_file = client.files.retrieve(batch.output_file_id)
    assert output_file.purpose == "batch_output" and output_file.bytes == len(client.files.content(batch.output_file_id).content)


@pytest.mark.parametrize(
    ("lines", "code", "line_no"),
    [
        ([line("a", "x"), line("b", "y"), line("a", "z")], "duplicate_custom_id", 3),
        ([line("a", "x"), line("b", "y", url="/v1/chat/completions")], "mismatched_url", 2),
        ([{"method": "POST", "url": "/v1/completions", "body": {}}], "missing_required_parameter", 1),
        (["", "  "], "empty_file", None),
    ],
)
def test_a_bad_input_file_fails_the_batch_at_validation(server, tmp_path, lines, code, line_no):
    client = client_for(server)
    batch = client.batches.create(input_file_id=upload(client, tmp_path, lines), endpoint="/v1/completions",
                                  completion_window="24h")  # fmt: skip
    batch = wait_done(client, batch.id)
    assert batch.status == "failed" and batch.failed_at is not None
    [error] = batch.errors.data
    assert error.code == code and error.line == line_no and error.message
    assert batch.output_file_id is None and batch.error_file_id is None


def test_bad_requests_get_openai_errors(server, tmp_path):
    client = client_for(server)
    file_id = upload(client, tmp_path, [line("a", "x")])
    with pytest.raises(openai.BadRequestError) as bad_endpoint:
        client.batches.create(input_file_id=file_id, endpoint="/v1/embeddings", completion_window="24h")  # type: ignore[arg-type]
    assert bad_endpoint.value.body["param"] == "endpoint"
    with pytest.raises(openai.BadRequestError) as bad_window:
        client.batches.create(input_file_id=file_id, endpoint="/v1/completions", completion_window="48h")  # type: ignore[arg-type]
    assert bad_window.value.body["param"] == "completion_window"
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-nope", endpoint="/v1/completions", completion_window="24h")
    with pytest.raises(openai.BadRequestError) as bad_purpose:
        client.files.create(file=("x.jsonl", b"{}\n"), purpose="fine-tune")
    assert bad_purpose.value.body["param"] == "purpose"
    with pytest.raises(openai.APIStatusError) as too_large:
        client.files.create(file=("big.jsonl", b"x" * (300 * 1024)), purpose="batch")  # over --max-batch-file-mb 0.25
    assert too_large.value.status_code == 413
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nope")


def test_a_tenant_sees_only_its_own_files_and_batches(server, tmp_path):
    mine, theirs = client_for(server), client_for(server, "other")
    file_id = upload(mine, tmp_path, [line("a", "x")])
    batch = mine.batches.create(input_file_id=file_id, endpoint="/v1/completions", completion_window="24h")
    for call in (lambda: theirs.files.retrieve(file_id), lambda: theirs.files.content(file_id),
                 lambda: theirs.files.delete(file_id), lambda: theirs.batches.retrieve(batch.id),
                 lambda: theirs.batches.cancel(batch.id),
                 lambda: theirs.batches.create(input_file_id=file_id, endpoint="/v1/completions", completion_window="24h")):  # fmt: skip
        with pytest.raises(openai.NotFoundError):
            call()
    assert file_id not in [f.id for f in theirs.files.list()]
    assert batch.id not in [b.id for b in theirs.batches.list()]
    wait_done(mine, batch.id)
    assert mine.files.delete(file_id).deleted
    with pytest.raises(openai.NotFoundError):
        mine.files.retrieve(file_id)


def long_lines(count: int, max_tokens: int) -> list[dict]:
    return [line(f"long-{i}", f"Row {i} of the table reads " * 4, max_tokens=max_tokens) for i in range(count)]


def test_cancel_keeps_the_partial_output(server, tmp_path):
    client = client_for(server)
    batch = client.batches.create(input_file_id=upload(client, tmp_path, long_lines(300, 48)),
                                  endpoint="/v1/completions", completion_window="24h")  # fmt: skip
    deadline = time.monotonic() + 60
    while client.batches.retrieve(batch.id).request_counts.completed < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at is not None
    batch = wait_done(client, batch.id)
    assert batch.status == "cancelled" and batch.cancelled_at is not None
    outputs = read_lines(client, batch.output_file_id)
    assert 3 <= len(outputs) == batch.request_counts.completed < 300
    assert len({o["custom_id"] for o in outputs}) == len(outputs)
    assert batch.error_file_id is None  # lines not run are in neither file
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(batch.id)


def test_a_window_that_runs_out_expires_the_lines_not_run(server, tmp_path):
    client = client_for(server)
    batch = client.batches.create(input_file_id=upload(client, tmp_path, long_lines(300, 48)),
                                  endpoint="/v1/completions", completion_window="2s")  # type: ignore[arg-type]
    batch = wait_done(client, batch.id)
    assert batch.status == "expired" and batch.expired_at is not None and batch.expires_at == batch.created_at + 2
    outputs, errors = read_lines(client, batch.output_file_id), read_lines(client, batch.error_file_id)
    assert len(outputs) + len(errors) == 300 == batch.request_counts.total
    assert errors and all(e["error"]["code"] == "batch_expired" and e["response"] is None for e in errors)
    assert sorted(o["custom_id"] for o in outputs + errors) == sorted(f"long-{i}" for i in range(300))
