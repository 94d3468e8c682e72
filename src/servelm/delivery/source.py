"""Where chunks come from: the one interface every origin and peer sits behind.

    open_source("path/to/dir")                 LocalSource   (a directory on this machine or a mount)
    open_source("http(s)://host/models/x/")    HttpSource    (any file server that honours Range)
    open_source("s3://bucket/prefix/")         S3Source      (boto3; endpoint from AWS_ENDPOINT_URL or the AWS config)
    open_source("peer://host:port")            HttpSource    (a running servelm replica's /servelm/model/ files)

(open_source is in sources.py, each source in its own module.)

A source reads one chunk at a time and returns exactly its bytes; it does not verify them
(the store does) and does not retry (the puller does, and counts it). Implementations must be
safe to call from many threads at once: the puller reads several chunks in parallel, over
several connections.
"""

from __future__ import annotations

import re
from typing import Protocol

from servelm.delivery.manifest import ChunkRef, Manifest

# A replica serves the files it loaded under this path (`--model peer://HOST:PORT` reads them).
PEER_MODEL_PREFIX = "/servelm/model/"
PEER_SCHEME = "peer://"
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")


class FetchError(OSError):
    """A read that failed or came back short (truncated, reset, 5xx): worth retrying."""


class NotYetAvailableError(FetchError):
    """The source does not hold this chunk yet (a peer still fetching it): ask again later,
    without counting it as a failure. `retry_after_s`: when asking again may help (None: the
    puller's default pause), e.g. a swarm's next refresh of who holds what."""

    def __init__(self, message: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ChunkSource(Protocol):
    description: str  # for logs and errors: the origin's URL or path

    def fetch_manifest(self) -> Manifest:
        """The origin's servelm-manifest.json (ManifestError if it has none or it is unreadable)."""
        ...

    def read(self, chunk: ChunkRef) -> bytes:
        """Exactly bytes chunk.offset..chunk.end of chunk.file (FetchError otherwise)."""
        ...

    def close(self) -> None: ...


def content_range_matches(header: str | None, chunk: ChunkRef) -> bool:
    """Whether a Content-Range (HTTP's header, S3's ContentRange) names exactly the chunk's bytes."""
    found = _CONTENT_RANGE.fullmatch((header or "").strip())
    return found is not None and (int(found[1]), int(found[2]) + 1) == (chunk.offset, chunk.end)
