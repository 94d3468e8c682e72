"""The batch flags of `servelm serve` and `servelm router` (argparse only: nothing here imports the batch machinery)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from servelm import envs


def add_batch_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("batch jobs (/v1/files, /v1/batches)")
    group.add_argument(
        "--data-dir", type=Path, default=None,
        help="where batches and their files are kept across restarts (default: $SERVELM_DATA_DIR, else "
        "~/.local/share/servelm, in a subdirectory per port); one server per directory",
    )  # fmt: skip
    group.add_argument("--max-batch-file-mb", type=float, default=200.0,
                       help="a larger upload to /v1/files gets 413 (default 200, OpenAI's)")  # fmt: skip
    group.add_argument("--max-files-per-tenant", type=int, default=10_000, help="files a tenant may hold")
    group.add_argument("--max-batches-per-tenant", type=int, default=100, help="unfinished batches a tenant may have")
    group.add_argument(
        "--batch-max-in-flight", type=int, default=None,
        help="batch lines in flight at most (default: the server's --max-num-seqs; the router's 32 per replica "
        "in rotation); a server runs fewer while interactive requests need the room",
    )  # fmt: skip


@dataclass(frozen=True)
class BatchOptions:
    """The batch flags of a front (the server or the router)."""

    data_dir: Path | None = None  # None: envs.data_dir()/<front>-<port>
    max_batch_file_mb: float = 200.0
    max_files_per_tenant: int = 10_000
    max_batches_per_tenant: int = 100
    batch_max_in_flight: int | None = None  # None: the front's own default

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> BatchOptions:
        names = [name for name in cls.__dataclass_fields__ if getattr(args, name, None) is not None]
        return cls(**{name: getattr(args, name) for name in names})

    def data_dir_for(self, front: str, port: int) -> Path:
        """--data-dir, else one directory per front and port: a restarted server finds its batches,
        and two servers on one host never share theirs."""
        return self.data_dir if self.data_dir is not None else envs.data_dir() / f"{front}-{port}"

    @property
    def max_file_bytes(self) -> int:
        return int(self.max_batch_file_mb * 2**20)
