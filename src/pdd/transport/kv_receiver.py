"""KVReceiver: the asyncio TCP server side of the KV transport.

One connection carries one transfer at a time (senders may reuse it for the
next). Per connection:
    accept -> auth handshake (drop + count on failure or timeout); at most
              `max_unauthenticated` connections may be mid-handshake, any
              more are closed at once (counted), and until the handshake
              completes frames are limited to PREAUTH_MAX_FRAME_BYTES: a
              stranger costs us a few KB and a task, never a declared frame
    loop: BEGIN -> handler.on_begin -> HAVE -> BLOCK* (handler.on_block each)
          -> END -> handler.on_end(SUCCESS) -> END ack
          (a block may come as PART slices instead, in order: it is assembled
          here and reaches on_block whole, once its last slice is in; or,
          from a sender on this host, a SEGMENT naming a shared-memory file
          and a REF per block in it (`transport.shm`): on_block then gets a
          `kv_codec.LocalBlock`, a view of the mapped file)
Every begun transfer ends with exactly one handler.on_end(status), also on a
corrupt frame, CANCEL, stall, deadline (BEGIN's deadline + grace), dead peer,
handler error or receiver shutdown; after a failure the connection is closed
(its byte stream can no longer be trusted) and other connections go on.

Backpressure: frames are read only after the handler returned for the
previous one (handlers may be sync or async), so a slow handler leaves bytes
in the kernel and TCP flow control slows the sender.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import ssl
import time
from dataclasses import dataclass, asdict
from pathlib import Path
from typing import Any, Protocol

from pdd.engine.kv_codec import LocalBlock
from pdd.transport import shm
from pdd.transport.auth import DEFAULT_AUTH_TIMEOUT_S, AuthError, as_secret, server_handshake
from pdd.transport.frames import (
    DEFAULT_MAX_FRAME_BYTES, Begin, Block, Cancel, End, Error, FrameError, Part, Ref, Segment, Wait, encode_end,
    encode_error, encode_have,
)
from pdd.transport.state import TransferState, TransferStatus
from pdd.transport.stream import DEFAULT_KEEPALIVE_S, DEFAULT_STALL_TIMEOUT_S, STREAM_LIMIT_BYTES, FrameStream
from pdd.transport.tls import peer_names

log = logging.getLogger(__name__)

DEFAULT_IDLE_TIMEOUT_S = 120.0  # an idle (between transfers) connection is closed silently
DEFAULT_DEADLINE_GRACE_S = 1.0  # on top of the sender's deadline carried in BEGIN
# Strangers mid-handshake per port. Senders open at most MAX_HANDSHAKES_PER_PEER
# (kv_sender.py) at once per receiver, so a few prefill instances fit beneath.
DEFAULT_MAX_UNAUTHENTICATED = 32


class ReceiverHandler(Protocol):
    def on_begin(self, request_id: str, meta: dict, block_hashes: list[bytes]) -> set[int]: ...
    def on_block(self, request_id: str, index: int, block_hash: bytes, payload: bytes) -> None: ...
    def on_end(self, request_id: str, status: TransferStatus) -> None: ...


@dataclass
class ReceiverStats:
    num_connections: int = 0
    num_auth_failures: int = 0
    num_refused_unauthenticated: int = 0   # closed at once: too many mid-handshake
    num_transfers: int = 0
    num_succeeded: int = 0
    num_failed: int = 0
    num_blocks_received: int = 0
    num_blocks_skipped: int = 0
    num_bytes_received: int = 0


class _TransferFailed(Exception):
    pass


async def _call(fn: Any, *args: Any) -> Any:
    result = fn(*args)
    if inspect.isawaitable(result):
        result = await result
    return result


LINGER_S = 1.0   # after refusing a transfer: how long to discard what the sender still had in flight


async def _let_sender_read_error(stream: FrameStream) -> None:
    """Closing a socket with unread bytes in it sends RST, and a reset can
    overtake our ERROR frame (in the peer's stack, or in a relay), so the
    sender would report "connection lost" instead of the reason (e.g. a block
    that failed its checksum). So: half-close after the ERROR, and read and
    discard until the sender, which reads while it sends, hangs up."""
    if stream.writer.can_write_eof():
        stream.writer.write_eof()
    try:
        async with asyncio.timeout(LINGER_S):
            while await stream.reader.read(1 << 16):
                pass
    except (TimeoutError, ConnectionError, OSError):
        pass


class KVReceiver:
    def __init__(self, secret: str | bytes, handler: ReceiverHandler, *,
                 auth_timeout_s: float = DEFAULT_AUTH_TIMEOUT_S, idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
                 stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S, deadline_grace_s: float = DEFAULT_DEADLINE_GRACE_S,
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
                 max_unauthenticated: int = DEFAULT_MAX_UNAUTHENTICATED, keepalive_s: float = DEFAULT_KEEPALIVE_S,
                 shm_dir: Path | None | bool = True):
        """shm_dir: where a same-host sender's segments may lie (True: the
        host's /dev/shm if any; None or False: segments are refused)."""
        self.secret = as_secret(secret)
        self.shm_dir = shm.default_dir() if shm_dir is True else (shm_dir or None)
        self.max_unauthenticated = max_unauthenticated
        self.num_unauthenticated = 0
        self.handler = handler
        self.auth_timeout_s = auth_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self.keepalive_s = keepalive_s
        self.deadline_grace_s = deadline_grace_s
        self.max_frame_bytes = max_frame_bytes
        self.stats = ReceiverStats()
        self.tls_peers: frozenset[str] | None = None
        self.port = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task] = set()

    @classmethod
    async def start(cls, host: str, port: int, secret: str | bytes, handler: ReceiverHandler, *,
                    tls: ssl.SSLContext | None = None, tls_peers: frozenset[str] | None = None,
                    **kwargs: Any) -> "KVReceiver":
        """tls: a server context that requires a client certificate (tls.server_context);
        tls_peers: the certificate names allowed to send (None: any the CA signed)."""
        self = cls(secret, handler, **kwargs)
        self.tls_peers = tls_peers if tls is not None else None
        tls_kw = {} if tls is None else {"ssl": tls, "ssl_handshake_timeout": self.auth_timeout_s}
        self._server = await asyncio.start_server(self._serve, host, port, limit=STREAM_LIMIT_BYTES, **tls_kw)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def stats_dict(self) -> dict:
        return asdict(self.stats)

    async def close(self) -> None:
        """Stop accepting, fail in-flight transfers (their on_end is called), drop connections."""
        if self._server is not None:
            self._server.close()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.num_unauthenticated >= self.max_unauthenticated:
            self.stats.num_refused_unauthenticated += 1
            writer.transport.abort()
            return
        task = asyncio.current_task()
        self._tasks.add(task)
        stream = FrameStream(reader, writer, self.max_frame_bytes)
        self.stats.num_connections += 1
        try:
            if self.tls_peers is not None and not peer_names(writer) & self.tls_peers:
                # The CA vouched for the certificate, but it names no instance allowed to send KV here.
                self.stats.num_auth_failures += 1
                names = sorted(peer_names(writer)) or "no name"
                log.warning("kv receiver: dropped %s: certificate for %s may not send KV", stream.peer, names)
                # Said, not only done: a sender tries again after a silent close (the
                # receiver's auth timeout under load), but not after a refusal.
                stream.write(encode_error(f"certificate for {names} may not send KV here"))
                return
            self.num_unauthenticated += 1
            try:
                await server_handshake(stream, self.secret, self.auth_timeout_s)
            except (AuthError, TimeoutError, ConnectionError, FrameError, OSError) as e:
                self.stats.num_auth_failures += 1
                log.warning("kv receiver: dropped %s: %s", stream.peer, e or type(e).__name__)
                if isinstance(e, AuthError):
                    stream.write(encode_error(f"authentication failed: {e}"))
                return
            finally:
                self.num_unauthenticated -= 1
            while True:
                try:
                    frame = await stream.read_frame(self.idle_timeout_s)
                except (TimeoutError, ConnectionError, OSError):
                    return  # idle or closed between transfers: nothing to report
                if not isinstance(frame, Begin):
                    stream.write(encode_error(f"expected BEGIN, got {type(frame).__name__}"))
                    return
                if not await self._transfer(stream, frame):
                    return
        except FrameError as e:
            log.warning("kv receiver: corrupt stream from %s: %s", stream.peer, e)
        except asyncio.CancelledError:
            pass  # close(): end quietly (asyncio logs a cancelled connection task as an error)
        finally:
            self._tasks.discard(task)
            await stream.close(timeout_s=0.5)

    async def _transfer(self, stream: FrameStream, begin: Begin) -> bool:
        """Runs one transfer; True if the connection can carry another."""
        n = len(begin.block_hashes)
        status = TransferStatus(begin.request_id, TransferState.WAITING, num_blocks=n,
                                bytes_received=begin.wire_bytes, started_s=time.monotonic(), meta=begin.meta)
        self.stats.num_transfers += 1
        deadline = None
        if begin.deadline_s > 0:
            deadline = time.monotonic() + begin.deadline_s + self.deadline_grace_s
        # While the transfer runs, the sender hears from us at least every
        # keepalive_s: HAVE held back, blocks imported slowly (backpressure)
        # or the END ack after the import are a busy receiver, not a dead one.
        ticker = stream.keepalive(self.keepalive_s, "busy")
        segment: shm.InSegment | None = None
        try:
            try:
                async with asyncio.timeout_at(self._loop_deadline(deadline)):
                    held = await _call(self.handler.on_begin, begin.request_id, begin.meta, begin.block_hashes)
            except TimeoutError:
                raise TimeoutError("transfer deadline passed while the receiver's on_begin was busy") from None
            except Exception as e:
                raise _TransferFailed(f"receiver rejected transfer: {e!r}") from e
            held = {i for i in (held or ()) if 0 <= i < n}
            missing = set(range(n)) - held
            status.num_blocks_skipped = len(held)
            status.state = TransferState.TRANSFERRING
            stream.write(encode_have(n, held))
            partial: dict[int, list] = {}      # block index -> [bytearray, total, digest]
            while True:
                frame = await self._next_frame(stream, status, deadline)
                status.bytes_received += frame.wire_bytes
                if isinstance(frame, Part):
                    frame = self._assemble(begin, missing, partial, frame)
                    if frame is None:
                        continue
                elif isinstance(frame, Segment):
                    if segment is not None:
                        raise _TransferFailed("a second SEGMENT in one transfer")
                    try:
                        segment = shm.InSegment.open(frame.path, frame.size, self.shm_dir)
                    except shm.SegmentError as e:
                        raise _TransferFailed(f"shared-memory segment refused: {e}") from None
                    continue
                elif isinstance(frame, Ref):
                    if segment is None:
                        raise _TransferFailed(f"REF of block {frame.index} before any SEGMENT")
                    if frame.length > self.max_frame_bytes:
                        raise _TransferFailed(f"block {frame.index} of {frame.length} bytes exceeds "
                                              f"max_frame_bytes={self.max_frame_bytes}")
                    try:
                        view = segment.block(frame.offset, frame.length)
                    except shm.SegmentError as e:
                        raise _TransferFailed(f"block {frame.index}: {e}") from None
                    frame = Block(frame.index, frame.block_hash, LocalBlock(view))
                if isinstance(frame, Block):
                    try:
                        async with asyncio.timeout_at(self._loop_deadline(deadline)):
                            await self._accept_block(status, begin, missing, frame)
                    except TimeoutError:
                        raise TimeoutError(f"transfer deadline passed while the receiver's on_block was busy "
                                           f"(block {frame.index})") from None
                elif isinstance(frame, End):
                    if missing:
                        raise _TransferFailed(f"END after {status.num_blocks_sent} blocks, {len(missing)} still missing")
                    status.meta.update(frame.meta)   # learnt while streaming (P's first token)
                    status.succeed(time.monotonic())
                    await self._finish(status)
                    ticker.cancel()
                    stream.write(encode_end(status.num_blocks_sent))
                    return True
                elif isinstance(frame, Wait):
                    continue        # a live sender with nothing to send yet: only the stall timer cares
                elif isinstance(frame, Cancel):
                    status.cancelled = True
                    raise _TransferFailed(f"cancelled by sender: {frame.reason}")
                elif isinstance(frame, Error):
                    raise _TransferFailed(f"sender error: {frame.message}")
                else:
                    raise _TransferFailed(f"protocol error: unexpected {type(frame).__name__} mid-transfer")
        except asyncio.CancelledError:
            status.fail("receiver shutting down", time.monotonic())
            await self._finish(status)
            raise
        except (_TransferFailed, FrameError, ConnectionError, OSError, TimeoutError) as e:
            msg = str(e) if isinstance(e, (_TransferFailed, TimeoutError)) else f"{type(e).__name__}: {e}"
            if isinstance(e, FrameError):
                msg = f"corrupt frame: {e}"
            elif isinstance(e, (ConnectionError, OSError)):
                msg = f"connection lost: {msg}"
            status.fail(msg, time.monotonic())
            refused = not isinstance(e, (ConnectionError, OSError)) and not status.cancelled
            if refused:
                stream.write(encode_error(msg))
            await self._finish(status)
            if refused:
                await _let_sender_read_error(stream)
            return False
        finally:
            ticker.cancel()
            if segment is not None:
                segment.close()

    @staticmethod
    def _loop_deadline(deadline: float | None) -> float | None:
        """time.monotonic() deadline -> the loop's clock (async handlers only can be timed out)."""
        if deadline is None:
            return None
        return asyncio.get_running_loop().time() + (deadline - time.monotonic())

    async def _next_frame(self, stream: FrameStream, status: TransferStatus, deadline: float | None):
        """The sender's next frame; it is stalled once no byte (a WAIT at
        least) came for stall_timeout_s."""
        try:
            if deadline is not None and deadline <= time.monotonic():
                raise TimeoutError
            async with asyncio.timeout_at(self._loop_deadline(deadline)):
                return await stream.read_frame(self.stall_timeout_s, idle=True)
        except TimeoutError:
            where = f"after {status.num_blocks_sent} of {status.num_blocks - status.num_blocks_skipped} missing blocks"
            if deadline is not None and time.monotonic() >= deadline - 1e-3:
                raise TimeoutError(f"transfer deadline passed {where}") from None
            raise TimeoutError(f"sender stalled: nothing for {self.stall_timeout_s} s {where}") from None

    def _assemble(self, begin: Begin, missing: set[int], partial: dict[int, list], part: Part) -> Block | None:
        """One slice of a block; the whole block once its last slice is in."""
        i = part.index
        if i not in missing:
            raise _TransferFailed(f"unexpected slice of block {i} (not missing, duplicate or out of range)")
        if part.block_hash != begin.block_hashes[i]:
            raise _TransferFailed(f"block {i} hash does not match the one announced in BEGIN")
        if part.total > self.max_frame_bytes:
            raise _TransferFailed(f"block {i} of {part.total} bytes exceeds max_frame_bytes={self.max_frame_bytes}")
        got = partial.get(i)
        if got is None:
            if part.offset != 0:
                raise _TransferFailed(f"block {i}: first slice at offset {part.offset}, not 0")
            got = partial[i] = [bytearray(), part.total, None]
        elif part.offset != len(got[0]) or part.total != got[1]:
            raise _TransferFailed(f"block {i}: slice at {part.offset} of {part.total} bytes does not follow "
                                  f"the {len(got[0])} of {got[1]} received")
        if part.digest is not None:
            if got[2] is not None:
                raise _TransferFailed(f"block {i}: a second digest")
            got[2] = part.digest
        got[0] += part.data
        if len(got[0]) < got[1]:
            return None
        del partial[i]
        payload = bytes(got[0]) if got[2] is None else got[2] + got[0]
        return Block(i, part.block_hash, bytes(payload))

    async def _accept_block(self, status: TransferStatus, begin: Begin, missing: set[int], block: Block) -> None:
        if block.index not in missing:
            raise _TransferFailed(f"unexpected block {block.index} (not missing, duplicate or out of range)")
        if block.block_hash != begin.block_hashes[block.index]:
            raise _TransferFailed(f"block {block.index} hash does not match the one announced in BEGIN")
        try:
            await _call(self.handler.on_block, begin.request_id, block.index, block.block_hash, block.payload)
        except Exception as e:
            raise _TransferFailed(f"receiver handler failed on block {block.index}: {e!r}") from e
        missing.discard(block.index)
        status.num_blocks_sent += 1
        status.payload_bytes += len(block.payload)

    async def _finish(self, status: TransferStatus) -> None:
        self.stats.num_succeeded += status.ok
        self.stats.num_failed += not status.ok
        self.stats.num_blocks_received += status.num_blocks_sent
        self.stats.num_blocks_skipped += status.num_blocks_skipped
        self.stats.num_bytes_received += status.bytes_received
        try:
            await _call(self.handler.on_end, status.request_id, status.copy())
        except Exception:
            log.exception("kv receiver: on_end handler failed for %s", status.request_id)
