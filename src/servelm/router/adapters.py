"""Which LoRA adapters each replica serves, so a request naming one goes where it runs.

A replica's /v1/models lists the base model (parent null) and its adapters (parent: the base), as
vLLM and servelm do; the health checker reads it on every pass (a replica may load or unload
adapters at run time), and the router's own POST /v1/load_lora_adapter and /v1/unload_lora_adapter,
sent to every replica, update it at once. A request whose `model` names an adapter goes only to
replicas serving it, its prompt hashed in the adapter's prefix-cache namespace (request_view.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import httpx

from servelm.router.replicas import Replica

MODELS_PATH = "/v1/models"
LOAD_PATH = "/v1/load_lora_adapter"
UNLOAD_PATH = "/v1/unload_lora_adapter"


def adapters_in(cards: Any) -> frozenset[str] | None:
    """The adapter ids in a /v1/models body (cards with a parent); None for a body that is not a list of cards."""
    data = cards.get("data") if isinstance(cards, dict) else None
    if not isinstance(data, list):
        return None
    return frozenset(c["id"] for c in data if isinstance(c, dict) and isinstance(c.get("id"), str) and c.get("parent"))


async def fetch_adapters(client: httpx.AsyncClient, url: str, timeout_s: float,
                         headers: Mapping[str, str] | None = None) -> frozenset[str] | None:  # fmt: skip
    """What the replica at `url` lists; None when it does not answer with a list (not known)."""
    try:
        response = await client.get(url + MODELS_PATH, timeout=timeout_s, headers=dict(headers or {}))
        return adapters_in(response.json()) if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def record_change(replicas: Sequence[Replica], path: str, name: object) -> None:
    """The replicas that answered 200 to a load (`path` LOAD_PATH) or an unload of adapter `name`."""
    if not isinstance(name, str):
        return
    for replica in replicas:
        known = replica.adapters or frozenset()
        replica.adapters = known | {name} if path == LOAD_PATH else known - {name}
