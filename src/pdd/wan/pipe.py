"""One direction of one relayed connection: shaped, ordered, with backpressure.

    src.data_received -> push: shaper.schedule(now, n) -> queue (delivery time, chunk)
    timer at the head's delivery time -> flush: write what is due to dst
    (in order: a chunk never overtakes the one before it on this pipe)
    src EOF -> forwarded once everything before it is delivered
The line's buffer is one per direction, shared by every connection on it,
as a router's is: a bulk pipe stops reading its source while the line holds
more than about one bandwidth-delay product plus a small router buffer (all
of its bulk pipes together, `LineQueue`), or while dst's socket is full, so a
sender feels a slow line instead of an infinite buffer, and a new connection
waits behind at most that buffer, whatever the number of connections (with
a buffer per connection, fifty busy connections stacked fifty buffers ahead
of a new one's handshake). When the line drains to half its buffer, the
pipes it stopped read again in turn, the quietest first, as many as the
room takes one bounded read each (`LineQueue.drained`): the connections
share the line about evenly, as TCP flows on one bottleneck do, and a new
one's handshake does not wait for the busy ones' turns.
Control pipes (the priority class) keep a buffer of their own. While the link
is blackholed, bytes (queued ones too) are held in order and handed to the
line again on restore.
"""

from __future__ import annotations

import asyncio
import math
import socket
import struct
from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdd.wan.relay import WanLink, _Side

MIN_QUEUE_BYTES = 256 * 1024  # a few of the loop's reads: the line never idles for want of bytes
QUEUE_BUFFER_S = 0.05  # router buffer beyond the bandwidth-delay product
UNLIMITED_QUEUE_BYTES = 8 * 1024 * 1024
# One read from a source: an eighth of the line's buffer, within these bounds,
# so the connections the line lets read again overshoot it by little.
MIN_READ_BYTES, MAX_READ_BYTES = 16 * 1024, 256 * 1024
RECENT_S = 1.0   # how long a connection's bytes count against its turn on a full line


def queue_limit_bytes(rate_bytes_s: float | None, latency_s: float, jitter_s: float) -> int:
    """What one direction of the line holds (all its connections together)
    before its pipes stop reading their sources: about one bandwidth-delay
    product plus a small router buffer (they read again below half of it).
    The simulator's model of the emulated line takes the bytes ahead of a new
    transfer from here."""
    if rate_bytes_s is None:
        return UNLIMITED_QUEUE_BYTES
    return max(MIN_QUEUE_BYTES, int(rate_bytes_s * (latency_s + jitter_s + QUEUE_BUFFER_S)))


def line_limit_bytes(shaper) -> int:
    """`queue_limit_bytes` of a shaper's line as it is configured now."""
    return queue_limit_bytes(shaper.rate_bytes_s, shaper.latency_s, shaper.jitter_s)


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


class LineQueue:
    """The buffer of one direction of the line: its bulk pipes, what they
    hold together, and which of them it has stopped reading."""

    def __init__(self, shaper) -> None:
        self.shaper = shaper
        self.pipes: set[Pipe] = set()
        self.stopped: dict[Pipe, None] = {}     # paused because the line was full (ordered: ties)

    def queued_bytes(self) -> int:
        return sum(p.queued_bytes for p in self.pipes)

    def limit_bytes(self) -> int:
        return line_limit_bytes(self.shaper)

    def stop(self, pipe: "Pipe") -> None:
        self.stopped.setdefault(pipe, None)

    def forget(self, pipe: "Pipe") -> None:
        self.pipes.discard(pipe)
        self.stopped.pop(pipe, None)

    def drained(self) -> None:
        """Bytes left the buffer: below half of it, stopped pipes read again,
        as many as the room left takes one read each (all of them at once
        would each add a read before any could be stopped), those that sent
        least of late first (`recent_bytes`): a new connection's handshake or
        a pooled one's small message before the busy ones, as a fair-queueing
        router (Linux's default, fq_codel) serves a sparse flow, and the busy
        ones so that each gets about an even share."""
        if not self.stopped:
            return
        limit = self.limit_bytes()
        held = self.queued_bytes()
        if held > limit // 2:
            return
        room = limit - held
        now = asyncio.get_running_loop().time()
        for pipe in sorted(self.stopped, key=lambda p: p.recent_bytes(now)):
            if room <= 0:
                break
            del self.stopped[pipe]
            room -= pipe.read_bytes()
            pipe.update_reading()


