"""One direction of one relayed connection: shaped, ordered, with backpressure.

    src.data_received -> push: shaper.schedule(now, n) -> queue (delivery time, chunk)
    timer at the head's delivery time -> flush: write what is due to dst
    (in order: a chunk never overtakes the one before it on this pipe)
    src EOF -> forwarded once everything before it is delivered
The pipe stops reading its source while it holds more than about one
bandwidth-delay product (plus a small router buffer), or while dst's socket
is full, so a sender feels a slow line instead of an infinite buffer. While
the link is blackholed, bytes (queued ones too) are held in order and handed
to the line again on restore.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdd.wan.relay import WanLink, _Side

MIN_QUEUE_BYTES = 1024 * 1024
QUEUE_BUFFER_S = 0.05  # router buffer beyond the bandwidth-delay product
UNLIMITED_QUEUE_BYTES = 8 * 1024 * 1024


def queue_limit_bytes(rate_bytes_s: float | None, latency_s: float, jitter_s: float) -> int:
    """What one direction of a relayed connection holds before it stops
    reading its source: about one bandwidth-delay product plus a small router
    buffer (it reads again below half of it). The simulator's model of the
    emulated line takes the bytes a copy has handed to the line from here."""
    if rate_bytes_s is None:
        return UNLIMITED_QUEUE_BYTES
    return max(MIN_QUEUE_BYTES, int(rate_bytes_s * (latency_s + jitter_s + QUEUE_BUFFER_S)))


def reset_transport(transport: asyncio.BaseTransport | None) -> None:
    """Close with RST (SO_LINGER 0), like a line that dies, not a polite FIN."""
    if transport is None or transport.is_closing():
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    transport.abort()


class Pipe:
    def __init__(self, link: "WanLink", src: "_Side", dst: "_Side", a_to_b: bool, priority: bool = False):
        self.link, self.src, self.dst, self.a_to_b = link, src, dst, a_to_b
        self.priority = priority        # the line's priority class (`Shaper.schedule`)
        self.shaper = link.shaper_a_to_b if a_to_b else link.shaper_b_to_a
        self.queue: deque[tuple[float, bytes]] = deque()
        self.held: list[bytes] = []  # blackhole: not yet on the line
        self.queued_bytes = 0
        self.timer: asyncio.TimerHandle | None = None
        self.dst_full = False
        self.eof_pending = False
        self.eof_sent = False
        src.pipe_out = self

    def push(self, data: bytes) -> None:
        self.queued_bytes += len(data)
        if self.link.blackholed:
            self.held.append(data)
        else:
            self.queue.append((self.shaper.schedule(self.link.loop.time(), len(data), self.priority), data))
            if self.timer is None:
                self.flush()
        self.update_reading()

    def release_held(self) -> None:
        held, self.held = self.held, []
        self.queued_bytes -= sum(map(len, held))
        for data in held:
            self.push(data)
        if self.eof_pending and self.timer is None:
            self.flush()

    def flush(self) -> None:
        self.timer = None
        if self.link.blackholed:  # bytes still "on the wire" are held too, in order
            self.held[:0] = [data for _, data in self.queue]
            self.queue.clear()
            return
        loop = self.link.loop
        now = loop.time()
        while self.queue and self.queue[0][0] <= now:
            _, data = self.queue.popleft()
            self.queued_bytes -= len(data)
            if self.dst.transport is not None and not self.dst.transport.is_closing():
                self.dst.transport.write(data)
                self.link._count(self.a_to_b, len(data))
        if self.queue:
            self.timer = loop.call_at(self.queue[0][0], self.flush)
        elif self.eof_pending and not self.held and not self.eof_sent:
            self.eof_sent = True
            dst = self.dst.transport
            if dst is not None and not dst.is_closing() and dst.can_write_eof():
                try:
                    dst.write_eof()
                except OSError:  # the far side is already gone
                    self.src.conn.close(reset=True)
                    return
            self.src.conn.maybe_close()
        self.update_reading()

    def on_eof(self) -> None:
        self.eof_pending = True
        if self.timer is None:
            self.flush()

    def update_reading(self) -> None:
        transport = self.src.transport
        if transport is None or transport.is_closing():
            return
        limit = self.queue_limit_bytes()
        if self.dst_full or self.dst.transport is None or self.queued_bytes > limit:
            transport.pause_reading()
        elif self.queued_bytes <= limit // 2:
            transport.resume_reading()

    def queue_limit_bytes(self) -> int:
        sh = self.shaper
        return queue_limit_bytes(sh.rate_bytes_s, sh.latency_s, sh.jitter_s)

    def drop(self) -> int:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        dropped, self.queued_bytes = self.queued_bytes, 0
        self.queue.clear()
        self.held.clear()
        return dropped
