"""The `local` launcher: every ProcessSpec as a child process on this machine.

Start order: all replicas at once (model loading dominates, so in parallel), wait until
each answers /ready (serving; /live answers as soon as it listens), then the router (it needs
the replicas' URLs), wait for it too (its /ready: a replica in rotation).
`stop()` sends SIGTERM to the router first (no new requests reach replicas), then the
replicas, and SIGKILLs whatever has not exited after `stop_timeout_s`. Safe to call twice.
Nothing is restarted: a process that exits ends the cluster (`check()`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from servelm.cluster.process import RunningProcess, http_status, spawn, stop_all, wait_all_ready
from servelm.cluster.spec import ClusterConfig, ProcessSpec

logger = logging.getLogger(__name__)


class LocalCluster:
    def __init__(self, config: ClusterConfig, log_dir: Path, startup_timeout_s: float = 300.0) -> None:
        self.config = config
        self.log_dir = log_dir
        self.startup_timeout_s = startup_timeout_s
        self.processes: list[RunningProcess] = []

    def start(self) -> None:
        """Start everything and return once all are ready; on any failure stop all and raise."""
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

    def check(self) -> str | None:
        """Why the cluster must stop (a process exited), or None."""
        exited = self.first_exited()
        return None if exited is None else f"{exited.spec.name} exited with {exited.process.returncode}"

    def stop(self, stop_timeout_s: float = 30.0) -> None:
        # Router first: once it is gone no new request reaches a replica that is shutting down.
        stop_all([p for p in self.processes if p.spec.role == "router"], stop_timeout_s)
        stop_all([p for p in self.processes if p.spec.role != "router"], stop_timeout_s)

    def _spawn(self, spec: ProcessSpec) -> RunningProcess:
        running = spawn(spec, self.log_dir)
        self.processes.append(running)
        return running

    def _wait_ready(self, group: list[RunningProcess]) -> None:
        wait_all_ready({r.spec.name: _ready_probe(r) for r in group}, self.startup_timeout_s)


def _ready_probe(running: RunningProcess) -> Callable[[], bool]:
    def probe() -> bool:
        if running.process.poll() is not None:
            raise RuntimeError(f"{running.spec.name} exited with {running.process.returncode}:\n{running.log_tail()}")
        return http_status(running.spec.url + "/ready") == 200

    return probe
