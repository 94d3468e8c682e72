"""How a swarm node is set up (`servelm pull --peers ...`): plain data, no network imports, so the
command line can build its flags from these defaults without importing httpx."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit


def normalize_url(url: str) -> str:
    return url if url.endswith("/") else url + "/"


@dataclass(frozen=True)
class SwarmConfig:
    peers: tuple[str, ...]  # every initial node's peer-server URL, in node order
    node_index: int | None = None  # this node's position in `peers`; None: it joins late and owns no share
    peer_host: str | None = None  # bind address (default: the host of peers[node_index], else 127.0.0.1)
    peer_port: int | None = None  # default: the port of peers[node_index], else any free one
    seed_s: float = 60.0  # most seconds to keep serving after completing
    seed_min_s: float = 0.0  # least seconds to keep serving (for nodes that may still join)
    grace_s: float = 5.0  # a peer not answering for this long is gone: its share is reassigned
    refresh_s: float = 0.2  # how often each peer's held chunks are polled
    origin_connections: int = 4  # concurrent reads from the origin
    peer_connections: int = 8  # concurrent reads from peers (all of them together)

    def __post_init__(self) -> None:
        if not self.peers:
            raise ValueError("a swarm needs --peers (every initial node's peer URL, in node order)")
        if self.node_index is not None and not 0 <= self.node_index < len(self.peers):
            raise ValueError(f"--node-index {self.node_index} is not a position in --peers ({len(self.peers)} nodes)")
        for name in ("seed_s", "seed_min_s", "grace_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.refresh_s <= 0 or self.origin_connections < 1 or self.peer_connections < 1:
            raise ValueError("refresh_s must be > 0 and the connection counts >= 1")

    def bind_address(self) -> tuple[str, int]:
        own = urlsplit(self.peers[self.node_index]) if self.node_index is not None else None
        host = self.peer_host or (own.hostname if own and own.hostname else "127.0.0.1")
        port = self.peer_port if self.peer_port is not None else (own.port or 80) if own else 0
        return host, port

    def own_url(self, bound_port: int) -> str:
        """The URL peers reach this node at: its --peers entry, or (late joiner) built from the bind address."""
        if self.node_index is not None:
            return normalize_url(self.peers[self.node_index])
        host = self.bind_address()[0]
        if host in ("0.0.0.0", "::", ""):
            raise ValueError("a late joiner bound to every interface must be given a --peer-host peers can reach")
        return f"http://{host}:{bound_port}/"
