"""The block hash is a wire format: routers and other replicas compare these bytes."""

import hashlib
import struct

import pytest

from servelm.kv.block_hash import (
    extend_block_hashes,
    extra_key_from_salt,
    hash_block,
    hash_block_tokens,
)

# Golden values. If one of these changes, every replica, router index and stored KV
# event disagrees with the previous release: bump _DOMAIN's version deliberately.
GOLDEN_FIRST_BLOCK = "4b22566829117da718c6267eef0d0cdb4ba04f31b8eb9b28ab4c0b133fd53fc1"  # [0, 1, 2, 3]
GOLDEN_SECOND_BLOCK = "1fb8b4b1a1c290aa729b46a6896f4d87c44dfac0d8f10dd0123b4c2588a6a362"  # [4..7] after [0..3]
GOLDEN_SALTED = "8a8441288a363e9cae31060d0a9dc50ccfad18851c76c8f8d09972ceb8e769e6"  # [1, 2, 3, 4], b"tenant-a"


def test_golden_values() -> None:
    assert hash_block(None, [0, 1, 2, 3]).hex() == GOLDEN_FIRST_BLOCK
    assert hash_block_tokens(list(range(8)), 4)[1].hex() == GOLDEN_SECOND_BLOCK
    assert hash_block(None, [1, 2, 3, 4], b"tenant-a").hex() == GOLDEN_SALTED


def test_layout_matches_the_documented_bytes() -> None:
    # A second, independent statement of the layout in the module docstring.
    parent = bytes.fromhex(GOLDEN_FIRST_BLOCK)
    extra = b"salt"
    payload = (
        b"servelm-kv-block-v1\x00" + parent + struct.pack("<I", len(extra)) + extra + struct.pack("<4q", 4, 5, 6, 7)
    )
    assert hash_block(parent, [4, 5, 6, 7], extra) == hashlib.sha256(payload).digest()


def test_chain_and_partial_blocks() -> None:
    tokens = list(range(10))
    hashes = hash_block_tokens(tokens, 4)
    assert len(hashes) == 2  # tokens 8, 9 form a partial block: no hash
    assert hashes[0] == hash_block(None, tokens[:4])
    assert hashes[1] == hash_block(hashes[0], tokens[4:8])
    assert all(len(h) == 32 for h in hashes)


def test_a_hash_depends_on_the_whole_prefix() -> None:
    a = hash_block_tokens([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = hash_block_tokens([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert a[1] != b[1]  # same tokens in block 1, different parent


def test_extra_key_separates_namespaces() -> None:
    tokens = [1, 2, 3, 4]
    assert hash_block(None, tokens) != hash_block(None, tokens, b"x")
    assert hash_block(None, tokens, b"x") != hash_block(None, tokens, b"y")
    assert hash_block(None, tokens, None) == hash_block(None, tokens, b"")
    assert extra_key_from_salt(None) is None
    assert extra_key_from_salt("é") == "é".encode()


def test_large_token_ids_do_not_collide_with_small_ones() -> None:
    assert hash_block(None, [2**40]) != hash_block(None, [0])


def test_extend_continues_a_chain() -> None:
    tokens = list(range(13))
    partial = hash_block_tokens(tokens[:5], 4)
    assert extend_block_hashes(partial, tokens, 4) == hash_block_tokens(tokens, 4)
    with pytest.raises(ValueError):
        hash_block_tokens(tokens, 0)
