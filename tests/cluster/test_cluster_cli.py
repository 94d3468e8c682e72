"""`servelm cluster CONFIG` as a user runs it: starts a replica and a router, prints the URLs,
serves through the router, and on Ctrl-C (SIGINT) stops every process it started."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from servelm.ports import free_port_range
from servelm.testing.process_tree import alive
from servelm.testing.tiny_model import write_tiny_checkpoint


def test_cluster_starts_serves_and_tears_down_on_ctrl_c(tmp_path: Path) -> None:
    model = write_tiny_checkpoint(tmp_path / "model", seed=1)
    base = free_port_range(4)
    (tmp_path / "cluster.toml").write_text(
        f'model = "{model}"\n[replicas]\ncount = 1\nnum_threads = 1\nbase_port = {base + 1}\n'
        f'kv_events_base_port = {base + 2}\nargs = ["--num-blocks", "256"]\n[router]\nport = {base}\npolicy = "kv"\n'
    )
    command = [sys.executable, "-m", "servelm.cli", "cluster", str(tmp_path / "cluster.toml"), "--log-dir", str(tmp_path / "logs")]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 240
        while not any("Ctrl-C stops everything" in line for line in lines):
            line = process.stdout.readline()
            assert line or process.poll() is None, "".join(lines)
            lines.append(line)
            assert time.monotonic() < deadline, "".join(lines)
        output = "".join(lines)
        assert f"http://127.0.0.1:{base}" in output and f"http://127.0.0.1:{base + 1}" in output
        pids = [int(p) for p in re.findall(r"\(pid (\d+)\)", output)]
        assert len(pids) == 2
        body = {"prompt": "hello there", "max_tokens": 3}
        response = httpx.post(f"http://127.0.0.1:{base}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200 and response.json()["choices"][0]["text"]
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 0
        assert not any(alive(pid) for pid in pids)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
