"""`servelm router` over N `servelm serve` replicas, each behind a CutProxy, for migration tests and
the chaos benchmark: the router knows only the proxies, so a test can cut, refuse or freeze one
replica's connections, kill its engine core or its process, and start it again on its port.

    client ─▶ router ─▶ proxy i ─▶ replica i        (all on 127.0.0.1)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx

from servelm.ports import free_port
from servelm.server.launcher import ServerProcess, launch_server, wait_until_ready
from servelm.testing.cut_proxy import CutProxy
from servelm.testing.processes import child_pids


@dataclass
class ProxiedFleet:
    router: str  # the router's base URL
    model: Path
    replica_args: list[str]
    replicas: list[ServerProcess]
    proxies: list[CutProxy]  # proxies[i] fronts replicas[i]
    router_process: subprocess.Popen
    router_log: Path

    def index_of(self, url: str) -> int:
        """The replica behind the proxy URL the router knows (what x-servelm-replica names)."""
        return next(i for i, p in enumerate(self.proxies) if p.url == url)

    def kill_engine_core(self, index: int) -> None:
        [core] = child_pids(self.replicas[index].process.pid, "spawn_main")  # not the resource tracker
        os.kill(core, signal.SIGKILL)

    def restart(self, index: int) -> None:
        """Stop replica `index` (SIGKILL if needed) and start it again on its port; returns when it
        serves (the router's health checker puts it back in rotation)."""
        old = self.replicas[index]
        if old.process.poll() is None:
            old.process.kill()
        old.process.wait(timeout=30)
        self.replicas[index] = launch_server(self.model, self.replica_args, port=old.port)

    def metric(self, name: str, labels: str = "") -> float:
        """A router metric summed over the series whose labels start with `labels`."""
        text = httpx.get(f"{self.router}/metrics", timeout=10).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(f"{name}{{{labels}") or (not labels and line.startswith(name + " ")))  # fmt: skip

    def num_healthy(self) -> int:
        return int(httpx.get(f"{self.router}/health", timeout=5).json().get("replicas", 0))

    def wait_healthy(self, count: int | None = None, timeout_s: float = 30.0) -> None:
        """Until `count` (all) replicas are in the router's rotation."""
        want = len(self.proxies) if count is None else count
        deadline = time.monotonic() + timeout_s
        while self.num_healthy() < want:
            if time.monotonic() > deadline:
                raise TimeoutError(f"fewer than {want} replicas in rotation after {timeout_s} s")
            time.sleep(0.2)

    def router_log_tail(self, num_chars: int = 5000) -> str:
        return self.router_log.read_text(errors="replace")[-num_chars:]

    def close(self) -> None:
        if self.router_process.poll() is None:
            self.router_process.terminate()
        self.router_process.wait(timeout=30)
        for proxy in self.proxies:
            proxy.close()
        for replica in self.replicas:
            replica.stop()


def start_proxied_fleet(model: Path, num_replicas: int, replica_args: Sequence[str],
                        router_args: Sequence[str] = ()) -> ProxiedFleet:  # fmt: skip
    """Start the replicas (in parallel), their proxies and the router; return once all are in rotation."""
    with ThreadPoolExecutor(num_replicas) as pool:
        replicas = list(pool.map(lambda _: launch_server(model, replica_args), range(num_replicas)))
    proxies = [CutProxy(r.port) for r in replicas]
    port = free_port()
    command = [sys.executable, "-m", "servelm.cli", "router", "--port", str(port), "--model", str(model),
               *router_args, *(arg for proxy in proxies for arg in ("--replica", proxy.url))]  # fmt: skip
    log = tempfile.NamedTemporaryFile(prefix="servelm-router-", suffix=".log", delete=False)
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    fleet = ProxiedFleet(f"http://127.0.0.1:{port}", model, list(replica_args), replicas, proxies, process,
                         Path(log.name))  # fmt: skip
    try:
        wait_until_ready(process, f"{fleet.router}/ready", 120)
        fleet.wait_healthy()
    except BaseException:
        print(fleet.router_log_tail())
        fleet.close()
        raise
    return fleet
