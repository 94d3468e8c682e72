"""What the router knows about each replica: where it is, whether it is healthy, how busy.

The router process is single-threaded (one asyncio loop), so these are plain objects
mutated in place: the proxy counts requests in and out, the health checker flips
`healthy` (and sets `out_of_rotation`), the admin endpoint adds and removes entries. Nothing
here does I/O.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

# Disaggregation roles a replica may report (GET /v1/kv_transfer); a replica without one is "plain".
KV_ROLES = ("prefill", "decode", "both")


@dataclass(frozen=True)
class ReplicaSpec:
    """How to reach one replica: its HTTP base URL and, optionally, its KV-event PUB address and
    the disaggregation role its operator expects it to have.

    Parsed from `URL[,kv=tcp://HOST:PORT][,role=prefill|decode|both]` (the snapshot socket is
    PORT+1, see servelm.engine.kv_events). Placement (which machine, which process) is not here:
    the launcher decides it and hands the router only these addresses. The stated role is a
    cross-check only: the router asks the replica (roles.py), and the replica's answer wins.
    """

    url: str
    kv_events: str | None = None
    role: str | None = None

    def __post_init__(self) -> None:
        if self.role is not None and self.role not in KV_ROLES:
            raise ValueError(f"replica role must be one of {', '.join(KV_ROLES)}, got {self.role!r}")

    @classmethod
    def parse(cls, text: str) -> ReplicaSpec:
        url, *options = [part.strip() for part in text.split(",")]
        values: dict[str, str] = {}
        for option in options:
            key, _, value = option.partition("=")
            if key not in ("kv", "role") or not value:
                raise ValueError(f"bad replica option {option!r} in {text!r}; expected kv=tcp://HOST:PORT or role=ROLE")
            values[key] = value
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"replica URL must start with http:// or https://, got {url!r}")
        return cls(url.rstrip("/"), values.get("kv"), values.get("role"))

    @property
    def snapshot_address(self) -> str | None:
        """The replica's snapshot REP socket: the event port + 1."""
        if self.kv_events is None:
            return None
        host, _, port = self.kv_events.rpartition(":")
        return f"{host}:{int(port) + 1}"


@dataclass
class Replica:
    spec: ReplicaSpec
    healthy: bool = False  # set by the health checker; a new replica waits for its first pass
    in_flight: int = 0  # requests sent and not finished (streams count until their last byte)
    outstanding_tokens: int = 0  # prompt + max output tokens of those requests
    consecutive_failures: int = 0
    last_error: str = ""  # why it is out of rotation; cleared when it is back
    num_requests: int = 0  # routed here, retries included
    # What the replica reported when it last came into rotation (roles.py): None is a plain
    # (aggregated-only) replica; a producer's transfer address is where decode workers pull from.
    kv_role: str | None = None
    transfer_address: str | None = None
    prefills_in_flight: int = 0  # disaggregated prefill calls sent here and not returned
    # The LoRA adapters it serves, as its /v1/models last listed them (adapters.py; the router's own
    # load and unload calls update it at once). None: not known (it did not say): it gets any request.
    adapters: frozenset[str] | None = None
    # Set when it leaves rotation: a request still waiting there for its answer's first byte (a
    # frozen process answers nothing) is retried elsewhere. A fresh one each time it comes back.
    out_of_rotation: asyncio.Event = field(default_factory=asyncio.Event, repr=False, compare=False)

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def serves_aggregated(self) -> bool:
        """Every replica but a prefill-only one takes whole requests."""
        return self.kv_role != "prefill"

    @property
    def is_producer(self) -> bool:
        """It can prefill for another replica: a producer role and an address to pull from."""
        return self.kv_role in ("prefill", "both") and self.transfer_address is not None

    @property
    def is_consumer(self) -> bool:
        """It can decode a request whose prompt another replica computes."""
        return self.kv_role in ("decode", "both")

    def serves_model(self, lora_name: str | None) -> bool:
        """Whether it can take a request for LoRA adapter `lora_name` (None: the base model)."""
        return lora_name is None or self.adapters is None or lora_name in self.adapters

    def load(self, metric: str) -> float:
        """The raw load number the policies compare: "requests" or "tokens"."""
        return float(self.in_flight if metric == "requests" else self.outstanding_tokens)


@dataclass
class ReplicaSet:
    """Replicas by URL, in insertion order (round robin follows it)."""

    replicas: dict[str, Replica] = field(default_factory=dict)

    def add(self, spec: ReplicaSpec) -> Replica:
        """Add a replica (unhealthy until checked). Adding a URL twice replaces its spec, keeps its counters."""
        existing = self.replicas.get(spec.url)
        if existing is not None:
            existing.spec = spec
            return existing
        replica = Replica(spec)
        self.replicas[spec.url] = replica
        return replica

    def remove(self, url: str) -> Replica | None:
        return self.replicas.pop(url.rstrip("/"), None)

    def get(self, url: str) -> Replica | None:
        return self.replicas.get(url)

    def healthy(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.healthy]

    def all(self) -> list[Replica]:
        return list(self.replicas.values())

    def adapter_names(self) -> set[str]:
        """Every LoRA adapter some replica serves: a request whose `model` is one of them runs it."""
        return {name for r in self.replicas.values() if r.adapters is not None for name in r.adapters}
