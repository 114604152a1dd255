"""Connections from a KV sender to its receivers.

One transfer at a time per connection, connections pooled per
peer and reused. Why: over the WAN a fresh connection costs a TCP handshake
plus the auth round trip (2 RTT, ~80 ms at 20 ms one-way), which would
dominate the small transfers of high-hit requests (the common case). Why not
multiplex many transfers over one connection: head-of-line blocking would put
a small transfer behind a 190 MB one, and a corrupt frame or a cancel would
take every transfer on the line down with it. Concurrent transfers to one peer
simply use several pooled connections. A connection is pooled again only
after a clean END ack; after any failure it is aborted, since its stream is
no longer trustworthy. Pooled connections idle longer than `idle_keep_s`
(below the receiver's idle timeout) or closed by the peer are dropped.
At most `max_handshakes_per_peer` new connections per peer authenticate at
once (the rest wait their turn), so a burst of cold transfers stays below the
receiver's cap on unauthenticated connections, which closes excess ones.
A connection the receiver closes or resets before any transfer began on it
is tried again (`take`).
"""

from __future__ import annotations

import asyncio
import ssl
import time

from pdd.transport.auth import AuthError, client_handshake
from pdd.transport.stream import STREAM_LIMIT_BYTES, FrameStream

MAX_HANDSHAKES_PER_PEER = 8   # below the receiver's DEFAULT_MAX_UNAUTHENTICATED (32)
BOOTSTRAP_TRIES = 3


class ConnectFailed(Exception):
    """Refused, unreachable, timed out, or TLS refused: no transfer began."""


class ConnectionPool:
    def __init__(self, secret: bytes, *, tls, reuse: bool, connect_timeout_s: float, auth_timeout_s: float,
                 idle_keep_s: float, max_idle_per_peer: int, max_frame_bytes: int, max_handshakes_per_peer: int):
        self.secret = secret
        self.tls = tls
        self.reuse = reuse
        self.connect_timeout_s = connect_timeout_s
        self.auth_timeout_s = auth_timeout_s
        self.idle_keep_s = idle_keep_s
        self.max_idle_per_peer = max_idle_per_peer
        self.max_frame_bytes = max_frame_bytes
        self.max_handshakes_per_peer = max_handshakes_per_peer
        self.num_opened = 0
        self.num_reused = 0
        self.num_retries = 0
        self._idle: dict[tuple[str, int], list[tuple[FrameStream, float]]] = {}
        self._handshakes: dict[tuple[str, int], asyncio.Semaphore] = {}

    async def _acquire(self, host: str, port: int) -> FrameStream:
        conns = self._idle.get((host, port), [])
        now = time.monotonic()
        while conns:
            stream, last_used_s = conns.pop()
            if stream.is_usable() and now - last_used_s < self.idle_keep_s:
                self.num_reused += 1
                return stream
            stream.abort()
        turn = self._handshakes.get((host, port))
        if turn is None:
            turn = self._handshakes[(host, port)] = asyncio.Semaphore(self.max_handshakes_per_peer)
        async with turn:
            return await self._connect(host, port)

    async def take(self, host: str, port: int) -> FrameStream:
        """A pooled connection or a new one (`_acquire`), again (up to BOOTSTRAP_TRIES in all, backing off) when
        the receiver closes or resets the connection before BEGIN: under load
        our loop can be slow enough for its auth timeout, and nothing of the
        transfer has reached it yet. A refused connection, a refused key and
        our own handshake timeout (a receiver silent to us: a dead one, or a
        cut line) fail at once."""
        for attempt in range(BOOTSTRAP_TRIES):
            try:
                return await self._acquire(host, port)
            except (ConnectionError, OSError):
                if attempt == BOOTSTRAP_TRIES - 1:
                    raise
                self.num_retries += 1
                await asyncio.sleep(0.1 * 4 ** attempt)
        raise AssertionError("unreachable")

    async def _connect(self, host: str, port: int) -> FrameStream:
        peer = self.tls(host, port) if self.tls is not None else None
        tls_kw = {} if peer is None else {"ssl": peer.context, "server_hostname": peer.name,
                                          "ssl_handshake_timeout": self.connect_timeout_s}
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(host, port, limit=STREAM_LIMIT_BYTES, **tls_kw), self.connect_timeout_s)
        except asyncio.TimeoutError:
            raise ConnectFailed(f"cannot connect to {host}:{port}: timed out after {self.connect_timeout_s} s") from None
        except ssl.SSLError as e:  # the receiver's certificate: another CA, another name, expired
            raise ConnectFailed(f"TLS with {host}:{port} (as {peer.name}) refused: "
                                  f"{getattr(e, 'verify_message', None) or e.reason or e}") from None
        except OSError as e:  # refused, unreachable, unknown host
            reason = "connection refused" if isinstance(e, ConnectionRefusedError) else f"{type(e).__name__}: {e}"
            raise ConnectFailed(f"cannot connect to {host}:{port}: {reason}") from None
        self.num_opened += 1
        stream = FrameStream(reader, writer, self.max_frame_bytes)
        try:
            await client_handshake(stream, self.secret, self.auth_timeout_s)
        except (asyncio.TimeoutError, TimeoutError):
            stream.abort()
            raise AuthError(f"no CHALLENGE from {host}:{port} within {self.auth_timeout_s} s") from None
        except ssl.SSLError as e:  # TLS 1.3: the receiver judges our certificate after the handshake
            stream.abort()
            raise ConnectFailed(f"TLS with {host}:{port} refused by the receiver: {e.reason or e}") from None
        except BaseException:
            stream.abort()
            raise
        return stream

    def give_back(self, host: str, port: int, stream: FrameStream) -> None:
        """After a clean END ack: pooled for the next transfer (or closed)."""
        conns = self._idle.setdefault((host, port), [])
        if self.reuse and stream.is_usable() and len(conns) < self.max_idle_per_peer:
            conns.append((stream, time.monotonic()))
        else:
            stream.writer.close()  # graceful: nothing is left to flush after the END ack

    def close(self) -> None:
        """Drop every pooled connection."""
        for conns in self._idle.values():
            for stream, _ in conns:
                stream.abort()
        self._idle.clear()