class Pipe:
    def __init__(self, link: "WanLink", src: "_Side", dst: "_Side", a_to_b: bool, priority: bool = False):
        self.link, self.src, self.dst, self.a_to_b = link, src, dst, a_to_b
        self.priority = priority        # the line's priority class (`Shaper.schedule`)
        self.shaper = link.shaper_a_to_b if a_to_b else link.shaper_b_to_a
        self._recent, self._recent_s = 0.0, 0.0   # bytes taken from its source, fading (`recent_bytes`)
        self.line: LineQueue | None = None if priority else link.line_queue(a_to_b)
        if self.line is not None:
            self.line.pipes.add(self)
        self.queue: deque[tuple[float, bytes]] = deque()
        self.held: list[bytes] = []  # blackhole: not yet on the line
        self.queued_bytes = 0
        self.timer: asyncio.TimerHandle | None = None
        self.dst_full = False
        self.eof_pending = False
        self.eof_sent = False
        src.pipe_out = self

    def push(self, data: bytes) -> None:
        """Bytes read from the source."""
        now = self.link.loop.time()
        self._recent = self.recent_bytes(now) + len(data)
        self._recent_s = now
        self._enqueue(data, now)

    def _enqueue(self, data: bytes, now: float) -> None:
        self.queued_bytes += len(data)
        if self.link.blackholed:
            self.held.append(data)
        else:
            self.queue.append((self.shaper.schedule(now, len(data), self.priority), data))
            if self.timer is None:
                self.flush()
        self.update_reading()

    def release_held(self) -> None:
        """The line is back: held bytes go to it in order (read once: not
        counted again in `recent_bytes`)."""
        held, self.held = self.held, []
        self.queued_bytes -= sum(map(len, held))
        now = self.link.loop.time()
        for data in held:
            self._enqueue(data, now)
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
        if self.line is not None:
            self.line.drained()
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
        # a bulk pipe's measure is the line's buffer; a control pipe's its own
        held = self.queued_bytes if self.line is None else self.line.queued_bytes()
        if self.dst_full or self.dst.transport is None or held > limit:
            transport.pause_reading()
            if self.line is not None and held > limit:
                self.line.stop(self)
        elif self.line is None and held <= limit // 2:
            transport.resume_reading()
        elif self.line is not None and self not in self.line.stopped:
            # the line has room and has not stopped this pipe (a new
            # connection, one its own socket held, one `drained` let go): it
            # reads, as a router takes a packet while its buffer has room;
            # one the line stopped waits for its turn (`LineQueue.drained`)
            transport.resume_reading()

    def recent_bytes(self, now: float) -> float:
        """What it took from its source lately: each byte counts less by e
        every RECENT_S seconds."""
        return self._recent * math.exp(-(now - self._recent_s) / RECENT_S) if self._recent else 0.0

    def read_bytes(self) -> int:
        """How much one read from the source may take."""
        if self.line is None:
            return MAX_READ_BYTES
        return max(MIN_READ_BYTES, min(MAX_READ_BYTES, self.queue_limit_bytes() // 8))

    def queue_limit_bytes(self) -> int:
        return line_limit_bytes(self.shaper)

    def drop(self) -> int:
        """The connection is gone: its bytes leave the line's buffer unsent."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        dropped, self.queued_bytes = self.queued_bytes, 0
        self.queue.clear()
        self.held.clear()
        if self.line is not None:
            self.line.forget(self)
            self.line.drained()
        return dropped
