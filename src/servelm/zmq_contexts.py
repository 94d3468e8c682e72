"""ZeroMQ contexts whose sockets never linger, for every process that talks to a peer that may die.

A socket's default linger (-1) makes `Context.term()` wait forever for messages queued to a peer
that is gone; a context dropped without `close()` (garbage-collected on some failure path) then
hangs its process at exit. With LINGER 0 as the context's default, every socket made from it
drops its unsent messages on close instead: our peers' deaths are noticed and reported by the
layers above (heartbeats, timeouts), never by waiting on the transport.

The engine-core process sets linger per socket instead: its last outputs (a fatal error, the
shutdown acknowledgement) get a second to reach the API process after it closes them.
"""

from __future__ import annotations

import zmq
import zmq.asyncio


def non_lingering_context() -> zmq.Context:
    """A blocking-API context whose sockets default to LINGER 0."""
    context: zmq.Context = zmq.Context()
    context.setsockopt(zmq.LINGER, 0)
    return context


def non_lingering_async_context() -> zmq.asyncio.Context:
    """An asyncio context whose sockets default to LINGER 0."""
    context = zmq.asyncio.Context()
    context.setsockopt(zmq.LINGER, 0)
    return context
