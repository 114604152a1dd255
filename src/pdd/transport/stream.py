"""Frames over an asyncio (reader, writer) pair: the one place bytes meet frames.

Reads are bounded (READ_BYTES at a time) and happen only when the caller asks
for the next frame, so a slow consumer leaves data in the kernel and asyncio's
flow control pauses the socket: that is the receiver's backpressure.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import time
from collections import deque

from pdd.transport.frames import DEFAULT_MAX_FRAME_BYTES, Frame, FrameDecoder, Wait, encode_wait

READ_BYTES = 256 * 1024
# Either side of a transfer: silent this long (no byte, not even a WAIT), the
# peer is dead or the line cut; a side with nothing to send writes a WAIT this
# often, well inside the other's stall timeout (a queued side is not a dead one).
DEFAULT_STALL_TIMEOUT_S = 30.0
DEFAULT_KEEPALIVE_S = 5.0
STREAM_LIMIT_BYTES = 1024 * 1024  # StreamReader pauses the socket above 2x this


class FrameStream:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES):
        self.reader = reader
        self.writer = writer
        self.decoder = FrameDecoder(max_frame_bytes)
        self.max_frame_bytes = max_frame_bytes
        self._pending: deque[Frame] = deque()
        self.num_bytes_written = 0
        self.num_bytes_read = 0
        self.last_write_s = self.last_read_s = time.monotonic()
        sock = writer.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    @property
    def peer(self) -> str:
        peer = self.writer.get_extra_info("peername")
        return f"{peer[0]}:{peer[1]}" if peer else "?"

    async def read_frame(self, timeout_s: float | None, *, idle: bool = False) -> Frame:
        """Next frame. Raises TimeoutError (after `timeout_s`; with `idle`,
        once no byte came for `timeout_s`: a big frame on a slow line is
        progress), ConnectionError (peer closed or reset), FrameError
        (corrupt stream)."""
        async with asyncio.timeout(None if idle else timeout_s):
            while not self._pending:
                async with asyncio.timeout(timeout_s if idle else None):
                    data = await self.reader.read(READ_BYTES)
                if not data:
                    raise ConnectionError("peer closed the connection")
                self.num_bytes_read += len(data)
                self.last_read_s = time.monotonic()
                self._pending.extend(self.decoder.feed(data))
        return self._pending.popleft()

    async def read_answer(self, silent_s: float | None) -> Frame:
        """The peer's next frame other than WAIT; TimeoutError once it has
        sent nothing, not even a WAIT, for `silent_s`."""
        while True:
            frame = await self.read_frame(silent_s, idle=True)
            if not isinstance(frame, Wait):
                return frame

    def keepalive(self, every_s: float, reason: str) -> asyncio.Task:
        """A task that writes a WAIT whenever nothing was written for
        `every_s`, until cancelled: a side that is busy or queued but alive
        says so, and the peer's stall timeout catches only a silent one.
        Every frame goes out in one `write`, so a WAIT never lands inside
        one; cancel the task before the frame that must come next (END, the
        next BEGIN)."""
        async def tick() -> None:
            while True:
                idle = time.monotonic() - self.last_write_s
                if idle >= every_s:
                    self.write(encode_wait(reason))
                    idle = 0.0
                await asyncio.sleep(every_s - idle)

        return asyncio.ensure_future(tick())

    def write(self, data: bytes) -> int:
        self.writer.write(data)
        self.num_bytes_written += len(data)
        self.last_write_s = time.monotonic()
        return len(data)

    async def drain(self) -> None:
        await self.writer.drain()

    def is_usable(self) -> bool:
        """False once the peer closed, reset, or we closed: not to be reused."""
        return not (self.writer.is_closing() or self.reader.at_eof() or self.reader.exception() is not None)

    def abort(self) -> None:
        """Drop the connection now with a RST: unsent data (ours and the kernel's)
        is discarded, so a transfer given up on cannot land later."""
        transport = self.writer.transport
        if transport.is_closing():
            return
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            except OSError:
                pass
        transport.abort()

    async def close(self, timeout_s: float = 1.0) -> None:
        """Flush what is queued (e.g. a final ERROR/CANCEL), but never wait long."""
        if self.writer.is_closing():
            return
        self.writer.close()
        try:
            await asyncio.wait_for(self.writer.wait_closed(), timeout_s)
        except (asyncio.TimeoutError, OSError, ConnectionError):
            self.abort()
