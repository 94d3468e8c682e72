"""The `local` launcher: every ProcessSpec as a child process on this machine.

Start order: all replicas at once (model loading dominates, so in parallel), wait until
each answers /ready (serving; /health answers as soon as it listens), then the router (it needs
the replicas' URLs), wait for it too (its /ready: a replica in rotation).
`stop()` sends SIGTERM to the router first (no new requests reach replicas), then the
replicas, and SIGKILLs whatever has not exited after `stop_timeout_s`. Safe to call twice.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from servelm.cluster.spec import ClusterConfig, ProcessSpec, servelm_command

logger = logging.getLogger(__name__)


@dataclass
class RunningProcess:
    spec: ProcessSpec
    process: subprocess.Popen
    log_path: Path

    def log_tail(self, num_chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:]
        except OSError:
            return ""


class LocalCluster:
    def __init__(self, config: ClusterConfig, log_dir: Path, startup_timeout_s: float = 300.0) -> None:
        self.config = config
        self.log_dir = log_dir
        self.startup_timeout_s = startup_timeout_s
        self.processes: list[RunningProcess] = []

    def start(self) -> None:
        """Start everything and return once all are ready; on any failure stop all and raise."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            replicas = [self._spawn(spec) for spec in self.config.replica_processes()]
            self._wait_ready(replicas)
            router = self._spawn(self.config.router_process([r.spec for r in replicas]))
            self._wait_ready([router])
        except BaseException:
            self.stop()
            raise

    def urls(self) -> dict[str, str]:
        return {p.spec.name: p.spec.url for p in self.processes}

    def first_exited(self) -> RunningProcess | None:
        return next((p for p in self.processes if p.process.poll() is not None), None)

    def stop(self, stop_timeout_s: float = 30.0) -> None:
        # Router first: once it is gone no new request reaches a replica that is shutting down.
        for group in ([p for p in self.processes if p.spec.role == "router"],
                      [p for p in self.processes if p.spec.role != "router"]):  # fmt: skip
            for running in group:
                if running.process.poll() is None:
                    running.process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + stop_timeout_s
            for running in group:
                try:
                    running.process.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    running.process.kill()
                    running.process.wait(timeout=10)

    def _spawn(self, spec: ProcessSpec) -> RunningProcess:
        log_path = self.log_dir / f"{spec.name}.log"
        with open(log_path, "wb") as log:
            process = subprocess.Popen(servelm_command(spec.argv), stdout=log, stderr=subprocess.STDOUT)
        running = RunningProcess(spec, process, log_path)
        self.processes.append(running)
        logger.info("started %s (pid %d): log %s", spec.name, process.pid, log_path)
        return running

    def _wait_ready(self, group: list[RunningProcess]) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        pending = list(group)
        while pending:
            for running in list(pending):
                if running.process.poll() is not None:
                    raise RuntimeError(f"{running.spec.name} exited with {running.process.returncode}:\n{running.log_tail()}")
                try:
                    if httpx.get(running.spec.url + "/ready", timeout=1.0).status_code == 200:
                        pending.remove(running)
                except httpx.HTTPError:
                    pass
            if pending and time.monotonic() > deadline:
                names = ", ".join(r.spec.name for r in pending)
                raise RuntimeError(f"not ready after {self.startup_timeout_s:.0f} s: {names}")
            if pending:
                time.sleep(0.25)
