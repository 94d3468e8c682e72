"""Where the builder's weights come from: a local path as it is, or a remote `--model` pulled
into the download directory while the model loads from it (servelm.delivery.streaming).

    opened = open_model(config.model, startup)           # remote: the pull starts, metadata arrives
    checkpoint = load_checkpoint(opened.path, ..., opened.before_read)
    model = build_model(checkpoint...)                   # each tensor waits for its bytes
    opened.finish()                                      # the pull complete: the `fetch` phase ends

The engine core runs this, so the pull's threads live next to the loader that waits on them;
`fetch` and `verify` go into the start-up timeline with the other phases.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from servelm import envs
from servelm.config import ModelConfig
from servelm.delivery.source import PEER_SCHEME
from servelm.delivery.sources import is_remote, open_source
from servelm.delivery.streaming import RemoteModel, start_pull
from servelm.models.hf_loader import BeforeRead
from servelm.obs.startup import StartupTimeline

logger = logging.getLogger(__name__)


@dataclass
class OpenedModel:
    path: str | None  # what load_checkpoint reads (None: the embedded default model)
    before_read: BeforeRead | None = None
    remote: RemoteModel | None = None
    startup: StartupTimeline | None = None

    def finish(self) -> None:
        """Wait for the rest of a remote pull; record its `fetch` phase. Nothing for a local path."""
        if self.remote is None:
            return
        stats = self.remote.finish()
        if self.startup is not None:
            # The phase ends when the last chunk was stored, not when this is called (after the
            # load phase: the timeline would say the fetch outlasted the load that needed it).
            ended_at = stats.finished_at or time.time()
            self.startup.add("fetch", self.remote.started_at, max(0.0, ended_at - self.remote.started_at))
        logger.info(
            "pulled %s into %s: %.1f MB fetched in %.1f s (%.0f MB/s), %d chunk(s) resumed, %d re-fetched",
            self.remote.spec, self.remote.directory, stats.bytes_fetched / 1e6, stats.seconds,
            stats.bytes_per_s / 1e6, stats.chunks_resumed, stats.corrupt_reads + stats.failed_reads,
        )  # fmt: skip


def download_dir(config: ModelConfig) -> Path:
    return Path(config.download_dir).expanduser() if config.download_dir else envs.cache_dir() / "models"


def open_model(config: ModelConfig, startup: StartupTimeline | None = None, stream: bool = True) -> OpenedModel:
    """A local model as it is; a remote one pulled into the download directory.

    `stream`: load while the pull runs (safetensors); False waits for the whole pull first (the
    ranks of a multi-rank worker each read the finished directory)."""
    spec = config.model
    if not is_remote(spec):
        return OpenedModel(spec)
    headers = {"Authorization": f"Bearer {key}"} if spec.startswith(PEER_SCHEME) and (key := envs.peer_api_key()) else None
    source = open_source(spec, connections=config.pull_connections, headers=headers)
    remote = start_pull(source, spec, download_dir(config), config.pull_connections)
    if startup is not None and remote.verify_seconds:
        startup.add("verify", remote.started_at - remote.verify_seconds, remote.verify_seconds)
    opened = OpenedModel(str(remote.directory), remote=remote, startup=startup)
    if stream and remote.streamable():
        remote.wait_for_metadata()
        opened.before_read = remote.before_read
    else:
        opened.finish()
        opened.remote = None  # finished: nothing left to wait for
    return opened
