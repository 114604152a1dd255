"""The discrete-event loop: a heap of events, handlers that return new ones.

Ties are broken on (time, kind, key, seq): events at the same instant run in
the order of their kind (completions before new work, so a freed slot is seen
by an arrival at that instant), then by a stable string key (instance or
request id), then in order of creation. No wall clock, no randomness: the
same inputs replay the same run event for event.

Handlers are registered per kind and may return None or an iterable of
events. An object that wants to cancel a scheduled event bumps its own
version counter and ignores the stale event when it fires: deleting from a
heap is dearer than skipping.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable
from enum import IntEnum
from typing import Any


class EventKind(IntEnum):
    # Order matters: lower runs first among events at the same time.
    TRANSFER_DONE = 0
    STEP_END = 1
    CORE_DONE = 2       # a step on a time-sliced CPU core ended
    MESSAGE = 3
    ARRIVAL = 4
    STEP_START = 5


class Event:
    __slots__ = ("time", "kind", "key", "data")

    def __init__(self, time: float, kind: EventKind, key: str, data: Any = None) -> None:
        if math.isnan(time):
            raise ValueError(f"event {kind.name}/{key} at NaN time")
        self.time = time
        self.kind = kind
        self.key = key
        self.data = data

    def __repr__(self) -> str:
        return f"Event({self.time:.6f}, {self.kind.name}, {self.key!r})"


Handler = Callable[[Event], Iterable[Event] | None]


class EventLoop:
    def __init__(self) -> None:
        self._heap: list[tuple[float, int, str, int, Event]] = []
        self._seq = 0
        self._handlers: dict[EventKind, Handler] = {}
        self.now = 0.0
        self.num_events = 0

    def on(self, kind: EventKind, handler: Handler) -> None:
        if kind in self._handlers:
            raise ValueError(f"handler for {kind.name} already registered")
        self._handlers[kind] = handler

    def push(self, event: Event) -> None:
        if event.time < self.now:
            raise ValueError(f"{event!r} is in the past (now={self.now:.6f})")
        heapq.heappush(self._heap, (event.time, int(event.kind), event.key, self._seq, event))
        self._seq += 1

    def extend(self, events: Iterable[Event] | None) -> None:
        for ev in events or ():
            self.push(ev)

    def __len__(self) -> int:
        return len(self._heap)

    def peek_time(self) -> float:
        return self._heap[0][0] if self._heap else math.inf

    def run(self, until_s: float = math.inf, max_events: int | None = None) -> int:
        """Process events with time <= until_s; returns how many ran."""
        handled = 0
        heap = self._heap
        handlers = self._handlers
        while heap and heap[0][0] <= until_s:
            if max_events is not None and handled >= max_events:
                break
            time, _, _, _, event = heapq.heappop(heap)
            self.now = time
            try:
                handler = handlers[event.kind]
            except KeyError:
                raise RuntimeError(f"no handler for {event.kind.name}") from None
            out = handler(event)
            if out:
                for ev in out:
                    self.push(ev)
            handled += 1
        self.num_events += handled
        return handled
