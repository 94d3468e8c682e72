"""The disk tier's files (L3): one file per KV block, named by the model's fingerprint and the
block's hash, checksummed, written atomically. Torch-free: payloads are bytes here; the worker
turns pool slices into bytes and back.

    ROOT/<fingerprint>/<hash[0:2]>/<hash>.kv        (hash: the block hash in hex)

    file = MAGIC (8) | fingerprint digest (32) | block hash (32) | payload length (u64 LE)
           | crc32 of the payload (u32 LE) | payload

- The fingerprint names the model, KV dtype and block geometry (kv/fingerprint.py): replicas of
  one model share a directory; no model ever reads another's KV (different folder, and the
  header is checked too, in case files are copied around).
- Writes go to a temporary name in the same folder and are renamed into place, so a reader sees
  a whole file or none; a crash mid-write leaves only a temporary file, removed by the next scan.
- A file that is truncated, corrupted, or for another model/block reads as `CorruptBlockFile`:
  the caller treats it as a miss (and deletes it), never as KV.
"""

from __future__ import annotations

import hashlib
import os
import struct
import threading
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from servelm.kv.block_hash import BlockHash

MAGIC = b"SVLMKV01"
_HEADER = struct.Struct("<8s32s32sQI")
HEADER_BYTES = _HEADER.size
_SUFFIX = ".kv"
_TEMP_MARK = ".tmp-"


class CorruptBlockFile(Exception):
    """A block file that must not be used: the message says what was wrong with it."""


@dataclass(frozen=True)
class StoredFile:
    block_hash: BlockHash
    num_bytes: int
    mtime: float


class DiskBlockStore:
    """Block files of one model fingerprint under one root directory.

    Thread-safety: every method is safe from any thread; two writers of the same block (two
    replicas) both succeed and the last rename wins (the contents are equal).
    """

    def __init__(self, root: str | Path, fingerprint: str) -> None:
        if not fingerprint:
            raise ValueError("a disk KV store needs a model fingerprint")
        self.directory = Path(root) / fingerprint
        self.directory.mkdir(parents=True, exist_ok=True)
        self._fingerprint_digest = hashlib.sha256(fingerprint.encode()).digest()

    def path(self, block_hash: BlockHash) -> Path:
        name = block_hash.hex()
        return self.directory / name[:2] / f"{name}{_SUFFIX}"

    def file_bytes(self, payload_bytes: int) -> int:
        """Bytes on disk of a block with `payload_bytes` of KV."""
        return HEADER_BYTES + payload_bytes

    def exists(self, block_hash: BlockHash) -> bool:
        return self.path(block_hash).is_file()

    def write(self, block_hash: BlockHash, payload: bytes | memoryview) -> None:
        """Store one block atomically. Raises OSError (a full disk: ENOSPC) with nothing left behind."""
        target = self.path(block_hash)
        target.parent.mkdir(exist_ok=True)
        header = _HEADER.pack(MAGIC, self._fingerprint_digest, block_hash, len(payload), zlib.crc32(payload))
        temporary = target.with_name(f"{target.name}{_TEMP_MARK}{os.getpid()}-{threading.get_ident()}")
        try:
            with open(temporary, "wb") as file:
                file.write(header)
                file.write(payload)
            os.replace(temporary, target)
        except BaseException:
            temporary.unlink(missing_ok=True)
            raise

    def read(self, block_hash: BlockHash, expected_payload_bytes: int) -> bytes:
        """The block's payload. FileNotFoundError when absent; CorruptBlockFile when it must not be used."""
        with open(self.path(block_hash), "rb") as file:
            data = file.read()
        if len(data) < HEADER_BYTES:
            raise CorruptBlockFile(f"truncated header ({len(data)} bytes)")
        magic, fingerprint, stored_hash, length, checksum = _HEADER.unpack_from(data)
        if magic != MAGIC:
            raise CorruptBlockFile("not a servelm KV block file")
        if fingerprint != self._fingerprint_digest or stored_hash != block_hash:
            raise CorruptBlockFile("the file belongs to another model or block")
        payload = data[HEADER_BYTES:]
        if length != expected_payload_bytes or len(payload) != length:
            raise CorruptBlockFile(
                f"payload of {len(payload)} bytes, header {length}, expected {expected_payload_bytes}"
            )
        if zlib.crc32(payload) != checksum:
            raise CorruptBlockFile("checksum mismatch")
        return payload

    def delete(self, block_hash: BlockHash) -> None:
        self.path(block_hash).unlink(missing_ok=True)

    def scan(self) -> Iterator[StoredFile]:
        """The block files present (any order), removing temporaries that crashed writers left."""
        for path in self.directory.glob("*/*"):
            if _TEMP_MARK in path.name:
                path.unlink(missing_ok=True)
                continue
            if not path.name.endswith(_SUFFIX):
                continue
            try:
                block_hash = bytes.fromhex(path.name[: -len(_SUFFIX)])
                stat = path.stat()
            except (ValueError, OSError):
                continue  # not ours, or gone meanwhile (another replica evicted it)
            yield StoredFile(block_hash, stat.st_size, stat.st_mtime)
