"""The cluster config: what to run, not where. One YAML or TOML file.

    model: /models/smollm2          # every replica's --model and the router's tokenizer (omit: default model)
    host: 127.0.0.1
    api_key: null                   # the router's and every replica's --api-key
    block_size: 16                  # every replica's and the router's --block-size (omit: their default)
    placement: local                # who starts the processes: local | ray (`servelm cluster --backend` overrides)
    replicas:                       # aggregated replicas (plain: no --kv-role)
      count: 2
      num_threads: 1
      tensor_parallel_size: 1       # ranks per replica: --tensor-parallel-size x --context-parallel-size,
      context_parallel_size: 1      #   placed together (on Ray: one placement group, a bundle per rank)
      num_cpus: 1                   # Ray: logical CPUs per rank (omit: num_threads)
      num_gpus: 0                   # Ray: GPUs per rank
      base_port: 8100               # replica i serves HTTP on base_port + i
      kv_events_base_port: 9100     # replica i publishes on 9100 + 2i (snapshot on the next port)
      args: ["--max-num-seqs", "64"]  # more `servelm serve` flags, for every replica
    prefill:                        # prefill workers: --kv-role prefill --kv-transfer-port transfer_base_port + i
      count: 1                      # (defaults: base_port 8200, kv_events_base_port 9200, transfer_base_port 9300)
      transfer_base_port: 9300
    decode:                         # decode workers: --kv-role decode --kv-transfer-peers <every prefill worker>
      count: 1                      # (defaults: base_port 8300, kv_events_base_port 9400)
    router:
      port: 8000
      policy: kv
      num_cpus: 1                   # Ray: logical CPUs for the router
      args: ["--load-weight", "1.0"]  # more `servelm router` flags

Any of replicas / prefill / decode may be left out (a file with none of them gets the
default 2 aggregated replicas), but a prefill pool needs a decode pool: only a decode worker
pulls KV. The router is given every replica and learns each one's role from the replica.

The spec resolves into one `ProcessSpec` per process (a role, a command line, the ports it
will listen on). A launcher turns those into processes: `local` as children of
`servelm cluster`; `ray` as Ray actors (cluster/ray_backend.py), which places the same specs on
other machines, changing only the addresses they are reached at (with a wildcard `host`, such
as 0.0.0.0, each process is advertised at its node's address). The router never sees any of
this: it gets URLs.
"""

from __future__ import annotations

import sys
import tomllib
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

_SECTIONS = {"model", "host", "api_key", "block_size", "placement", "replicas", "prefill", "decode", "router"}
_REPLICA_KEYS = {
    "count", "num_threads", "base_port", "kv_events_base_port", "args",
    "tensor_parallel_size", "context_parallel_size", "num_cpus", "num_gpus",
}  # fmt: skip
_PREFILL_KEYS = _REPLICA_KEYS | {"transfer_base_port"}
_ROUTER_KEYS = {"port", "policy", "args", "num_cpus"}
# Pool defaults where the file leaves a key out (aggregated replicas: ReplicasConfig's own).
_POOL_DEFAULTS: dict[str, dict[str, Any]] = {
    "replicas": {},
    "prefill": {"count": 1, "base_port": 8200, "kv_events_base_port": 9200, "transfer_base_port": 9300},
    "decode": {"count": 1, "base_port": 8300, "kv_events_base_port": 9400},
}
# Flags the launcher sets itself from the config (one value for the whole cluster, or per role).
_OWNED_SERVE_FLAGS = (
    "--block-size", "--kv-role", "--kv-transfer-port", "--kv-transfer-host", "--kv-transfer-peers",
    "--tensor-parallel-size", "-tp", "--context-parallel-size", "-cp",
)  # fmt: skip
# Hosts that mean "every interface": such a process is reached at its machine's address.
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::"})


@dataclass(frozen=True)
class ReplicasConfig:
    """One pool of identical `servelm serve` processes (aggregated, prefill or decode)."""

    count: int = 2
    num_threads: int = 1
    base_port: int = 8100
    kv_events_base_port: int | None = 9100  # None: no KV events (then only cache-blind or prefix routing)
    args: tuple[str, ...] = ()
    transfer_base_port: int | None = None  # prefill pool only: worker i's KV transfer server on this + i
    tensor_parallel_size: int = 1
    context_parallel_size: int = 1
    # Resource requests per rank where a scheduler places the processes (Ray); `local` ignores them.
    num_cpus: float | None = None  # logical CPUs; None: num_threads
    num_gpus: float = 0.0

    @property
    def num_ranks(self) -> int:
        return self.tensor_parallel_size * self.context_parallel_size


@dataclass(frozen=True)
class RouterConfig:
    port: int = 8000
    policy: str = "kv"
    args: tuple[str, ...] = ()
    num_cpus: float = 1.0  # logical CPUs where a scheduler places it (Ray)


