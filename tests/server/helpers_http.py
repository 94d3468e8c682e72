"""Helpers for the HTTP tests: reading a live server's /metrics; finding its child processes."""

from __future__ import annotations

import re
import time

import httpx
import pytest

from servelm.server.launcher import ServerProcess
from servelm.testing.overload import child_pids  # noqa: F401  (the HTTP tests' import of it)

KEY = "test-key-123"  # the `restricted` server's API key


def metric_value(text: str, name: str, labels: str = "") -> float:
    """One sample of a Prometheus exposition (`labels`: a substring of its label set)."""
    for line in text.splitlines():
        if line.startswith(name) and (line[len(name)] in " {") and labels in line:
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(f"{name}{{{labels}}} not in /metrics")


def scrape(server: ServerProcess) -> str:
    return httpx.get(f"{server.base_url}/metrics", timeout=10).text


def wait_idle(server: ServerProcess, timeout_s: float = 20.0) -> str:
    """Poll /metrics until the engine has nothing running, waiting or holding blocks; return the scrape."""
    deadline = time.monotonic() + timeout_s
    text = ""
    while time.monotonic() < deadline:
        text = scrape(server)
        if all(
            metric_value(text, f"servelm:{name}") == 0
            for name in ("num_requests_running", "num_requests_waiting", "kv_cache_used_blocks", "num_requests_in_api")
        ):
            return text
        time.sleep(0.1)
    pytest.fail("server did not go idle:\n" + "\n".join(line for line in text.splitlines() if re.match(r"servelm:(num_req|kv_)", line)))
