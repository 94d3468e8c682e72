"""The API's side of prefill/decode disaggregation: `kv_transfer_params` in a request body (vLLM's
field name), checked against this server's `--kv-role`, and `GET /v1/kv_transfer` for the router.

    {"do_remote_decode": true, "transfer_id": ID}                      this server prefills (producer)
    {"do_remote_prefill": true, "transfer_id": ID, "remote_address": A} this server pulls the prompt's
                                                                        KV from producer A, then decodes

The router sends both halves of one request at once; see servelm.disagg and kv/tiers.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from servelm.datatypes import KVTransferParams, KVTransferRole
from servelm.server.errors import bad_request
from servelm.server.protocol import KVTransferParamsBody

PARAM = "kv_transfer_params"
TRANSFER_SCHEMES = ("tcp://", "ipc://")


@dataclass(frozen=True)
class KVTransferInfo:
    """This server's role and, for a producer, its transfer server's address."""

    kv_role: str | None  # None: no disaggregation
    address: str | None
    block_size: int

    def describe(self) -> dict[str, Any]:
        return {"kv_role": self.kv_role, "address": self.address, "block_size": self.block_size}


def kv_transfer_for(info: KVTransferInfo, body: KVTransferParamsBody | None, n: int) -> KVTransferParams | None:
    """The engine's KVTransferParams for a request body's `kv_transfer_params`; a 400 when this
    server's role cannot take that side, or the params are incomplete."""
    if body is None:
        return None
    if info.kv_role is None:
        raise bad_request("kv_transfer_params needs a server started with --kv-role", param=PARAM)
    if body.do_remote_decode == body.do_remote_prefill:
        raise bad_request("kv_transfer_params needs exactly one of do_remote_decode, do_remote_prefill", param=PARAM)
    if not body.transfer_id:
        raise bad_request("kv_transfer_params.transfer_id must be a non-empty string", param=PARAM)
    if n != 1:
        raise bad_request("kv_transfer_params needs n = 1", param=PARAM)
    if body.do_remote_decode:
        if info.kv_role not in ("prefill", "both"):
            raise bad_request(f"do_remote_decode: this server's --kv-role is {info.kv_role}, not prefill", param=PARAM)
        return KVTransferParams(transfer_id=body.transfer_id, role=KVTransferRole.PRODUCER)
    if info.kv_role not in ("decode", "both"):
        raise bad_request(f"do_remote_prefill: this server's --kv-role is {info.kv_role}, not decode", param=PARAM)
    address = body.remote_address
    if address is None or not address.startswith(TRANSFER_SCHEMES):
        raise bad_request(
            "do_remote_prefill needs remote_address, the prefill server's transfer address (tcp://HOST:PORT)",
            param=PARAM,
        )
    return KVTransferParams(transfer_id=body.transfer_id, role=KVTransferRole.CONSUMER, peer=address)


def producer_response_params(params: KVTransferParams | None, info: KVTransferInfo) -> dict[str, Any] | None:
    """What a producer's response carries back (vLLM's shape): where and under which id to pull."""
    if params is None or params.role is not KVTransferRole.PRODUCER:
        return None
    return {"transfer_id": params.transfer_id, "remote_address": info.address}