@dataclass(frozen=True)
class ProcessSpec:
    """One process to start: placement-free (a launcher adds where)."""

    name: str  # replica-0, ..., prefill-0, ..., decode-0, ..., router
    role: str  # replica | router
    argv: tuple[str, ...]  # `servelm ...` arguments (the launcher picks the interpreter)
    url: str  # where its HTTP API will answer
    kv_events: str | None = None  # replicas: their PUB address
    kv_role: str | None = None  # replicas: prefill | decode, None for an aggregated one
    # What a scheduler must reserve for it, all on one machine (its ranks talk over loopback).
    num_ranks: int = 1
    cpus_per_rank: float = 1.0
    gpus_per_rank: float = 0.0


@dataclass(frozen=True)
class ClusterConfig:
    model: str | None = None
    host: str = "127.0.0.1"
    api_key: str | None = None
    placement: str = "local"
    replicas: ReplicasConfig | None = field(default_factory=ReplicasConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    prefill: ReplicasConfig | None = None
    decode: ReplicasConfig | None = None
    block_size: int | None = None

    def __post_init__(self) -> None:
        pools = self.pools()
        if not pools:
            raise ValueError("the cluster config has no replicas: give replicas, decode (and prefill) pools")
        for name, pool in pools.items():
            if pool.count < 1 or pool.num_threads < 1:
                raise ValueError(
                    f"{name}.count and {name}.num_threads must be >= 1, got {pool.count}, {pool.num_threads}"
                )
            if pool.tensor_parallel_size < 1 or pool.context_parallel_size < 1:
                raise ValueError(
                    f"{name}.tensor_parallel_size and context_parallel_size must be >= 1, "
                    f"got {pool.tensor_parallel_size}, {pool.context_parallel_size}"
                )
            if (pool.num_cpus is not None and pool.num_cpus <= 0) or pool.num_gpus < 0:
                raise ValueError(f"{name}.num_cpus must be > 0 and num_gpus >= 0, got {pool.num_cpus}, {pool.num_gpus}")
            if (pool.transfer_base_port is None) == (name == "prefill"):
                raise ValueError(
                    "prefill.transfer_base_port is required"
                    if name == "prefill"
                    else f"{name}.transfer_base_port: only prefill workers serve KV transfers"
                )
            for flag in _OWNED_SERVE_FLAGS:
                if any(arg == flag or arg.startswith(flag + "=") for arg in pool.args):
                    raise ValueError(f"{name}.args sets {flag}: the cluster sets it itself ({_owner(flag)})")
        if self.prefill is not None and self.decode is None:
            raise ValueError(
                "a prefill pool needs a decode pool: only decode workers pull the KV prefill workers compute"
            )
        if any(arg == "--block-size" or arg.startswith("--block-size=") for arg in self.router.args):
            raise ValueError("router.args sets --block-size: set block_size at the top level (every process uses it)")
        if self.router.num_cpus <= 0:
            raise ValueError(f"router.num_cpus must be > 0, got {self.router.num_cpus}")
        if self.block_size is not None and self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        taken = Counter(self._ports())
        clashes = sorted(port for port, uses in taken.items() if uses > 1)
        if clashes:
            raise ValueError(f"ports used twice (HTTP, KV events + snapshot, KV transfer, router): {clashes}")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ClusterConfig:
        _check_keys("cluster config", data, _SECTIONS)
        router = dict(data.get("router") or {})
        _check_keys("router", router, _ROUTER_KEYS)
        router["args"] = tuple(str(a) for a in router.get("args", ()))
        has_pools = any(name in data for name in ("prefill", "decode"))
        # No pool at all: today's default of aggregated replicas.
        pools = {name: _pool(name, data.get(name)) if name in data else None for name in _POOL_DEFAULTS}
        if not has_pools and pools["replicas"] is None:
            pools["replicas"] = ReplicasConfig()
        model, block_size = data.get("model"), data.get("block_size")
        return cls(
            model=str(model) if model is not None else None,
            host=str(data.get("host", "127.0.0.1")),
            api_key=data.get("api_key"),
            placement=str(data.get("placement", "local")),
            replicas=pools["replicas"],
            router=RouterConfig(**router),
            prefill=pools["prefill"],
            decode=pools["decode"],
            block_size=int(block_size) if block_size is not None else None,
        )

    def pools(self) -> dict[str, ReplicasConfig]:
        """The serving pools present, by section name, in start order."""
        named = {"replicas": self.replicas, "prefill": self.prefill, "decode": self.decode}
        return {name: pool for name, pool in named.items() if pool is not None}

    def transfer_addresses(self, addresses: Mapping[str, str] | None = None) -> list[str]:
        """Every prefill worker's KV transfer server (what decode workers connect to at start-up).
        `addresses`: as in `replica_processes`."""
        if self.prefill is None or self.prefill.transfer_base_port is None:
            return []
        return [
            f"tcp://{self._address(f'prefill-{i}', addresses)}:{self.prefill.transfer_base_port + i}"
            for i in range(self.prefill.count)
        ]

    def replica_processes(self, addresses: Mapping[str, str] | None = None) -> list[ProcessSpec]:
        """Every `servelm serve` process: aggregated replicas, prefill workers, decode workers.

        `addresses`: process name -> the address of the machine it was placed on, for a launcher
        that places processes on other machines. Used only with a wildcard `host` (the process
        binds every interface and is reached at its machine's address); otherwise, and for a
        name left out, each process is reached at `host`.
        """
        specs = []
        for name, pool in self.pools().items():
            kv_role = None if name == "replicas" else name
            for i in range(pool.count):
                specs.append(self._replica_process(pool, kv_role, i, addresses))
        return specs

    def _address(self, name: str, addresses: Mapping[str, str] | None) -> str:
        if self.host in WILDCARD_HOSTS and addresses and name in addresses:
            return addresses[name]
        return self.host

    def _replica_process(
        self, pool: ReplicasConfig, kv_role: str | None, i: int, addresses: Mapping[str, str] | None
    ) -> ProcessSpec:
        name = f"{kv_role or 'replica'}-{i}"
        address = self._address(name, addresses)
        port = pool.base_port + i
        argv = ["serve", "--host", self.host, "--port", str(port), "--num-threads", str(pool.num_threads)]
        argv += ["--tensor-parallel-size", str(pool.tensor_parallel_size)] if pool.tensor_parallel_size > 1 else []
        argv += ["--context-parallel-size", str(pool.context_parallel_size)] if pool.context_parallel_size > 1 else []
        argv += ["--model", self.model] if self.model else []
        argv += ["--api-key", self.api_key] if self.api_key else []
        argv += ["--block-size", str(self.block_size)] if self.block_size is not None else []
        kv_events = None
        if pool.kv_events_base_port is not None:
            kv_port = pool.kv_events_base_port + 2 * i  # two ports each: PUB and snapshot
            argv += ["--kv-events-port", str(kv_port)]
            kv_events = f"tcp://{address}:{kv_port}"
        if kv_role == "prefill" and pool.transfer_base_port is not None:
            argv += ["--kv-role", "prefill", "--kv-transfer-host", address]
            argv += ["--kv-transfer-port", str(pool.transfer_base_port + i)]
        elif kv_role == "decode":
            argv += ["--kv-role", "decode"]
            peers = self.transfer_addresses(addresses)
            argv += ["--kv-transfer-peers", ",".join(peers)] if peers else []
        url = f"http://{address}:{port}"
        cpus = float(pool.num_threads if pool.num_cpus is None else pool.num_cpus)
        return ProcessSpec(
            name, "replica", tuple(argv) + pool.args, url, kv_events, kv_role, pool.num_ranks, cpus, pool.num_gpus
        )

    def router_process(self, replicas: list[ProcessSpec], address: str | None = None) -> ProcessSpec:
        """`address`: the router's machine, as in `replica_processes` (used with a wildcard `host`)."""
        argv = ["router", "--host", self.host, "--port", str(self.router.port), "--policy", self.router.policy]
        argv += ["--model", self.model] if self.model else []
        argv += ["--api-key", self.api_key] if self.api_key else []
        argv += ["--block-size", str(self.block_size)] if self.block_size is not None else []
        for replica in replicas:
            options = f",kv={replica.kv_events}" if replica.kv_events else ""
            options += f",role={replica.kv_role}" if replica.kv_role else ""
            argv += ["--replica", replica.url + options]
        url = f"http://{self._address('router', {'router': address} if address else None)}:{self.router.port}"
        return ProcessSpec("router", "router", tuple(argv) + self.router.args, url, cpus_per_rank=self.router.num_cpus)

    def _ports(self) -> list[int]:
        ports = [self.router.port]
        for pool in self.pools().values():
            ports += [pool.base_port + i for i in range(pool.count)]
            if pool.kv_events_base_port is not None:
                ports += [pool.kv_events_base_port + j for j in range(2 * pool.count)]
            if pool.transfer_base_port is not None:
                ports += [pool.transfer_base_port + i for i in range(pool.count)]
        return ports


def _pool(name: str, data: Any) -> ReplicasConfig:
    values = dict(_POOL_DEFAULTS[name])
    given = dict(data or {})
    _check_keys(name, given, _PREFILL_KEYS if name == "prefill" else _REPLICA_KEYS)
    values.update(given)
    values["args"] = tuple(str(a) for a in values.get("args", ()))
    return ReplicasConfig(**values)


def _owner(flag: str) -> str:
    return "the top-level block_size" if flag == "--block-size" else "from the pool the process is in"


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
