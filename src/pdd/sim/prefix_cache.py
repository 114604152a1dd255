"""A per-instance prefix cache over chained block ids, LRU with capacity.

Block ids are chained (equal ids imply equal prefixes), so a request's hit
is its longest run of leading ids present. When a chain is touched its blocks
are refreshed leaf first, so the root ends up most recent and eviction eats
chains from their tails: a prefix never loses its head while keeping its
tail, which would waste the tail's memory (it can no longer match).

Blocks in use by a request are *pinned* (reference counts): they stay in the
cache, count against its capacity and are never evicted, as in a paged
engine where a running request shares its prefix blocks with the cache.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class PrefixCache:
    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 0:
            raise ValueError("capacity_blocks must be >= 0")
        self.capacity_blocks = capacity_blocks
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._pins: dict[int, int] = {}
        self.num_evicted = 0

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._lru

    def match(self, block_ids: Sequence[int]) -> int:
        """Number of leading blocks held (does not refresh them)."""
        lru = self._lru
        n = 0
        for b in block_ids:
            if b not in lru:
                break
            n += 1
        return n

    @property
    def num_pinned(self) -> int:
        return len(self._pins)

    def num_unpinned(self, block_ids: Sequence[int]) -> int:
        """How many of these held blocks nobody pins yet (pinning them takes memory)."""
        return sum(1 for b in block_ids if b not in self._pins)

    def pin(self, block_ids: Sequence[int]) -> None:
        """Hold these (already cached) blocks for a request; they cannot be evicted."""
        pins = self._pins
        for b in block_ids:
            if b not in self._lru:
                raise KeyError(f"block {b} is not cached")
            pins[b] = pins.get(b, 0) + 1

    def unpin(self, block_ids: Sequence[int]) -> None:
        pins = self._pins
        for b in block_ids:
            n = pins[b] - 1
            if n:
                pins[b] = n
            else:
                del pins[b]
        self._evict()

    def set_capacity(self, capacity_blocks: int) -> None:
        """Resize (the instance's free memory changed), evicting LRU tails to fit."""
        self.capacity_blocks = max(capacity_blocks, 0)
        self._evict()

    def _evict(self) -> None:
        lru, pins = self._lru, self._pins
        while len(lru) > self.capacity_blocks:
            victim = next((b for b in lru if b not in pins), None)
            if victim is None:
                return           # everything left is in use
            del lru[victim]
            self.num_evicted += 1

    def insert(self, block_ids: Sequence[int]) -> None:
        """Hold (and refresh) every block of the chain, evicting LRU tails."""
        if self.capacity_blocks == 0:
            return
        lru = self._lru
        # A chain longer than the cache keeps only its head.
        chain = block_ids[: self.capacity_blocks]
        for b in reversed(chain):
            if b in lru:
                lru.move_to_end(b)
            else:
                lru[b] = None
        self._evict()
