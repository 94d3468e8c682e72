"""`servelm manifest DIR` and `servelm pull SOURCE --to DIR`: their flags and what they do.

cli.py only registers the subcommands; the flags live here in `add_*_arguments` so the
cluster distribution can extend `pull` with its own (--peers, --node-index, ...). Heavy imports
(httpx, boto3) wait for the handlers, as the other subcommands' do.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Mapping
from pathlib import Path

from servelm.delivery.manifest import (
    DEFAULT_CHUNK_BYTES,
    ManifestError,
    read_manifest,
    require_weights,
    write_manifest,
)
from servelm.delivery.pull import DEFAULT_CONNECTIONS, DEFAULT_MAX_ATTEMPTS, Puller, PullError, PullStats
from servelm.delivery.source import ChunkSource
from servelm.delivery.store import ChunkStore
from servelm.delivery.swarm_cli import add_swarm_arguments, swarm_pull_command


def add_manifest_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", type=Path, metavar="DIR", help="the model directory (the origin's copy)")
    parser.add_argument("--chunk-mb", type=float, default=DEFAULT_CHUNK_BYTES / (1 << 20), help="chunk size in MiB (default %(default)s)")  # fmt: skip


def manifest_command(args: argparse.Namespace) -> int:
    try:
        path = write_manifest(args.directory, max(1, int(args.chunk_mb * (1 << 20))))
    except (OSError, ValueError) as error:
        print(f"servelm manifest: {error}", file=sys.stderr)
        return 1
    manifest = read_manifest(args.directory)
    print(f"{path}: {len(manifest.files)} files, {len(manifest.chunks())} chunks, {manifest.total_bytes} bytes, "
          f"digest {manifest.digest}")  # fmt: skip
    return 0


def add_pull_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "source", metavar="SOURCE", help="a directory, http(s)://..., s3://BUCKET/PREFIX or peer://HOST:PORT"
    )
    parser.add_argument(
        "--to",
        type=Path,
        required=True,
        metavar="DIR",
        help="the local directory to fill (resumed if a pull was cut short)",
    )
    parser.add_argument(
        "--connections", type=int, default=DEFAULT_CONNECTIONS, help="parallel ranged reads (default %(default)s)"
    )
    parser.add_argument(
        "--max-attempts",
        type=int,
        default=DEFAULT_MAX_ATTEMPTS,
        help="reads of one chunk before the pull gives up (default %(default)s)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_swarm_arguments(parser)


def pull(
    spec: str, directory: Path, connections: int = DEFAULT_CONNECTIONS, max_attempts: int = DEFAULT_MAX_ATTEMPTS,
    progress: bool = False, headers: Mapping[str, str] | None = None,
) -> PullStats:  # fmt: skip
    """`pull_from` the source `spec` names (ValueError for a bad spec, FetchError for an
    unreachable one)."""
    from servelm.delivery.sources import open_source

    source = open_source(spec, connections, headers)
    try:
        return pull_from(source, directory, connections, max_attempts, progress)
    finally:
        source.close()


def pull_from(
    source: ChunkSource, directory: Path, connections: int = DEFAULT_CONNECTIONS,
    max_attempts: int = DEFAULT_MAX_ATTEMPTS, progress: bool = False,
) -> PullStats:  # fmt: skip
    """Fill `directory` with the source's model (resuming an interrupted pull), verified chunk by
    chunk; it is marked complete (its servelm-manifest.json) only once every chunk is there.
    Raises PullError (a chunk that kept failing), ManifestError (no or a bad manifest)."""
    manifest = source.fetch_manifest()
    require_weights(manifest, f"{source.description}'s manifest")
    store = ChunkStore.open(directory, manifest)
    puller = Puller(source, store, connections, max_attempts, progress).start()
    try:
        return puller.wait()
    finally:
        puller.stop()
        store.close()


def summary(stats: PullStats, directory: Path) -> str:
    refetched = stats.corrupt_reads + stats.failed_reads
    return (f"pulled {stats.bytes_fetched / 1e6:.1f} MB into {directory} in {stats.seconds:.2f} s "
            f"({stats.bytes_per_s / 1e6:.1f} MB/s): {stats.chunks_fetched} chunks fetched, {stats.chunks_resumed} resumed, "
            f"{refetched} re-fetched ({stats.corrupt_reads} corrupt, {stats.failed_reads} failed reads)")  # fmt: skip


def pull_command(args: argparse.Namespace) -> int:
    if args.peers:
        return swarm_pull_command(args)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per chunk otherwise
    try:
        stats = pull(args.source, args.to, args.connections, args.max_attempts, progress=not args.no_progress)
    except (PullError, ManifestError, OSError, ValueError, ImportError) as error:
        print(f"servelm pull: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"servelm pull: interrupted; the same command resumes into {args.to}", file=sys.stderr)
        return 130
    print(summary(stats, args.to), flush=True)
    return 0
