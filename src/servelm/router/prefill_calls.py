"""The two bodies of a disaggregated request, and its prefill call in the background.

    client body ─┬─▶ prefill worker: same body, max_tokens 1, stream false,
                 │     kv_transfer_params {do_remote_decode, transfer_id}         (background, PrefillCalls)
                 └─▶ decode worker: the body unchanged +
                       kv_transfer_params {do_remote_prefill, transfer_id, remote_address}   (streamed to the client)

Both are sent at once: the decode worker's pull streams each block as the prefill computes it.
The prefill's answer is never shown to the client. Its failure (unreachable, an error status) is
logged and counted, nothing more: the decode worker gives the transfer up by itself and computes
what did not arrive. The proxy cancels a call whose decode attempt failed or whose client left.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from typing import Any

import httpx

from servelm.router.replicas import Replica
from servelm.router.state import Router

logger = logging.getLogger(__name__)
TRANSFER_PARAMS = "kv_transfer_params"


def prefill_body(body: Mapping[str, Any], transfer_id: str) -> dict[str, Any]:
    """The prefill worker's copy: one token, not streamed, producing the KV under `transfer_id`.
    min_tokens goes (it may not exceed max_tokens); the client's stream options with the stream."""
    copy = dict(body)
    copy["max_tokens"] = 1
    if "max_completion_tokens" in copy:
        copy["max_completion_tokens"] = 1
    copy["stream"] = False
    copy.pop("stream_options", None)
    copy.pop("min_tokens", None)
    copy[TRANSFER_PARAMS] = {"do_remote_decode": True, "transfer_id": transfer_id}
    return copy


def decode_body(body: Mapping[str, Any], transfer_id: str, remote_address: str) -> dict[str, Any]:
    """The decode worker's copy: the client's request, pulling its prompt's KV from `remote_address`."""
    copy = dict(body)
    copy[TRANSFER_PARAMS] = {"do_remote_prefill": True, "transfer_id": transfer_id, "remote_address": remote_address}
    return copy


class PrefillCalls:
    """Owns the in-flight prefill calls: counts them per replica (`Replica.prefills_in_flight`,
    what the decider's saturation test reads) and by outcome, and cancels leftovers on close.
    Used from the router's event loop only."""

    def __init__(self, router: Router, client: httpx.AsyncClient) -> None:
        self.router = router
        self.client = client
        self._tasks: set[asyncio.Task[float | None]] = set()

    def start(
        self, replica: Replica, path: str, content: bytes, headers: Mapping[str, str]
    ) -> asyncio.Task[float | None]:
        """Send the prefill now, in the background; the replica's in-flight count rises at once.
        The task's result: time.monotonic() when the prefill worker answered OK (its prefill done),
        else None. Cancelling the task aborts the call (the replica sees the connection close)."""
        replica.prefills_in_flight += 1
        task = asyncio.create_task(self._call(replica, path, content, dict(headers)), name=f"prefill {replica.url}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def close(self) -> None:
        """Cancel every call still running (router shutdown). Safe to call twice."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _call(self, replica: Replica, path: str, content: bytes, headers: dict[str, str]) -> float | None:
        outcome = "error"
        try:
            response = await self.client.post(replica.url + path, content=content, headers=headers)
            if response.status_code < 400:
                outcome = "ok"
                return time.monotonic()
            else:
                logger.warning("prefill on %s answered %d: %s", replica.url, response.status_code, response.text[:300])
        except httpx.HTTPError as exc:
            message = f"prefill call failed: {type(exc).__name__}: {exc}"
            logger.warning("%s: %s", replica.url, message)
            self.router.metrics.failures.labels(replica.url).inc()
            await self.router.mark_down(replica, message)
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            replica.prefills_in_flight -= 1
            self.router.metrics.prefill_calls.labels(outcome).inc()
        return None
