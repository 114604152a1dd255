"""What a prefix cache published and dropped, in order, for a router's index.

The router routes on how much of a prompt each instance holds. Asking an
instance across the WAN costs a round trip on every request (~40-80 ms of
TTFT); instead the instance logs every block its cache publishes (`STORED`)
and evicts (`REMOVED`), and the router, polling for load anyway, reads the
events since its last poll and keeps a set of block hashes per instance. The
index is a hint, one poll stale at most: the transfer's HAVE decides what
actually crosses.

The log is bounded: a reader that fell further behind than its capacity (or
that asks another epoch: the instance restarted) gets a snapshot of the
cache instead. Written by the engine thread, read by the HTTP thread: one
lock around the deque.
"""

from __future__ import annotations

import threading
import uuid
from collections import deque
from collections.abc import Callable, Iterable

STORED = 1
REMOVED = -1
DEFAULT_CAPACITY = 65536


class KvEventLog:
    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.epoch = uuid.uuid4().hex[:12]
        self._events: deque[tuple[int, bytes]] = deque(maxlen=capacity)
        self._next_seq = 0                      # sequence number of the next event
        self._lock = threading.Lock()

    def stored(self, block_hash: bytes) -> None:
        self._add(STORED, block_hash)

    def removed(self, block_hash: bytes) -> None:
        self._add(REMOVED, block_hash)

    def _add(self, kind: int, block_hash: bytes) -> None:
        with self._lock:
            self._events.append((kind, block_hash))
            self._next_seq += 1

    def read(self, since: int, epoch: str | None, snapshot: Callable[[], Iterable[bytes]]) -> dict:
        """Events from sequence number `since` of `epoch` on; a snapshot (every
        hash `snapshot()` gives, `reset` true) when they are no longer all kept."""
        with self._lock:
            seq = self._next_seq
            first = seq - len(self._events)
            if epoch == self.epoch and first <= since <= seq:
                events = list(self._events)[since - first:]
                return {"epoch": self.epoch, "seq": seq, "reset": False,
                        "events": [[kind, h.hex()] for kind, h in events]}
        # Sequence number first, then the cache: what changes in between is
        # also in the events read from `seq` next time (each applies idempotently).
        return {"epoch": self.epoch, "seq": seq, "reset": True,
                "events": [[STORED, h.hex()] for h in list(snapshot())]}
