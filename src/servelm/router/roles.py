"""Learning a replica's disaggregation role: GET /v1/kv_transfer when it comes into rotation.

    200 {"kv_role": "prefill"|"decode"|"both", "address": "tcp://HOST:PORT" | null, "block_size": N}
    404                                              a plain replica (aggregated only)
    401 / 403                                        plain too, with a warning (the router lacks the replicas' key)
    anything else (an error status, a bad body)      unknown: the replica stays out of rotation

Asked on every return to rotation, not once: a restarted replica may come back with another
role or transfer port. The role an operator stated (`--replica URL,role=...`, the cluster config,
the admin API) is only a cross-check: a mismatch is logged and the replica's answer wins, since
the replica is what will accept or refuse `kv_transfer_params`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from servelm.router.replicas import KV_ROLES, Replica

logger = logging.getLogger(__name__)
KV_TRANSFER_PATH = "/v1/kv_transfer"


@dataclass(frozen=True)
class ReplicaRole:
    """What a replica reported: role None is a plain replica (it has no /v1/kv_transfer)."""

    kv_role: str | None = None
    address: str | None = None  # producers' transfer server; None for a plain or decode-only replica
    block_size: int | None = None

    @classmethod
    def from_json(cls, data: Any) -> ReplicaRole:
        """Parse the 200 body; ValueError naming the bad field otherwise."""
        if not isinstance(data, dict):
            raise ValueError(f"expected a JSON object, got {type(data).__name__}")
        kv_role, address, block_size = data.get("kv_role"), data.get("address"), data.get("block_size")
        if kv_role not in KV_ROLES:
            raise ValueError(f"kv_role must be one of {', '.join(KV_ROLES)}, got {kv_role!r}")
        if address is not None and not (isinstance(address, str) and address.startswith("tcp://")):
            raise ValueError(f"address must be tcp://HOST:PORT or null, got {address!r}")
        if kv_role in ("prefill", "both") and address is None:
            raise ValueError(f"a {kv_role} replica must report its transfer address")
        if block_size is not None and not (isinstance(block_size, int) and block_size > 0):
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        return cls(kv_role, address, block_size)


async def fetch_role(
    client: httpx.AsyncClient, url: str, timeout_s: float, headers: Mapping[str, str] | None = None
) -> ReplicaRole:
    """Ask the replica at `url`. Raises httpx.HTTPError (unreachable) or ValueError (an answer
    that is neither a role nor 404). Read-only on both sides: safe to call any number of times."""
    response = await client.get(url + KV_TRANSFER_PATH, timeout=timeout_s, headers=dict(headers or {}))
    if response.status_code == 404:
        return ReplicaRole()
    if response.status_code in (401, 403):
        # A replica keyed differently from the router: it served before roles existed, so it still
        # does, as a plain one; only disaggregation is lost, and the log says how to get it back.
        logger.warning(
            "replica %s refused %s (%d): treated as plain; give the router the replicas' --api-key to learn roles",
            url, KV_TRANSFER_PATH, response.status_code,
        )  # fmt: skip
        return ReplicaRole()
    if response.status_code != 200:
        raise ValueError(f"{KV_TRANSFER_PATH} answered {response.status_code}")
    try:
        return ReplicaRole.from_json(response.json())
    except ValueError as exc:
        raise ValueError(f"{KV_TRANSFER_PATH}: {exc}") from None


def apply_role(replica: Replica, role: ReplicaRole, router_block_size: int) -> None:
    """Record what the replica reported on it; log where it disagrees with its spec or the router.

    Called by the health checker just before the replica enters rotation, so the proxy never
    sees a replica whose role it does not know."""
    stated = replica.spec.role
    if stated is not None and stated != role.kv_role:
        logger.warning(
            "replica %s was configured as %s but reports %s: using the replica's own role",
            replica.url, stated, role.kv_role or "no role (plain)",
        )  # fmt: skip
    if role.block_size is not None and role.block_size != router_block_size:
        logger.warning(
            "replica %s uses --block-size %d, the router %d: cache matches and uncached-prompt estimates will be wrong",
            replica.url, role.block_size, router_block_size,
        )  # fmt: skip
    if (replica.kv_role, replica.transfer_address) != (role.kv_role, role.address):
        logger.info("replica %s role: %s (transfer address %s)", replica.url, role.kv_role or "plain", role.address)
    replica.kv_role = role.kv_role
    replica.transfer_address = role.address
