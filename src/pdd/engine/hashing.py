"""Content addresses of KV blocks.

A block's hash is chained over its parent's hash and its own token ids, so two
processes that hold the same prefix compute the same hashes without talking
to each other. blake2b (not Python's salted `hash`) keeps it stable across
processes and machines.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Sequence

BlockHash = bytes  # 16 bytes
HASH_BYTES = 16
_ROOT = b"\x00" * HASH_BYTES


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], namespace: bytes = b"") -> BlockHash:
    h = hashlib.blake2b(digest_size=HASH_BYTES, person=b"pdd-kv-block")
    h.update(namespace)
    h.update(parent or _ROOT)
    h.update(array("i", token_ids).tobytes())
    return h.digest()


def hash_blocks(
    token_ids: Sequence[int],
    block_size: int,
    namespace: bytes = b"",
    start: int = 0,
    parent: BlockHash | None = None,
) -> list[BlockHash]:
    """Hashes of the full blocks of `token_ids` from block index `start` on
    (`parent` being the hash of block start-1). A trailing partial block has none."""
    out: list[BlockHash] = []
    for i in range(start, len(token_ids) // block_size):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], namespace)
        out.append(parent)
    return out
