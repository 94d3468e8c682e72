"""Real processes for delivery tests and benchmarks: an origin file server and `servelm pull` nodes.

    origin = start_origin(model_dir, rate_mb_s=50)        # python -m servelm.delivery.file_server
    peers = peer_urls(3)                                    # free local ports, one per node
    nodes = [start_node(origin.url, dest / f"n{i}", log_dir, peers=peers, node_index=i) for i in range(3)]
    wait_nodes(nodes, timeout_s=60)                         # each exited 0, or an AssertionError with its log
    origin.bytes_sent()                                     # the origin's egress, from its /_servelm/stats

Every node's stdout and stderr go to a log file (returned in its Node), so a pipe that nobody
reads never blocks a node, and a failure shows what the node said.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from servelm.ports import free_port


def peer_urls(count: int) -> list[str]:
    return [f"http://127.0.0.1:{free_port()}/" for _ in range(count)]


def _environment() -> dict[str, str]:
    # The child imports the same servelm as this process (a worktree's src/ under PYTHONPATH).
    source_root = str(Path(__file__).resolve().parents[2])
    paths = [source_root, *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


@dataclass
class OriginProcess:
    process: subprocess.Popen[str]
    url: str

    def stats(self) -> dict[str, Any]:
        response = httpx.get(f"{self.url}_servelm/stats", timeout=10)
        response.raise_for_status()
        return response.json()

    def bytes_sent(self) -> int:
        return int(self.stats()["bytes_sent"])

    def stop(self) -> None:
        stop_process(self.process)


def start_origin(directory: Path, rate_mb_s: float | None = None, timeout_s: float = 30.0) -> OriginProcess:
    """A file server subprocess on a free port; returns once it answers."""
    port = free_port()
    command = [sys.executable, "-m", "servelm.delivery.file_server", str(directory), "--port", str(port)]
    if rate_mb_s is not None:
        command += ["--rate-mb-s", str(rate_mb_s)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True,
                               env=_environment())  # fmt: skip
    origin = OriginProcess(process, f"http://127.0.0.1:{port}/")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            origin.stats()
            return origin
        except httpx.HTTPError:
            if process.poll() is not None or time.monotonic() > deadline:
                stop_process(process)
                raise RuntimeError(f"origin on port {port} did not start (exit {process.returncode})") from None
            time.sleep(0.05)


@dataclass
class Node:
    process: subprocess.Popen[str]
    directory: Path
    log_path: Path
    stats_path: Path

    def stats(self) -> dict[str, Any] | None:
        """The node's --stats-json (written on completion and after seeding), None before."""
        try:
            return json.loads(self.stats_path.read_text())
        except (OSError, ValueError):
            return None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def start_node(
    origin_url: str,
    directory: Path,
    log_dir: Path,
    peers: list[str] | None = None,
    node_index: int | None = None,
    extra: list[str] | None = None,
    name: str | None = None,
) -> Node:
    """`servelm pull ORIGIN --to DIR` as a subprocess; with `peers`, a swarm node (late joiner
    when `node_index` is None) whose stats go to LOG_DIR/NAME.json."""
    name = name or (f"node{node_index}" if node_index is not None else directory.name)
    log_dir.mkdir(parents=True, exist_ok=True)
    stats_path, log_path = log_dir / f"{name}.json", log_dir / f"{name}.log"
    command = [sys.executable, "-m", "servelm.cli", "pull", origin_url, "--to", str(directory), "--no-progress"]
    if peers is not None:
        command += ["--peers", ",".join(peers), "--peer-host", "127.0.0.1", "--stats-json", str(stats_path)]
        if node_index is not None:
            command += ["--node-index", str(node_index)]
    command += extra or []
    with log_path.open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, text=True, env=_environment())
    return Node(process, directory, log_path, stats_path)


def stop_process(process: subprocess.Popen[str], sig: int = signal.SIGTERM, timeout_s: float = 10.0) -> None:
    if process.poll() is None:
        process.send_signal(sig)
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout_s)


def wait_nodes(nodes: list[Node], timeout_s: float) -> None:
    """Until every node exited; AssertionError (with its log) for one that failed or ran past the deadline."""
    deadline = time.monotonic() + timeout_s
    for node in nodes:
        try:
            code = node.process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for other in nodes:
                stop_process(other.process)
            raise AssertionError(f"{node.log_path.name} still running after {timeout_s} s:\n{node.log()[-3000:]}") from None
        if code != 0:
            raise AssertionError(f"{node.log_path.name} exited {code}:\n{node.log()[-3000:]}")


def wait_until(condition: Callable[[], object], timeout_s: float, what: str, interval_s: float = 0.05) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)
