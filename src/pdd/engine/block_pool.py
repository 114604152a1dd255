"""Paged-KV block pool with a content-addressed prefix cache.

Only ints, lists and dicts: no torch, so it is testable in microseconds.

Block lifecycle:
    free --allocate--> used (ref>=1) --commit(hash)--> used+cached
    used --free (ref hits 0)--> cached-evictable (if hashed) or free
    cached-evictable --acquire--> used again (a prefix-cache hit)
    cached-evictable --evicted by allocate (LRU)--> free
A block with a hash is never handed out while referenced; eviction takes the
least recently released cached block first. Blocks of one sequence are
released tail first, so a prefix's leading blocks outlive its tail.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Iterable, Sequence

from pdd.engine.hashing import BlockHash
from pdd.engine.kv_events import KvEventLog


class NoFreeBlocks(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_cache: bool = True,
                 events: KvEventLog | None = None):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_cache = enable_prefix_cache
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[BlockHash | None] = [None] * num_blocks
        self.hash_to_block: dict[BlockHash, int] = {}
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest first
        self.num_used = 0
        self.num_evictions = 0
        self.events = events        # publish / drop of cached blocks, for a router's index

    # -- capacity -------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that allocate() can hand out (free or cached-evictable)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Blocks published under a hash, referenced or not."""
        return len(self.hash_to_block)

    @property
    def num_evictable(self) -> int:
        """Cached blocks no one references: the prefix cache at rest."""
        return len(self._evictable)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    # -- allocation -----------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise NoFreeBlocks(f"need {n} KV blocks, {self.num_free} free of {self.num_blocks}")
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.popleft()
            else:
                b, _ = self._evictable.popitem(last=False)
                self._drop_hash(b)
                self.num_evictions += 1
            self.ref_counts[b] = 1
            out.append(b)
        self.num_used += n
        return out

    def acquire(self, block_ids: Iterable[int]) -> None:
        """Take a reference on blocks found in the cache (or already in use)."""
        for b in block_ids:
            if self.ref_counts[b] == 0:
                if b not in self._evictable:
                    raise ValueError(f"block {b} is free, not cached: cannot acquire")
                del self._evictable[b]
                self.num_used += 1
            self.ref_counts[b] += 1

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference per block; tail blocks are released first."""
        for b in reversed(block_ids):
            if self.ref_counts[b] <= 0:
                raise ValueError(f"block {b} freed while not referenced")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.num_used -= 1
                if self.block_hashes[b] is not None:
                    self._evictable[b] = None
                else:
                    self._free.append(b)

    # -- prefix cache ---------------------------------------------------
    def commit(self, block_id: int, block_hash: BlockHash) -> bool:
        """Publish a full, computed block under its hash. Returns False when the
        cache is off or another block already holds this content."""
        if not self.enable_prefix_cache or block_hash in self.hash_to_block:
            return False
        if self.ref_counts[block_id] <= 0:
            raise ValueError(f"block {block_id} is not in use: cannot commit")
        if self.block_hashes[block_id] is not None:
            raise ValueError(f"block {block_id} is already committed")
        self.block_hashes[block_id] = block_hash
        self.hash_to_block[block_hash] = block_id
        if self.events is not None:
            self.events.stored(block_hash)
        return True

    def lookup_prefix(self, hashes: Sequence[BlockHash]) -> list[int]:
        """Block ids of the longest prefix of `hashes` held in the cache."""
        out = []
        if not self.enable_prefix_cache:
            return out
        for h in hashes:
            b = self.hash_to_block.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def holds(self, block_hash: BlockHash) -> bool:
        return block_hash in self.hash_to_block

    def clear_cache(self) -> None:
        """Forget every evictable cached block (used blocks keep their hashes)."""
        while self._evictable:
            b, _ = self._evictable.popitem(last=False)
            self._drop_hash(b)
            self._free.append(b)

    def _drop_hash(self, b: int) -> None:
        h = self.block_hashes[b]
        if h is not None:
            del self.hash_to_block[h]
            self.block_hashes[b] = None
            if self.events is not None:
                self.events.removed(h)
