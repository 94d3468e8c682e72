"""The cluster config: what to run, not where. One YAML or TOML file.

    model: /models/smollm2          # every replica's --model and the router's tokenizer (omit: default model)
    host: 127.0.0.1
    api_key: null                   # the router's and every replica's --api-key
    placement: local                # who starts the processes (only "local" today)
    replicas:
      count: 2
      num_threads: 1
      base_port: 8100               # replica i serves HTTP on base_port + i
      kv_events_base_port: 9100     # replica i publishes on 9100 + 2i (snapshot on the next port)
      args: ["--max-num-seqs", "64"]  # more `servelm serve` flags, for every replica
    router:
      port: 8000
      policy: kv
      args: ["--load-weight", "1.0"]  # more `servelm router` flags

The spec resolves into one `ProcessSpec` per process (a role, a command line, the ports it
will listen on). A launcher turns those into processes: `local` as children of
`servelm cluster`; a Ray or Kubernetes launcher would place the same specs on other
machines, changing only hosts. The router never sees any of this: it gets URLs.
"""

from __future__ import annotations

import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

_SECTIONS = {"model", "host", "api_key", "placement", "replicas", "router"}
_REPLICA_KEYS = {"count", "num_threads", "base_port", "kv_events_base_port", "args"}
_ROUTER_KEYS = {"port", "policy", "args"}


@dataclass(frozen=True)
class ReplicasConfig:
    count: int = 2
    num_threads: int = 1
    base_port: int = 8100
    kv_events_base_port: int | None = 9100  # None: no KV events (then only cache-blind or prefix routing)
    args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.count < 1 or self.num_threads < 1:
            raise ValueError(f"replicas.count and replicas.num_threads must be >= 1, got {self.count}, {self.num_threads}")


@dataclass(frozen=True)
class RouterConfig:
    port: int = 8000
    policy: str = "kv"
    args: tuple[str, ...] = ()


@dataclass(frozen=True)
class ProcessSpec:
    """One process to start: placement-free (a launcher adds where)."""

    name: str  # replica-0, replica-1, ..., router
    role: str  # replica | router
    argv: tuple[str, ...]  # `servelm ...` arguments (the launcher picks the interpreter)
    url: str  # where its HTTP API will answer
    kv_events: str | None = None  # replicas: their PUB address


@dataclass(frozen=True)
class ClusterConfig:
    model: str | None = None
    host: str = "127.0.0.1"
    api_key: str | None = None
    placement: str = "local"
    replicas: ReplicasConfig = field(default_factory=ReplicasConfig)
    router: RouterConfig = field(default_factory=RouterConfig)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ClusterConfig:
        _check_keys("cluster config", data, _SECTIONS)
        replicas = dict(data.get("replicas") or {})
        router = dict(data.get("router") or {})
        _check_keys("replicas", replicas, _REPLICA_KEYS)
        _check_keys("router", router, _ROUTER_KEYS)
        replicas["args"] = tuple(str(a) for a in replicas.get("args", ()))
        router["args"] = tuple(str(a) for a in router.get("args", ()))
        model = data.get("model")
        return cls(
            model=str(model) if model is not None else None,
            host=str(data.get("host", "127.0.0.1")),
            api_key=data.get("api_key"),
            placement=str(data.get("placement", "local")),
            replicas=ReplicasConfig(**replicas),
            router=RouterConfig(**router),
        )

    def replica_processes(self) -> list[ProcessSpec]:
        specs = []
        r = self.replicas
        for i in range(r.count):
            port = r.base_port + i
            argv = ["serve", "--host", self.host, "--port", str(port), "--num-threads", str(r.num_threads)]
            argv += ["--model", self.model] if self.model else []
            argv += ["--api-key", self.api_key] if self.api_key else []
            kv_events = None
            if r.kv_events_base_port is not None:
                kv_port = r.kv_events_base_port + 2 * i  # two ports each: PUB and snapshot
                argv += ["--kv-events-port", str(kv_port)]
                kv_events = f"tcp://{self.host}:{kv_port}"
            specs.append(ProcessSpec(f"replica-{i}", "replica", tuple(argv) + r.args, f"http://{self.host}:{port}", kv_events))
        return specs

    def router_process(self, replicas: list[ProcessSpec]) -> ProcessSpec:
        argv = ["router", "--host", self.host, "--port", str(self.router.port), "--policy", self.router.policy]
        argv += ["--model", self.model] if self.model else []
        argv += ["--api-key", self.api_key] if self.api_key else []
        for replica in replicas:
            argv += ["--replica", replica.url + (f",kv={replica.kv_events}" if replica.kv_events else "")]
        return ProcessSpec("router", "router", tuple(argv) + self.router.args, f"http://{self.host}:{self.router.port}")


def _check_keys(where: str, data: dict[str, Any], valid: set[str]) -> None:
    unknown = set(data) - valid
    if unknown:
        raise ValueError(f"unknown key(s) {sorted(unknown)} in {where}; valid: {', '.join(sorted(valid))}")


def load_cluster_config(path: str | Path) -> ClusterConfig:
    """Read a .yaml/.yml or .toml cluster config."""
    path = Path(path)
    text = path.read_text()
    data = tomllib.loads(text) if path.suffix.lower() == ".toml" else yaml.safe_load(text)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping at the top level")  # not TypeError: a config error, like the rest
    return ClusterConfig.from_dict(data)


def servelm_command(argv: tuple[str, ...]) -> list[str]:
    """The full command line for `servelm ARGV` with this interpreter (works without the script on PATH)."""
    return [sys.executable, "-m", "servelm.cli", *argv]
