"""Nonces of accepted signatures, remembered for the validity window.

Pure (time passed in as `now`), bounded memory. A signature is accepted once:
its nonce stays here until its timestamp leaves the window, after which the
freshness check refuses it anyway. When the cache is full the entry with the
oldest timestamp is dropped and `floor_s` rises to that timestamp; from then
on anything signed at or before `floor_s` is refused. So an evicted nonce can
never be replayed: under a flood the window only narrows, it never leaks.
Only signatures whose MAC already checked out reach this cache, so filling
it takes a holder of the key.
"""

from __future__ import annotations

import heapq
import math

DEFAULT_MAX_ENTRIES = 65536   # ~10 MB at most; >500 signed calls/s sustained for a 120 s window


class ReplayCache:
    def __init__(self, window_s: float, max_entries: int = DEFAULT_MAX_ENTRIES):
        if max_entries < 1:
            raise ValueError("max_entries must be >= 1")
        self.window_s = window_s
        self.max_entries = max_entries
        self.floor_s = -math.inf
        self._seen: set[str] = set()
        self._by_time: list[tuple[float, str]] = []   # min-heap of (timestamp, nonce)

    def __len__(self) -> int:
        return len(self._seen)

    def accept(self, nonce: str, ts_s: float, now: float) -> bool:
        """True the first time a (fresh) nonce is shown; False for a replay or
        for a timestamp at or below the eviction floor."""
        self._expire(now)
        if nonce in self._seen or ts_s <= self.floor_s:
            return False
        while len(self._seen) >= self.max_entries:
            old_ts, old_nonce = heapq.heappop(self._by_time)
            self._seen.discard(old_nonce)
            self.floor_s = max(self.floor_s, old_ts)
        if ts_s <= self.floor_s:
            return False
        self._seen.add(nonce)
        heapq.heappush(self._by_time, (ts_s, nonce))
        return True

    def _expire(self, now: float) -> None:
        # A timestamp older than now - window fails the freshness check before
        # the cache is asked, so its nonce need not be remembered.
        while self._by_time and self._by_time[0][0] < now - self.window_s:
            _, nonce = heapq.heappop(self._by_time)
            self._seen.discard(nonce)
