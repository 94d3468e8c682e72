"""Chunks over HTTP(S): ranged GETs against any file server that honours Range (an origin, a
CDN, S3's HTTP face, a peer node's RangeFileServer, a running replica's /servelm/model/).

    HttpSource("http://origin:8080/models/llama/", connections=8).read(chunk)
      GET /models/llama/<chunk.file>   Range: bytes=<offset>-<end - 1>
        206 + Content-Range bytes <offset>-<end - 1>/<size>   the chunk
        200 (offset 0, Content-Length == length)             a whole-file chunk
        200 with the whole file (an origin that ignores Range) from then on, every chunk from one
                                                             sequential GET per file (whole_file.py)
        409                                                  NotYetAvailableError (a peer mid-pull)
        404                                                  FetchError: the file is missing at the origin
        anything else, a short body, a transport error      FetchError

One httpx.Client with a pool of `connections` keep-alive connections, shared by every puller
thread (httpx.Client is thread-safe), so each connection's TCP and TLS set-up is paid once per
pull, not once per chunk. Nothing here retries: the puller does, and counts it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import urllib.parse
from collections.abc import Iterator, Mapping

import httpx

from servelm.delivery.manifest import MANIFEST_NAME, ChunkRef, Manifest, ManifestError
from servelm.delivery.source import FetchError, NotYetAvailableError, content_range_matches
from servelm.delivery.whole_file import WholeFileStreams

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 60.0  # per network operation (connect, each read), not per chunk
# Whole-file mode keeps this many chunks per connection of a file's stream readable (whole_file.py).
WINDOW_CHUNKS_PER_CONNECTION = 2


class RangeIgnoredError(FetchError):
    """The origin answered a ranged GET with the whole file."""


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
        self.connections = connections
        self._whole_files: WholeFileStreams | None = None  # set once the origin ignored a Range
        self._mode_lock = threading.Lock()
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
        if self._whole_files is None:
            try:
                return self._read_range(chunk)
            except RangeIgnoredError as ignored:
                self._enter_whole_file_mode(chunk, ignored)
        assert self._whole_files is not None
        return self._whole_files.read(chunk)

    def _enter_whole_file_mode(self, chunk: ChunkRef, ignored: RangeIgnoredError) -> None:
        with self._mode_lock:
            if self._whole_files is None:
                logger.warning("%s; reading each file whole, in one pass, from now on", ignored)
                window = max(WINDOW_CHUNKS_PER_CONNECTION * self.connections * chunk.length, 1 << 20)
                self._whole_files = WholeFileStreams(self._open_whole_file, max_window_bytes=window)

    @contextlib.contextmanager
    def _open_whole_file(self, path: str) -> Iterator[Iterator[bytes]]:
        """A GET of the whole file: its body's pieces (FetchError unless it answers 200)."""
        url = self.url(path)
        try:
            with self._client.stream("GET", url) as response:
                if response.status_code != 200:
                    raise FetchError(f"GET {url}: HTTP {response.status_code}")
                yield self._pieces(response, url)
        except httpx.HTTPError as exc:
            raise FetchError(f"GET {url}: {exc!r}") from exc

    @staticmethod
    def _pieces(response: httpx.Response, url: str) -> Iterator[bytes]:
        try:
            yield from response.iter_raw()
        except httpx.HTTPError as exc:
            raise FetchError(f"GET {url}: {exc!r}") from exc

    def _read_range(self, chunk: ChunkRef) -> bytes:
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
            raise RangeIgnoredError(f"{where}: 200 with {length} bytes instead of the range (the origin ignores Range)")
        if status == 409:
            raise NotYetAvailableError(f"{where}: not held there yet (409)")
        if status == 404:
            raise FetchError(f"{where}: 404, the file is missing at the origin")
        raise FetchError(f"{where}: HTTP {status}")

    def close(self) -> None:
        if self._whole_files is not None:
            self._whole_files.close()
        self._client.close()
