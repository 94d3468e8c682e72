"""The Ray actor that owns one `servelm serve` or `servelm router` process on its node.

The driver (ray_backend.py) creates one per process, in bundle 0 of that process's placement
group, and drives it: `start(spec)` spawns the process (stopping any earlier one), `status()`
says whether it still runs, `request()` asks its HTTP API from the node it runs on (so the
driver needs to reach Ray only, not every node's ports). The actor decides nothing: restarts,
readiness deadlines and router registration are the driver's.

The process is started from the actor's main thread, where Ray runs a synchronous actor's
methods, with the parent-death signal set (process.spawn `owned`): when Ray kills the actor
(`ray.kill`, a node going away) the process dies with it instead of holding its ports, and
its engine core follows (it watches its parent). Ray then restarts the actor (max_restarts)
with nothing running; the driver sees `status().pid is None` and starts the process again.

This module imports no ray: Ray pickles the class by reference, and the driver wraps it with
`ray.remote(...)` only when the ray backend is used.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from servelm.cluster.process import RunningProcess, spawn, stop_all
from servelm.cluster.spec import ProcessSpec


@dataclass(frozen=True)
class ProcessStatus:
    actor_pid: int  # the actor's own process: a new one after Ray restarted the actor
    pid: int | None  # the servelm process; None: none started by this actor incarnation
    returncode: int | None  # None while it runs


class ProcessHost:
    def __init__(self, log_dir: str) -> None:
        self.log_dir = Path(log_dir)
        self.running: RunningProcess | None = None

    def node_address(self) -> str:
        import ray

        return str(ray.util.get_node_ip_address())

    def gpu_ids(self) -> list[str]:
        """The GPUs Ray gave this actor (bundle 0 of its placement group)."""
        return bundle_gpu_ids()

    def start(self, spec: ProcessSpec, env: dict[str, str]) -> int:
        """Start SPEC's process (after stopping this actor's earlier one); its pid."""
        self.stop()
        self.running = spawn(spec, self.log_dir, env, owned=True)
        return self.running.process.pid

    def status(self) -> ProcessStatus:
        if self.running is None:
            return ProcessStatus(os.getpid(), None, None)
        return ProcessStatus(os.getpid(), self.running.process.pid, self.running.process.poll())

    def request(
        self, method: str, path: str, body: dict[str, Any] | None = None, api_key: str | None = None,
        timeout_s: float = 5.0,
    ) -> int:  # fmt: skip
        """METHOD the process's URL + PATH from this node; the status code, 0 when nothing answers."""
        if self.running is None:
            return 0
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        try:
            response = httpx.request(
                method, self.running.spec.url + path, json=body, headers=headers, timeout=timeout_s
            )
        except httpx.HTTPError:
            return 0
        return response.status_code

    def log_tail(self, num_chars: int = 3000) -> str:
        return self.running.log_tail(num_chars) if self.running is not None else ""

    def stop(self, stop_timeout_s: float = 30.0) -> int | None:
        """SIGTERM, then SIGKILL after `stop_timeout_s`; the exit code (None: nothing ran)."""
        if self.running is None:
            return None
        stop_all([self.running], stop_timeout_s)
        return self.running.process.returncode


def bundle_gpu_ids() -> list[str]:
    """A task's GPUs: run in a placement group's bundle, that bundle's (see RayCluster._gpu_env)."""
    import ray

    return [str(gpu) for gpu in ray.get_gpu_ids()]
