"""Chunks from an origin that ignores Range: one sequential GET per file, shared by the pull's threads.

Some origins (`python -m http.server`, some proxies) answer a ranged GET with 200 and the whole
file. The puller still asks for chunks (several threads, manifest order, each verified by the
store); this module serves them from one stream per file instead of one whole-file download per
chunk:

    file's stream:  bytes 0 ───────────────▶ position
    window:                 [start ......... position)   the bytes read most recently
    read(chunk)     in the window          → its bytes
                    ahead of position      → read on until it is in the window
                    before the window      → a new stream from byte 0 (a retry of a chunk dropped)

Streams stay open for the `max_files` files read most recently. The window keeps `max_window_bytes`, enough for every thread's chunk of the moment: threads ask
for neighbouring chunks, and the one that reads on leaves its neighbours' bytes in the window for
them. A chunk asked for after its bytes left the window costs a fresh pass over the file (a retry
after a corrupt read): correct, only slower. Nothing is resumed within a file (the origin cannot
start a file in the middle); chunks the store already holds are never asked for.
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from servelm.delivery.manifest import ChunkRef
from servelm.delivery.source import FetchError

# Files streamed at once: the pull goes file by file, so only the file it is in and the one it
# enters are read; a file evicted and asked again starts over (correct, only slower).
MAX_OPEN_FILES = 4
# Opens a whole file (a GET without Range): a context manager over its body's pieces.
OpenFile = Callable[[str], contextlib.AbstractContextManager[Iterator[bytes]]]


@dataclass
class _FileStream:
    lock: threading.Lock = field(default_factory=threading.Lock)
    stack: contextlib.ExitStack | None = None  # holds the open response
    pieces: Iterator[bytes] | None = None
    start: int = 0  # the window's first byte in the file
    window: bytearray = field(default_factory=bytearray)

    @property
    def position(self) -> int:
        return self.start + len(self.window)

    def close(self) -> None:
        if self.stack is not None:
            self.stack.close()
        self.stack, self.pieces, self.start, self.window = None, None, 0, bytearray()


class WholeFileStreams:
    def __init__(self, open_file: OpenFile, max_window_bytes: int, max_files: int = MAX_OPEN_FILES) -> None:
        self._open_file = open_file
        self.max_window_bytes = max_window_bytes
        self.max_files = max_files
        self._streams: OrderedDict[str, _FileStream] = OrderedDict()  # least recently read first
        self._lock = threading.Lock()

    def read(self, chunk: ChunkRef) -> bytes:
        """Exactly the chunk's bytes (FetchError if the file ends first or its stream breaks)."""
        with self._lock:
            stream = self._streams.setdefault(chunk.file, _FileStream())
            self._streams.move_to_end(chunk.file)
            evicted = [self._streams.popitem(last=False)[1] for _ in range(len(self._streams) - self.max_files)]
        for old in evicted:  # files the pull has moved past: their connection and window are freed
            with old.lock:
                old.close()
        with stream.lock:
            try:
                return self._read(stream, chunk)
            except FetchError:
                stream.close()  # a broken stream is not read on: the retry starts over
                raise

    def _read(self, stream: _FileStream, chunk: ChunkRef) -> bytes:
        if stream.pieces is None or chunk.offset < stream.start:
            stream.close()
            stream.stack = contextlib.ExitStack()
            stream.pieces = stream.stack.enter_context(self._open_file(chunk.file))
        while stream.position < chunk.end:
            piece = next(stream.pieces, None)
            if piece is None:
                raise FetchError(f"{chunk.file} ended at byte {stream.position}, before chunk {chunk.key}'s end {chunk.end}")
            stream.window += piece
            # The window is the max_window_bytes up to this chunk's end (and whatever the last piece
            # brought past it), never less than this chunk.
            keep_from = min(chunk.offset, chunk.end - self.max_window_bytes, stream.position)
            excess = keep_from - stream.start
            if excess > 0:
                del stream.window[:excess]
                stream.start += excess
        return bytes(stream.window[chunk.offset - stream.start : chunk.end - stream.start])

    def close(self) -> None:
        with self._lock:
            streams = list(self._streams.values())
            self._streams.clear()
        for stream in streams:
            with stream.lock:
                stream.close()
