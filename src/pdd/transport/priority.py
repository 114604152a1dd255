"""Foreground before background on a shared line, decided by the sender.

A line (a link label: "wan", "local") carries transfers a user is waiting on
(foreground: a direct request's KV to MD) and copies nobody waits on yet
(background: the copy that readies MD for a handoff while RLD serves the
user, a warm push). Left to TCP, flows share a line about evenly, so a warm
turn's 1.5 MB copy behind a cold turn's 100 MB one takes twice as long, and
with three cold copies in flight four times, on every warm turn's TTFT.

Routers in the path do not know our priorities, so the sender enforces them:
a background transfer writes its frames in slices and, before each slice,
waits while any foreground transfer is in progress on the same line. What
still lies ahead of a foreground transfer is what the background one had
already handed to the network: one slice, what the sockets' kernel
buffers hold, and what the line itself holds in flight. On loopback the
kernel buffers autotune to megabytes and take a copy's bytes before any
pause can act, so here the gate mostly orders what they have not taken;
what they hold crosses beside the foreground transfer, the line's buffer
(the WAN relay's, one per direction, as a router's) shared about evenly
among the connections that have bytes for it (`pdd.wan.pipe`). A real
line's sender would set TCP_NOTSENT_LOWAT.

What the sender can do is not hand them those bytes: `KVSender` paces the
background slices of a line (`paces`, from `pdd.deploy.topology.copy_pace`:
0.95 of the line's rate by default) so that the line drains faster than it
is fed and the buffers ahead of it stay empty. Measured through the relay
(`tests/test_transport_priority.py`, 4 MB/s, 10 ms one way): a one-block
transfer behind an unpaced 6 MB copy took 0.36 s, its BEGIN -> HAVE 0.08 s
(behind the line's buffer, 0.26 MB); behind the same copy paced at 0.9 of
the line, 0.09 s and 0.02 s, for 10% off the copy's rate.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Callable

from pdd.policy.line_order import yield_key

SLICE_BYTES = 64 * 1024          # a background transfer checks its turn this often


class LineGate:
    """Who may write to a line now: foreground transfers always; background
    ones only while no foreground transfer is in progress, one slice at a
    time, in `pdd.policy.line_order`'s order: the one with the fewest blocks
    left first, unless one has waited `max_yield_s` since it started (then
    the oldest of those).

    Shortest-remaining-first among the background copies: shared evenly,
    four 90 MB copies would all land after four copies' time; one after the
    other, the first lands after one copy's time, the second after two, and
    each lets MD take over its request that much sooner (less of the answer
    left on RLD). A finite `max_yield_s` keeps a big copy from starving
    behind a stream of smaller ones (off by default: `copy_max_yield_s`). A
    copy waiting for P to compute its next block does not ask, so the others
    use the line meanwhile."""

    def __init__(self, max_yield_s: float = math.inf) -> None:
        self.max_yield_s = max_yield_s
        self._foreground: dict[str, int] = {}
        self._asking: dict[str, dict[int, tuple[int, float]]] = {}   # line -> key -> (blocks left, started)
        self._holder: dict[str, int] = {}                            # line -> key writing a slice
        self._woken: dict[int, asyncio.Future] = {}                  # key -> what it awaits, while it waits

    def _first(self, line: str) -> int:
        """The asking copy whose turn it is."""
        asking, now = self._asking[line], time.monotonic()
        return min(asking, key=lambda k: yield_key(*asking[k], now, self.max_yield_s))

    def _next(self, line: str) -> None:
        """Wake the one copy whose turn it is on `line`, if the line is free
        (waking every waiter on each slice costs P's core O(copies) task
        switches per 64 KB: 40 us a slice with 40 copies queued)."""
        if self.busy(line) or line in self._holder or not self._asking.get(line):
            return
        fut = self._woken.get(self._first(line))
        if fut is not None and not fut.done():
            fut.set_result(None)

    def busy(self, line: str) -> bool:
        return self._foreground.get(line, 0) > 0

    def enter(self, line: str) -> None:
        """A foreground transfer starts on `line`."""
        self._foreground[line] = self._foreground.get(line, 0) + 1

    def leave(self, line: str) -> None:
        """A foreground transfer has handed its last byte to the line (or ended)."""
        n = self._foreground.get(line, 0) - 1
        if n > 0:
            self._foreground[line] = n
            return
        self._foreground.pop(line, None)
        self._next(line)

    def _may_write(self, line: str, key: int) -> bool:
        if self.busy(line) or line in self._holder:
            return False
        return self._first(line) == key

    async def turn(self, line: str, key: int, blocks_left: int, started_s: float | None = None,
                   urgent: Callable[[], bool] | None = None) -> float:
        """Wait for a background transfer's turn to write one slice; the seconds
        waited. `started_s`: when the transfer started (monotonic; None: now).
        `urgent`: asked again whenever the copy is woken (`wake_all`); once true,
        the copy stops waiting and writes as a foreground one would (a transfer
        a user waits on needs its blocks: priority inheritance). Call `release`
        after the slice."""
        asking = self._asking.setdefault(line, {})
        t0 = time.monotonic()
        asking[key] = (blocks_left, t0 if started_s is None else started_s)
        waited = False
        granted = False
        try:
            while not self._may_write(line, key):
                if urgent is not None and urgent():
                    return time.monotonic() - t0 if waited else 0.0     # no turn taken: release is a no-op
                waited = True
                fut = self._woken[key] = asyncio.get_running_loop().create_future()
                await fut
            granted = True
        finally:
            asking.pop(key, None)
            self._woken.pop(key, None)
            if not granted:      # cancelled while asking: the next in line may go
                self._next(line)
        self._holder[line] = key
        return time.monotonic() - t0 if waited else 0.0

    def wake_all(self) -> None:
        """Wake every waiting copy to ask its `urgent` again (a transfer has
        started waiting for blocks a copy may carry); those still not urgent
        wait again, and the one whose turn it is goes."""
        for fut in list(self._woken.values()):
            if not fut.done():
                fut.set_result(None)

    def release(self, line: str, key: int) -> None:
        if self._holder.get(line) == key:
            del self._holder[line]
            self._next(line)
