"""Fill a ChunkStore from a ChunkSource: parallel ranged reads, each verified, retried, journaled.

    Puller(source, store, connections=8).start()   # threads read chunks in manifest order
    puller.prioritize(chunks)                      # the streaming loader's next tensor: to the front
    puller.wake(chunks)                            # a source's chunks that became available: ask now
    stats = puller.wait()                          # every chunk held and the store finished, or raises

One thread per connection takes the most urgent missing chunk, reads it, and hands it to the
store, which verifies it before writing. A corrupt or short read is retried (with a growing
pause) up to `max_attempts` times per chunk, then the whole pull fails with that chunk named,
and every reader waiting on the store gets the error. A source that does not hold a chunk yet
(`NotYetAvailableError`, a peer mid-pull) is asked again after a pause (the error's
`retry_after_s`, or `wake` when the source learns it is there), without counting as a failure:
the source decides when to fall back to another.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from tqdm import tqdm

from servelm.delivery.manifest import ChunkRef, ManifestError
from servelm.delivery.source import ChunkSource, FetchError, NotYetAvailableError
from servelm.delivery.store import ChunkCorruptError, ChunkStore

logger = logging.getLogger(__name__)

DEFAULT_CONNECTIONS = 8
DEFAULT_MAX_ATTEMPTS = 5
RETRY_PAUSE_S = 0.2  # doubled per failed attempt of the same chunk
NOT_YET_PAUSE_S = 0.05  # how soon a chunk a peer did not hold yet is asked for again
URGENT, NORMAL = 0, 1


class PullError(RuntimeError):
    """The pull gave up: a chunk failed verification or reading `max_attempts` times."""


@dataclass
class PullStats:
    chunks_total: int
    chunks_resumed: int  # held before this pull started (the journal of an interrupted one)
    chunks_fetched: int = 0  # stored by this pull
    bytes_fetched: int = 0
    corrupt_reads: int = 0  # reads that failed verification (re-fetched)
    failed_reads: int = 0  # reads that errored or came back short (re-fetched)
    seconds: float = 0.0
    finished_at: float = 0.0  # wall clock (time.time()) when the last chunk was stored; 0 until then

    @property
    def bytes_per_s(self) -> float:
        return self.bytes_fetched / self.seconds if self.seconds > 0 else 0.0


@dataclass(order=True)
class _Job:
    priority: int
    sequence: int
    chunk: ChunkRef = field(compare=False)


class Puller:
    def __init__(
        self,
        source: ChunkSource,
        store: ChunkStore,
        connections: int = DEFAULT_CONNECTIONS,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        progress: bool = False,
        order: Iterable[ChunkRef] | None = None,
    ) -> None:
        """`order`: the chunks to fetch, most wanted first (default: what the store misses, in
        manifest order); chunks the store already holds are skipped."""
        self.source = source
        self.store = store
        self.connections = max(1, connections)
        self.max_attempts = max_attempts
        self.stats = PullStats(len(store.manifest.chunks()), store.resumed_chunks)
        self._lock = threading.Condition()
        self._queue: list[_Job] = []  # ready now, most urgent first
        self._paused: list[tuple[float, _Job]] = []  # (when it may be asked again, job): retries
        self._urgent: set[str] = set()
        self._sequence = 0
        self._attempts: Counter[str] = Counter()
        self._in_flight: set[str] = set()  # keys being read now: never handed to a second connection
        self._woken: set[str] = set()  # in flight when woken: asked again at once if this read is not-yet
        self._error: BaseException | None = None
        self._done = False
        self._threads: list[threading.Thread] = []
        self._started = 0.0
        self._progress = (
            tqdm(total=store.manifest.total_bytes, initial=store.held_bytes, unit="B", unit_scale=True,
                 unit_divisor=1024, desc="pull", smoothing=0.1)  # fmt: skip
            if progress
            else None
        )
        for chunk in order if order is not None else store.missing():
            if not store.has(chunk):
                self._push(chunk, NORMAL, 0.0)

    def _push(self, chunk: ChunkRef, priority: int, not_before: float) -> None:
        self._sequence += 1
        job = _Job(priority, self._sequence, chunk)
        if priority == URGENT:
            self._urgent.add(chunk.key)
        if not_before > time.monotonic():
            heapq.heappush(self._paused, (not_before, job))
        else:
            heapq.heappush(self._queue, job)

    def start(self) -> Puller:
        self._started = time.monotonic()
        if not self._queue and not self._paused:
            self._finish()
        for i in range(self.connections):
            thread = threading.Thread(target=self._work, name=f"pull-{i}", daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def prioritize(self, chunks: Iterable[ChunkRef]) -> None:
        """Fetch these next (those not held yet), ahead of everything queued normally."""
        with self._lock:
            for chunk in chunks:
                if not self.store.has(chunk):
                    self._push(chunk, URGENT, 0.0)  # the normal entry is skipped once this one stored it
            self._lock.notify_all()

    def wake(self, chunks: Iterable[ChunkRef]) -> int:
        """Ask for these again now, not after the pause their NotYetAvailableError set: the source
        learned they became available (a peer got them). Held chunks are skipped; a chunk queued
        twice is read once (the second copy finds it held or in flight). Returns how many were
        not held. Any thread may call it."""
        woken = 0
        with self._lock:
            for chunk in chunks:
                if chunk.key in self._in_flight:
                    self._woken.add(chunk.key)  # its read may be answering not-yet right now
                elif not self.store.has(chunk):
                    self._push(chunk, URGENT if chunk.key in self._urgent else NORMAL, 0.0)
                else:
                    continue
                woken += 1
            self._lock.notify_all()
        return woken

    def wait(self, timeout_s: float | None = None) -> PullStats:
        """Until every chunk is held and the store finished; raises PullError if the pull failed,
        TimeoutError after `timeout_s`."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._lock:
            while not self._done and self._error is None:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"pull into {self.store.directory} not done after {timeout_s} s")
                self._lock.wait(remaining if remaining is not None else 1.0)
            if self._error is not None:
                raise self._error
        return self.stats

    def stop(self) -> None:
        """Stop the threads (a pull abandoned half-way; its journal lets a later one resume)."""
        with self._lock:
            if self._error is None and not self._done:
                self._error = PullError("pull stopped")
            self._lock.notify_all()
        for thread in self._threads:
            thread.join(timeout=30)
        if self._progress is not None:
            self._progress.close()

    # --- workers ---------------------------------------------------------------------------

    def _next_job(self) -> ChunkRef | None:
        """The most urgent chunk not pausing; None when the pull is over."""
        with self._lock:
            while True:
                if self._error is not None or self._done:
                    return None
                now = time.monotonic()
                while self._paused and self._paused[0][0] <= now:
                    heapq.heappush(self._queue, heapq.heappop(self._paused)[1])
                while self._queue:
                    chunk = heapq.heappop(self._queue).chunk
                    # An urgent copy may have stored it already, or be reading it now (a failed
                    # read pushes it again, so dropping this copy loses nothing).
                    if not self.store.has(chunk) and chunk.key not in self._in_flight:
                        self._in_flight.add(chunk.key)
                        return chunk
                # A chunk woken and stored leaves its paused entry behind: a complete store waits for no pause.
                if self._paused and not self.store.is_complete():
                    self._lock.wait(self._paused[0][0] - now)
                elif not self._in_flight:
                    if self.store.is_complete():
                        self._finish_locked()
                    else:  # `order` left chunks out: nothing would ever fetch them
                        missing = len(self.store.missing())
                        self._error = PullError(f"nothing left to fetch, yet {missing} chunk(s) are missing")
                        self.store.fail(self._error)
                        self._lock.notify_all()
                    return None
                else:
                    self._lock.wait(0.1)

    def _work(self) -> None:
        while (chunk := self._next_job()) is not None:
            retry_at: float | None = None
            try:
                data = self.source.read(chunk)
                if self.store.write(chunk, data):
                    with self._lock:
                        self.stats.chunks_fetched += 1
                        self.stats.bytes_fetched += chunk.length
                    if self._progress is not None:
                        self._progress.update(chunk.length)
            except NotYetAvailableError as not_yet:
                retry_at = time.monotonic() + (not_yet.retry_after_s or NOT_YET_PAUSE_S)
                with self._lock:
                    if chunk.key in self._woken:  # woken while this read was deciding: it is there now
                        retry_at = time.monotonic()
            except (ChunkCorruptError, FetchError) as error:
                retry_at = self._failed_attempt(chunk, error)
            except BaseException as error:  # noqa: BLE001 - a bug or a broken disk ends the pull, reported to waiters
                self._fail(error)
            with self._lock:
                self._in_flight.discard(chunk.key)
                self._woken.discard(chunk.key)
                if retry_at is not None and self._error is None:
                    self._push(chunk, URGENT if chunk.key in self._urgent else NORMAL, retry_at)
                self._lock.notify_all()

    def _failed_attempt(self, chunk: ChunkRef, error: Exception) -> float | None:
        with self._lock:
            if isinstance(error, ChunkCorruptError):
                self.stats.corrupt_reads += 1
            else:
                self.stats.failed_reads += 1
            self._attempts[chunk.key] += 1
            attempts = self._attempts[chunk.key]
        logger.warning("chunk %s from %s: %s (attempt %d of %d)", chunk.key, self.source.description, error,
                       attempts, self.max_attempts)  # fmt: skip
        if attempts >= self.max_attempts:
            # Bytes that still do not match after max_attempts reads are, all but certainly, the
            # origin's own (a transfer error would not keep recurring); a read error is not.
            blame = ("; the origin's files differ from its manifest (re-run `servelm manifest` there, or restore "
                     "the files)") if isinstance(error, ChunkCorruptError) else ""  # fmt: skip
            self._fail(PullError(
                f"chunk {chunk.key} from {self.source.description} failed {attempts} times, last: {error}{blame}"
            ))  # fmt: skip
            return None
        return time.monotonic() + RETRY_PAUSE_S * 2 ** (attempts - 1)

    def _fail(self, error: BaseException) -> None:
        with self._lock:
            if self._error is None:
                self._error = error
                self.store.fail(error)
            self._lock.notify_all()

    def _finish(self) -> None:
        with self._lock:
            self._finish_locked()

    def _finish_locked(self) -> None:
        if self._done or self._error is not None:
            return
        try:
            if not ChunkStore.complete_manifest(self.store.directory) == self.store.manifest:
                self.store.finish()
        except (OSError, ManifestError) as error:
            self._error = error
            self.store.fail(error)
        else:
            self._done = True
            self.stats.seconds = time.monotonic() - self._started
            self.stats.finished_at = time.time()
            if self._progress is not None:
                self._progress.close()
        self._lock.notify_all()
