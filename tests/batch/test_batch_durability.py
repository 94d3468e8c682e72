"""A batch survives its server being killed (kill -9) mid-run, and `servelm run-batch` resumes
where it stopped: every line's result exactly once, its text what a direct request gives.

(benchmarks/batch.py does the same at the issue's size: 10 kills during a 2,000-line batch.)
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai

from servelm.server.launcher import launch_server
from servelm.testing.processes import kill_hard

ARGS = ["--num-blocks", "1024", "--max-num-seqs", "32", "--num-threads", "1"]


def lines(count: int, max_tokens: int) -> list[dict]:
    return [{"custom_id": f"doc-{i}", "method": "POST", "url": "/v1/completions",
             "body": {"prompt": f"Document {i} says " * (1 + i % 4), "max_tokens": max_tokens, "temperature": 0,
                      "ignore_eos": True}} for i in range(count)]  # fmt: skip


def write_input(path: Path, items: list[dict]) -> Path:
    path.write_text("".join(json.dumps(x) + "\n" for x in items))
    return path


def text_of(response_body: dict) -> str:
    return response_body["choices"][0]["text"]


def test_a_batch_completes_exactly_once_across_kill_9_restarts(tiny_model_dir, tmp_path):
    data_dir = tmp_path / "data"
    items = lines(48, 24)
    server = launch_server(tiny_model_dir, [*ARGS, "--data-dir", str(data_dir)])
    try:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
        with write_input(tmp_path / "in.jsonl", items).open("rb") as f:
            file_id = client.files.create(file=f, purpose="batch").id
        batch_id = client.batches.create(input_file_id=file_id, endpoint="/v1/completions", completion_window="24h").id
        for kill in range(2):  # twice, at different points of the run
            target = 8 + 18 * kill
            deadline = time.monotonic() + 60
            while (done := client.batches.retrieve(batch_id).request_counts.completed) < target and time.monotonic() < deadline:
                time.sleep(0.05)
            kill_hard(server.process)
            assert target <= done < len(items)  # killed mid-run
            server = launch_server(tiny_model_dir, [*ARGS, "--data-dir", str(data_dir)])
            client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
            assert client.batches.retrieve(batch_id).request_counts.completed >= target  # nothing done was lost
        deadline = time.monotonic() + 120
        while (batch := client.batches.retrieve(batch_id)).status != "completed" and time.monotonic() < deadline:
            time.sleep(0.2)
        assert batch.status == "completed" and batch.request_counts.completed == len(items) and batch.request_counts.failed == 0
        outputs = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
        assert [o["custom_id"] for o in outputs] == [x["custom_id"] for x in items]  # each once, in input order
        with ThreadPoolExecutor(8) as pool:  # the references side by side: greedy text does not depend on the batch
            directs = list(pool.map(lambda item: httpx.post(f"{server.base_url}/v1/completions", json=item["body"],
                                                            timeout=60).json(), items))  # fmt: skip
        for item, output, direct in zip(items, outputs, directs, strict=True):
            assert text_of(output["response"]["body"]) == text_of(direct), item["custom_id"]
    finally:
        server.stop()


def run_batch(tiny_model_dir: Path, tmp_path: Path, source: Path, output: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "servelm.cli", "run-batch", "--model", str(tiny_model_dir), *ARGS,
               "-i", str(source), "-o", str(output), "--data-dir", str(tmp_path / "run-data")]  # fmt: skip
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_run_batch_writes_every_result_in_input_order_and_resumes_after_kill_9(tiny_model_dir, tmp_path):
    items = lines(60, 24)
    bad = {"custom_id": "bad", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "max_tokens": -1}}
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(x) + "\n" for x in items[:30]) + "{broken\n" + json.dumps(bad) + "\n"
                      + "".join(json.dumps(x) + "\n" for x in items[30:]))  # fmt: skip
    output = tmp_path / "out.jsonl"
    first = run_batch(tiny_model_dir, tmp_path, source, output)
    database = tmp_path / "run-data" / "batch.sqlite3"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and first.poll() is None:  # kill it once some lines are done
        if database.exists() and _done_lines(database) >= 15:
            break
        time.sleep(0.1)
    assert first.poll() is None  # still running: killed mid-run
    first.kill()
    first.wait(timeout=10)
    assert not output.exists()
    second = run_batch(tiny_model_dir, tmp_path, source, output)
    log, _ = second.communicate(timeout=300)
    assert second.returncode == 0, log
    assert "resuming" in log
    results = [json.loads(x) for x in output.read_text().splitlines()]
    assert [r["custom_id"] for r in results] == [x["custom_id"] for x in items[:30]] + [None, "bad"] + [x["custom_id"] for x in items[30:]]
    assert results[30]["error"]["code"] == "invalid_json" and results[31]["response"]["status_code"] == 400
    assert all(r["response"]["status_code"] == 200 for r in results if r["custom_id"] not in (None, "bad"))


def _done_lines(database: Path) -> int:
    try:
        with sqlite3.connect(database, timeout=1) as db:
            return int(db.execute("SELECT COUNT(*) FROM lines WHERE state != 0").fetchone()[0])
    except sqlite3.Error:
        return 0
