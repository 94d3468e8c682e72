"""The one block-hash function.

The prefix cache, KV events, the router's prefix index and disaggregation all name a
full KV block by this hash, so it must give the same bytes in every process, on every
machine and under every Python (never `hash()`, which is salted per process).

A block's hash covers its own tokens *and*, through the parent hash, every token
before it: equal hashes mean equal prefixes, so a hit on block i implies blocks
0..i-1 match too.

    hash(block i) = sha256( DOMAIN
                          | hash(block i-1)            (32 zero bytes for block 0)
                          | len(extra_key) as u32 LE | extra_key
                          | token ids as i64 LE )       (exactly block_size of them)

`extra_key` separates caches that must not share KV although the tokens agree
(a tenant's `cache_salt`). It is length-prefixed so no (extra_key, tokens) pair can
collide with another by shifting bytes between the two; `None` and b"" are the same key.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

# 32 raw bytes of sha256. Bytes rather than an int: they cross processes and go into
# events unchanged; `.hex()` is the human form.
BlockHash = bytes

# Bump the version when the byte layout changes: old and new hashes then never meet.
_DOMAIN = b"servelm-kv-block-v1\x00"
_ROOT_PARENT = bytes(32)
_U32_LE = struct.Struct("<I")


def hash_block(parent_hash: BlockHash | None, token_ids: Sequence[int], extra_key: bytes | None = None) -> BlockHash:
    """Hash of one full block whose predecessor hashes to `parent_hash` (None: first block)."""
    extra = extra_key or b""
    digest = hashlib.sha256(_DOMAIN)
    digest.update(_ROOT_PARENT if parent_hash is None else parent_hash)
    digest.update(_U32_LE.pack(len(extra)))
    digest.update(extra)
    digest.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return digest.digest()


def extend_block_hashes(
    block_hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    extra_key: bytes | None = None,
) -> list[BlockHash]:
    """Append to `block_hashes` the hashes of the full blocks of `token_ids` it lacks.

    `block_hashes` must already hold the hashes of the first len(block_hashes) blocks of
    these same tokens; the chain continues from its last entry. Returns the same list.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    num_full_blocks = len(token_ids) // block_size
    parent = block_hashes[-1] if block_hashes else None
    for i in range(len(block_hashes), num_full_blocks):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], extra_key)
        block_hashes.append(parent)
    return block_hashes


def hash_block_tokens(token_ids: Sequence[int], block_size: int, extra_key: bytes | None = None) -> list[BlockHash]:
    """Hashes of every FULL block of a sequence, in order (a trailing partial block has none)."""
    return extend_block_hashes([], token_ids, block_size, extra_key)


def extra_key_from_salt(cache_salt: str | None) -> bytes | None:
    """The extra key for a request's `cache_salt` (UTF-8), or None when it has none."""
    return cache_salt.encode("utf-8") if cache_salt else None


def extra_key_of(cache_salt: str | None, lora_name: str | None) -> bytes | None:
    """The extra key for a request's salt and LoRA adapter. Without an adapter, the salt's alone (the
    router, which sees salts, hashes base-model requests alike). With one: 0xFF (a byte no UTF-8 text
    holds, so no salt alone can equal it), the salt's length and bytes, then the adapter's name."""
    salt = extra_key_from_salt(cache_salt)
    if lora_name is None:
        return salt
    salt = salt or b""
    return b"\xff" + len(salt).to_bytes(4, "little") + salt + lora_name.encode("utf-8")
