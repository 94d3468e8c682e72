"""A running replica hands its model's files to a new one: `--model peer://HOST:PORT` on the new
replica pulls them from here, as SGLang's R-Fork and Dynamo's ModelExpress let a fleet grow
without going back to the origin.

    GET /servelm/model/servelm-manifest.json   the files, chunked, with sha256s (built once, on first ask)
    GET /servelm/model/PATH                    a file, Range requests honoured (206)

What is served is what this replica loaded: its model directory (safetensors, config,
tokenizer), or the one GGUF file it loaded. Keyed like every other route when the server has
an API key: weights are not public just because a server is.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from starlette.responses import FileResponse, Response

from servelm.delivery.manifest import MANIFEST_NAME, Manifest, build_manifest, resolve_model_file
from servelm.delivery.store import ChunkStore
from servelm.server.errors import APIError

logger = logging.getLogger(__name__)


@dataclass
class ModelFiles:
    root: Path  # the directory files are served from
    only: list[str] | None  # the files served (a GGUF model's one file), None: every model file under root
    _manifest: bytes | None = None
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @classmethod
    def of_source(cls, source: str) -> ModelFiles:
        """`source`: the path the engine loaded its weights from (a directory or a .gguf file)."""
        path = Path(source)
        return cls(path, None) if path.is_dir() else cls(path.parent, [path.name])

    async def manifest_json(self) -> bytes:
        async with self._lock:  # hashed once, however many new replicas ask at the same time
            if self._manifest is None:
                self._manifest = (await asyncio.to_thread(self._build)).to_json().encode()
            return self._manifest

    def _build(self) -> Manifest:
        pulled = ChunkStore.complete_manifest(self.root) if self.only is None else None
        return pulled or build_manifest(self.root, only=self.only)  # a pulled model's manifest is already known

    def resolve(self, path: str) -> Path | None:
        if self.only is not None and path not in self.only:
            return None
        return resolve_model_file(self.root, path)

    async def response(self, path: str) -> Response:
        if path == MANIFEST_NAME:
            return Response(await self.manifest_json(), media_type="application/json")
        resolved = self.resolve(path)
        if resolved is None:
            raise APIError(404, f"this replica's model has no file {path!r}", code="not_found")
        return FileResponse(resolved, media_type="application/octet-stream")  # Range requests -> 206


async def peer_served_name(spec: str, api_key: str | None, default: str) -> str:
    """The model name the replica at peer://HOST:PORT serves (its /v1/models), so a replica forked
    from it answers to the same name; `default` if it cannot be asked."""
    base = "http://" + spec.split("://", 1)[1].strip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with httpx.AsyncClient(timeout=10.0, headers=headers) as client:
            response = await client.get(f"{base}/v1/models")
            response.raise_for_status()
            return str(response.json()["data"][0]["id"])
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        logger.warning("could not ask %s for its model name (%s); serving as %r", spec, exc, default)
        return default
