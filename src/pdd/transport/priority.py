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
already handed to the network: one slice, the socket's unsent bytes (kept
small with TCP_NOTSENT_LOWAT on lines other than the local one) and what
the line itself holds in flight.
"""

from __future__ import annotations

import asyncio
import socket
import time

SLICE_BYTES = 64 * 1024          # a background transfer checks its turn this often
NOTSENT_LOWAT_BYTES = 64 * 1024  # unsent bytes a socket may hold (TCP_NOTSENT_LOWAT)


class LineGate:
    """Counts foreground transfers per line; background ones wait for none."""

    def __init__(self) -> None:
        self._foreground: dict[str, int] = {}
        self._clear: dict[str, asyncio.Event] = {}

    def _event(self, line: str) -> asyncio.Event:
        ev = self._clear.get(line)
        if ev is None:
            ev = self._clear[line] = asyncio.Event()
            ev.set()
        return ev

    def busy(self, line: str) -> bool:
        return self._foreground.get(line, 0) > 0

    def enter(self, line: str) -> None:
        """A foreground transfer starts on `line`."""
        self._foreground[line] = self._foreground.get(line, 0) + 1
        self._event(line).clear()

    def leave(self, line: str) -> None:
        """A foreground transfer has handed its last byte to the line (or ended)."""
        n = self._foreground.get(line, 0) - 1
        if n > 0:
            self._foreground[line] = n
            return
        self._foreground.pop(line, None)
        self._event(line).set()

    async def turn(self, line: str) -> float:
        """Wait until no foreground transfer is in progress on `line`; the seconds waited."""
        ev = self._event(line)
        if ev.is_set():
            return 0.0
        t0 = time.monotonic()
        await ev.wait()
        return time.monotonic() - t0


def limit_unsent(writer: asyncio.StreamWriter, nbytes: int = NOTSENT_LOWAT_BYTES) -> None:
    """Keep at most ~nbytes unsent in the kernel for this connection, so that a
    pause of the writer reaches the line quickly (the bytes in flight are left
    to TCP: throughput is unchanged)."""
    sock = writer.get_extra_info("socket")
    opt = getattr(socket, "TCP_NOTSENT_LOWAT", None)
    if sock is None or opt is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    try:
        sock.setsockopt(socket.IPPROTO_TCP, opt, nbytes)
    except OSError:
        pass
