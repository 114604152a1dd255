"""The router's copy of a remote instance's prefix cache.

Fed by the instance's KV events (`pdd.engine.kv_events`), read along with its
load at every poll, and by the router's own knowledge: a transfer to the
instance that succeeded put the prompt's blocks there. Routing then counts a
prompt's cached prefix on that instance without a round trip. One poll
stale at most; the transfer's HAVE decides what actually crosses.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdd.engine.hashing import hash_blocks
from pdd.engine.kv_events import STORED


class CacheIndex:
    def __init__(self) -> None:
        self.epoch: str | None = None
        self.seq = 0
        self.block_size = 0
        self.namespace = b""
        self.hashes: set[bytes] = set()
        self.synced_s: float | None = None     # last poll that brought the events (time.monotonic())

    def query(self) -> str:
        """The query string asking the instance for its events since the last poll."""
        return f"kv_since={self.seq}" + (f"&kv_epoch={self.epoch}" if self.epoch else "")

    def apply(self, kv: dict, now: float) -> None:
        if kv.get("reset"):
            self.hashes.clear()
        for kind, h in kv.get("events", []):
            b = bytes.fromhex(h)
            if kind == STORED:
                self.hashes.add(b)
            else:
                self.hashes.discard(b)
        self.epoch, self.seq = str(kv["epoch"]), int(kv["seq"])
        self.block_size, self.namespace = int(kv["block_size"]), str(kv["namespace"]).encode()
        self.synced_s = now

    def fresh(self, now: float, max_age_s: float) -> bool:
        return self.synced_s is not None and now - self.synced_s <= max_age_s

    def block_hashes(self, prompt_ids: Sequence[int]) -> list[bytes]:
        return hash_blocks(prompt_ids, self.block_size, self.namespace)

    def matched_tokens(self, hashes: Sequence[bytes]) -> int:
        n = 0
        for h in hashes:
            if h not in self.hashes:
                break
            n += 1
        return n * self.block_size

    def landed(self, hashes: Sequence[bytes]) -> None:
        """A transfer of these blocks to the instance succeeded."""
        self.hashes.update(hashes)
