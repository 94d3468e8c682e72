"""`open_source(spec)`: the ChunkSource a command-line SOURCE names.

    path/to/dir             LocalSource
    http(s)://host/path/    HttpSource
    s3://bucket/prefix      S3Source (boto3; endpoint from AWS_ENDPOINT_URL or the AWS config)
    peer://host:port        HttpSource on http://host:port/servelm/model/ (a running replica)

Only `scheme://` makes a spec remote: anything else is a local path, however odd.
"""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Callable, Mapping

from typing_extensions import TypeIs

from servelm.delivery.http_source import HttpSource
from servelm.delivery.local_source import LocalSource
from servelm.delivery.s3_source import S3Source
from servelm.delivery.source import PEER_MODEL_PREFIX, ChunkSource

_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")
Opener = Callable[[urllib.parse.SplitResult, int, Mapping[str, str] | None], ChunkSource]


def _http(url: urllib.parse.SplitResult, connections: int, headers: Mapping[str, str] | None) -> ChunkSource:
    return HttpSource(url.geturl(), connections, headers)


def _s3(url: urllib.parse.SplitResult, connections: int, headers: Mapping[str, str] | None) -> ChunkSource:
    if not url.netloc:
        raise ValueError("an S3 source is s3://BUCKET/PREFIX")
    return S3Source(url.netloc, url.path.strip("/"), connections=connections)


def _peer(url: urllib.parse.SplitResult, connections: int, headers: Mapping[str, str] | None) -> ChunkSource:
    if not url.netloc or url.path.strip("/") or url.port is None:
        raise ValueError("a peer source is peer://HOST:PORT (a running servelm replica)")
    return HttpSource(f"http://{url.netloc}{PEER_MODEL_PREFIX}", connections, headers)


_OPENERS: dict[str, Opener] = {"http": _http, "https": _http, "s3": _s3, "peer": _peer}


def _scheme(spec: str) -> str | None:
    found = _SCHEME.match(spec)
    return found[1].lower() if found else None


def is_remote(spec: str | None) -> TypeIs[str]:
    """Whether `spec` names a source elsewhere (a URL of any scheme), not a local path (nor None,
    the embedded default model)."""
    return spec is not None and _scheme(spec) is not None


def open_source(spec: str, connections: int = 8, headers: Mapping[str, str] | None = None) -> ChunkSource:
    """The source `spec` names; ValueError for a scheme not listed above (the error lists them)."""
    scheme = _scheme(spec)
    if scheme is None:
        return LocalSource(spec)
    opener = _OPENERS.get(scheme)
    if opener is None:
        accepted = ", ".join(f"{name}://" for name in _OPENERS)
        raise ValueError(f"{spec!r}: unknown source scheme {scheme!r}; accepted: a local path, {accepted}")
    try:
        return opener(urllib.parse.urlsplit(spec), connections, headers)
    except ValueError as exc:  # a malformed URL (a bad port, no bucket)
        raise ValueError(f"{spec!r}: {exc}") from exc
