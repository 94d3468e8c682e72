"""Chunks over HTTP(S): ranged GETs against any file server that honours Range (an origin, a
CDN, S3's HTTP face, a peer node's RangeFileServer, a running replica's /servelm/model/).

    HttpSource("http://origin:8080/models/llama/", connections=8).read(chunk)
      GET /models/llama/<chunk.file>   Range: bytes=<offset>-<end - 1>
        206 + Content-Range bytes <offset>-<end - 1>/<size>   the chunk
        200 (offset 0, Content-Length == length)             a whole-file chunk (a server without Range)
        409                                                  NotYetAvailableError (a peer mid-pull)
        404                                                  FetchError: the file is missing at the origin
        anything else, a short body, a transport error      FetchError

One httpx.Client with a pool of `connections` keep-alive connections, shared by every puller
thread (httpx.Client is thread-safe), so each connection's TCP and TLS set-up is paid once per
pull, not once per chunk. Nothing here retries: the puller does, and counts it.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Mapping

import httpx

from servelm.delivery.manifest import MANIFEST_NAME, ChunkRef, Manifest, ManifestError
from servelm.delivery.source import FetchError, NotYetAvailableError, content_range_matches

DEFAULT_TIMEOUT_S = 60.0  # per network operation (connect, each read), not per chunk


class HttpSource:
    """A ChunkSource over HTTP(S); `headers` go with every request (e.g. an Authorization)."""

    def __init__(
        self,
        base_url: str,
        connections: int = 8,
        headers: Mapping[str, str] | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self.base_url = base_url if base_url.endswith("/") else base_url + "/"
        self.description = self.base_url
        limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
        # follow_redirects: hubs answer a file's URL with a redirect to their CDN; httpx keeps
        # the Range header across it.
        self._client = httpx.Client(
            headers=dict(headers or {}), timeout=timeout_s, limits=limits, follow_redirects=True
        )

    def url(self, path: str) -> str:
        """The URL of `path` (relative, '/'-separated): each segment percent-quoted."""
        return self.base_url + urllib.parse.quote(path, safe="/")

    def fetch_manifest(self) -> Manifest:
        url = self.url(MANIFEST_NAME)
        try:
            response = self._client.get(url)
        except httpx.HTTPError as exc:
            raise FetchError(f"GET {url}: {exc!r}") from exc
        if response.status_code == 404:
            raise ManifestError(
                f"{url}: 404, the origin serves no {MANIFEST_NAME} (run `servelm manifest DIR` on the origin's model "
                "directory)"
            )
        if response.status_code != 200:
            raise FetchError(f"GET {url}: HTTP {response.status_code} {response.text[:200]!r}")
        return Manifest.from_json(response.content, url)

    def read(self, chunk: ChunkRef) -> bytes:
        url = self.url(chunk.file)
        where = f"chunk {chunk.key} (bytes {chunk.offset}-{chunk.end - 1}) from {url}"
        # An empty file's one chunk has no byte to name in a Range: ask for the whole (empty) file.
        headers = {"Range": f"bytes={chunk.offset}-{chunk.end - 1}"} if chunk.length else {}
        # The body lands in one preallocated buffer: response.read() joins its 64 KiB pieces
        # more than once, which halved the throughput one core can take in (250 vs 480 MB/s).
        data = bytearray(chunk.length)
        received = 0
        try:
            with self._client.stream("GET", url, headers=headers) as response:
                self._check_status(response, chunk, where)
                for piece in response.iter_raw():
                    if received + len(piece) > chunk.length:
                        raise FetchError(f"{where}: more than the {chunk.length} bytes asked for")
                    data[received : received + len(piece)] = piece
                    received += len(piece)
        except httpx.HTTPError as exc:
            raise FetchError(f"{where}: {exc!r}") from exc
        if received != chunk.length:
            raise FetchError(f"{where}: {received} bytes, expected {chunk.length}")
        return bytes(data)

    @staticmethod
    def _check_status(response: httpx.Response, chunk: ChunkRef, where: str) -> None:
        """Raise unless `response` is about to deliver exactly the chunk (checked before the body
        is read, so a server that ignores Range does not send a whole shard for one chunk)."""
        status = response.status_code
        if status == 206:
            if not content_range_matches(response.headers.get("Content-Range"), chunk):
                raise FetchError(f"{where}: 206 with Content-Range {response.headers.get('Content-Range')!r}")
            return
        if status == 200:
            length = response.headers.get("Content-Length")
            if chunk.offset == 0 and length is not None and int(length) == chunk.length:
                return  # the whole file is this one chunk
            raise FetchError(f"{where}: 200 with {length} bytes instead of the range (does the server honour Range?)")
        if status == 409:
            raise NotYetAvailableError(f"{where}: not held there yet (409)")
        if status == 404:
            raise FetchError(f"{where}: 404, the file is missing at the origin")
        raise FetchError(f"{where}: HTTP {status}")

    def close(self) -> None:
        self._client.close()
