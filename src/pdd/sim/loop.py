"""The discrete-event loop: a heap of events, handlers that return new ones.

An event is a typed record at a time (`pdd.sim.events`): the record's class
says what happens and picks the handler; its fields name what it concerns
by id. Ties are broken on (time, kind, key, seq): events at the same instant
run in the order of their kind (completions before new work, so a freed slot
is seen by an arrival at that instant), then by the record's stable string
key (instance, link or request id), then in order of creation. No wall
clock, no randomness: the same inputs replay the same run event for event,
and an optional `log` writes each event as it runs (`events.EventLog`).

Handlers are registered per record type and may return None or an iterable
of events. An object that wants to cancel a scheduled event bumps its own
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
    """`record` happens at `time`; the record has `KIND` and `key`."""

    __slots__ = ("time", "record")

    def __init__(self, time: float, record: Any) -> None:
        if math.isnan(time):
            raise ValueError(f"event {record!r} at NaN time")
        self.time = time
        self.record = record

    @property
    def kind(self) -> EventKind:
        return self.record.KIND

    @property
    def key(self) -> str:
        return self.record.key

    def __repr__(self) -> str:
        return f"Event({self.time:.6f}, {self.record!r})"


Handler = Callable[[Event], Iterable[Event] | None]


class EventLoop:
    def __init__(self, log=None) -> None:
        self._heap: list[tuple[float, int, str, int, Event]] = []
        self._seq = 0
        self._handlers: dict[type, Handler] = {}
        self.now = 0.0
        self.num_events = 0
        self.log = log          # has .write(time, record), or None

    def on(self, record_type: type, handler: Handler) -> None:
        if record_type in self._handlers:
            raise ValueError(f"handler for {record_type.__name__} already registered")
        self._handlers[record_type] = handler

    def push(self, event: Event) -> None:
        if event.time < self.now:
            raise ValueError(f"{event!r} is in the past (now={self.now:.6f})")
        rec = event.record
        heapq.heappush(self._heap, (event.time, int(rec.KIND), rec.key, self._seq, event))
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
        log = self.log
        while heap and heap[0][0] <= until_s:
            if max_events is not None and handled >= max_events:
                break
            time, _, _, _, event = heapq.heappop(heap)
            self.now = time
            try:
                handler = handlers[type(event.record)]
            except KeyError:
                raise RuntimeError(f"no handler for {type(event.record).__name__}") from None
            if log is not None:
                log.write(time, event.record)
            out = handler(event)
            if out:
                for ev in out:
                    self.push(ev)
            handled += 1
        self.num_events += handled
        return handled
