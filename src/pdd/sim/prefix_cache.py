"""A per-instance prefix cache over chained block ids, LRU with capacity.

Block ids are chained (equal ids imply equal prefixes), so a request's hit
is its longest run of leading ids present. When a chain is touched its blocks
are refreshed leaf first, so the root ends up most recent and eviction eats
chains from their tails: a prefix never loses its head while keeping its
tail, which would waste the tail's memory (it can no longer match).
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

    def set_capacity(self, capacity_blocks: int) -> None:
        """Resize (the instance's free memory changed), evicting LRU tails to fit."""
        self.capacity_blocks = max(capacity_blocks, 0)
        self._evict()

    def _evict(self) -> None:
        lru = self._lru
        while len(lru) > self.capacity_blocks:
            lru.popitem(last=False)
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
