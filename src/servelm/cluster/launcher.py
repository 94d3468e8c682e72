"""What `servelm cluster` asks of a launcher, and the launchers by name (`--backend`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from servelm.cluster.spec import ClusterConfig


class Launcher(Protocol):
    """Places and runs a cluster config's processes. Called from one thread (the CLI's)."""

    def start(self) -> None:
        """Start every process; return once all serve. On a failure: stop everything, raise."""

    def urls(self) -> dict[str, str]:
        """Process name -> where its HTTP API answers now."""

    def check(self) -> str | None:
        """One supervision pass, called every half second: restart what the launcher restarts,
        and return why the whole cluster must stop, or None."""

    def stop(self) -> None:
        """Stop every process (router first) and release what was placed. Safe to call twice."""


@dataclass(frozen=True)
class LaunchOptions:
    log_dir: Path  # one log file per process (for Ray: the same path on each node)
    startup_timeout_s: float = 300.0
    address: str | None = None  # ray: an existing cluster to join (None: start a local one)


def _local(config: ClusterConfig, options: LaunchOptions) -> Launcher:
    if options.address is not None:
        raise ValueError("--address is for --backend ray (the Ray cluster to place the processes on)")
    from servelm.cluster.local import LocalCluster

    return LocalCluster(config, options.log_dir, options.startup_timeout_s)


def _ray(config: ClusterConfig, options: LaunchOptions) -> Launcher:
    from servelm.cluster.ray_backend import RayCluster  # Ray itself only when chosen

    return RayCluster(config, options.log_dir, options.startup_timeout_s, options.address)


LAUNCHERS: dict[str, Callable[[ClusterConfig, LaunchOptions], Launcher]] = {"local": _local, "ray": _ray}


def make_launcher(backend: str, config: ClusterConfig, options: LaunchOptions) -> Launcher:
    """Raises ValueError for an unknown backend, ImportError when its library is missing."""
    factory = LAUNCHERS.get(backend)
    if factory is None:
        raise ValueError(f"unknown placement backend {backend!r}; valid: {', '.join(LAUNCHERS)}")
    return factory(config, options)
