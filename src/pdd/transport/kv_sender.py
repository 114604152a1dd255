"""KVSender: pushes one request's KV blocks to a KVReceiver.

Lifecycle of a transfer (TransferHandle.poll() shows it without blocking):
    BOOTSTRAPPING  take a pooled connection or connect + authenticate
    WAITING        BEGIN sent, waiting for HAVE
    TRANSFERRING   BLOCK frames for the missing blocks only, drain() after each
    SUCCESS        the receiver acknowledged END (it holds every block)
    FAILED         deadline, cancel(), refused/reset, auth failure, corrupt frame, receiver error

Connections: one transfer at a time per connection, connections pooled per
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
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import ssl
import time
from typing import AsyncIterator, Awaitable, Callable, Sequence, Union

from pdd.engine.kv_codec import BLOCK_DIGEST, seal_block
from pdd.transport.auth import DEFAULT_AUTH_TIMEOUT_S, AuthError, as_secret, client_handshake
from pdd.transport.priority import SLICE_BYTES, LineGate
from pdd.transport.frames import (
    DEFAULT_MAX_FRAME_BYTES, End, Error, FrameError, Have, encode_begin, encode_block, encode_cancel, encode_end,
    encode_part,
)
from pdd.transport.state import TransferState, TransferStatus
from pdd.transport.stream import STREAM_LIMIT_BYTES, FrameStream
from pdd.transport.tls import TlsPeer

BlockSource = Union[Sequence[bytes], Callable[[int], Union[bytes, Awaitable[bytes]]]]
# Streaming in slices: given the blocks the receiver holds, yields
# (block index, byte offset, block bytes, slice) for every other block, each
# block's slices in order from offset 0 (blocks may interleave); None while
# nothing is ready (P still computing), so a foreground transfer lets the
# background ones use the line meanwhile.
PartSource = Callable[[set[int]], AsyncIterator[tuple[int, int, int, bytes]]]
# (host, port) -> how to reach it over TLS, or None: plain TCP there
TlsResolver = Callable[[str, int], Union[TlsPeer, None]]
DEFAULT_DEADLINE_S = 60.0
MAX_HANDSHAKES_PER_PEER = 8   # below the receiver's DEFAULT_MAX_UNAUTHENTICATED (32)
# A WAIT this often while a transfer has nothing to write (P still computing,
# or a background copy waiting its turn), well inside the receiver's stall
# timeout (30 s): a queued transfer is not a stalled one.
DEFAULT_KEEPALIVE_S = 5.0
BOOTSTRAP_TRIES = 3
# The receiver silent this long (no frame, not even a WAIT) while we wait for
# its HAVE or its END ack: a dead peer or a cut line, not a busy one.
DEFAULT_STALL_TIMEOUT_S = 30.0


class _PeerError(Exception):
    pass


class _ConnectFailed(Exception):
    pass


class TransferHandle:
    def __init__(self, status: TransferStatus):
        self.status = status
        self.request_id = status.request_id
        self.task: asyncio.Task | None = None
        self.cancel_reason: str | None = None
        self.holds_line: str | None = None     # foreground on this line until its blocks are written
        self.line: str | None = None
        self.background = False
        self.block_bytes = 0                   # a block's payload size, for the backlog (0: unknown)

    def bytes_left(self) -> int:
        st = self.status
        return max(st.num_blocks - st.num_blocks_skipped - st.num_blocks_sent, 0) * self.block_bytes

    def poll(self) -> TransferStatus:
        return self.status.copy()

    @property
    def done(self) -> bool:
        return self.status.done

    async def wait(self) -> TransferStatus:
        if self.task is not None:
            await asyncio.shield(self.task)
        return self.poll()

    def cancel(self, reason: str = "cancelled by caller") -> None:
        """Stop sending; the receiver gets CANCEL and ends the transfer as failed."""
        if self.task is not None and not self.task.done() and self.cancel_reason is None:
            self.cancel_reason = reason
            self.task.cancel()


class KVSender:
    def __init__(self, secret: str | bytes, *, reuse_connections: bool = True, connect_timeout_s: float = 5.0,
                 auth_timeout_s: float = DEFAULT_AUTH_TIMEOUT_S, idle_keep_s: float = 30.0,
                 max_idle_per_peer: int = 8, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
                 max_handshakes_per_peer: int = MAX_HANDSHAKES_PER_PEER,
                 tls: TlsResolver | None = None, seal_blocks: bool = False,
                 keepalive_s: float = DEFAULT_KEEPALIVE_S, stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S):
        """tls: which peers speak TLS and the name each must prove. seal_blocks:
        each BLOCK carries the SHA-256 of its bytes (kv_codec.seal_block), taken
        as get_block returns them, for the receiver to check at import."""
        self.secret = as_secret(secret)
        self.tls = tls
        self.seal_blocks = seal_blocks
        self.reuse_connections = reuse_connections
        self.connect_timeout_s = connect_timeout_s
        self.auth_timeout_s = auth_timeout_s
        self.idle_keep_s = idle_keep_s
        self.max_idle_per_peer = max_idle_per_peer
        self.max_frame_bytes = max_frame_bytes
        self.keepalive_s = keepalive_s
        self.stall_timeout_s = stall_timeout_s
        self.num_connections_opened = 0
        self.num_bootstrap_retries = 0
        self.num_connections_reused = 0
        self.max_handshakes_per_peer = max_handshakes_per_peer
        self._idle: dict[tuple[str, int], list[tuple[FrameStream, float]]] = {}
        self._handshakes: dict[tuple[str, int], asyncio.Semaphore] = {}
        self._active: set[TransferHandle] = set()
        self.gate = LineGate()
        # Transfers waiting for HAVE, per receiver, with their block hashes: a
        # receiver holds HAVE back while another transfer brings it the same
        # blocks, so a background copy that carries blocks a waiting transfer
        # needs must not yield meanwhile (priority inheritance).
        self._awaiting_have: dict[tuple[str, int], list[frozenset]] = {}

    def send(self, host: str, port: int, request_id: str, meta: dict, block_hashes: list[bytes],
             get_block: BlockSource, deadline_s: float = DEFAULT_DEADLINE_S, *,
             line: str | None = None, background: bool = False,
             finish: Callable[[], Awaitable[dict]] | None = None, block_bytes: int = 0,
             parts: PartSource | None = None) -> TransferHandle:
        """Starts the transfer as a task of the running loop and returns at once.
        `line` names the link it crosses; on it a `background` transfer yields to
        the others (`pdd.transport.priority`). No line: no priority.
        Streaming: `get_block` may wait until a block exists, and `finish`, when
        given, is awaited after the last block; what it returns travels in END
        (P's first token, known only once the prefill is over). `parts`, when
        given, replaces `get_block`: the blocks in slices as they come to exist
        (P sends a chunk's KV layer by layer while computing it)."""
        status = TransferStatus(request_id, num_blocks=len(block_hashes), started_s=time.monotonic(), meta=dict(meta))
        handle = TransferHandle(status)
        handle.line, handle.background, handle.block_bytes = line, background, block_bytes
        if parts is None and not callable(get_block):
            blocks = get_block
            if len(blocks) != len(block_hashes):
                raise ValueError(f"{len(blocks)} blocks for {len(block_hashes)} hashes")
            get_block = blocks.__getitem__
        handle.task = asyncio.get_running_loop().create_task(
            self._run(handle, host, port, meta, list(block_hashes), get_block, deadline_s, line, background,
                      finish, parts))
        self._active.add(handle)
        handle.task.add_done_callback(lambda _t: self._active.discard(handle))
        return handle

    def backlog(self) -> dict[str, dict[str, int]]:
        """Bytes still to send per line, foreground and background (from the
        block sizes the callers gave), and the transfers of each kind, for the
        router's line estimate."""
        out: dict[str, dict[str, int]] = {}
        for h in list(self._active):
            if h.line is None or h.done:
                continue
            per = out.setdefault(h.line, {"foreground": 0, "background": 0, "foreground_transfers": 0,
                                          "background_transfers": 0})
            per["background" if h.background else "foreground"] += h.bytes_left()
            per["background_transfers" if h.background else "foreground_transfers"] += 1
        return out

    async def close(self) -> None:
        """Cancels transfers in flight and drops pooled connections."""
        handles = list(self._active)
        for handle in handles:
            handle.cancel("sender closed")
        await asyncio.gather(*(h.task for h in handles if h.task), return_exceptions=True)
        for conns in self._idle.values():
            for stream, _ in conns:
                stream.abort()
        self._idle.clear()

    async def _acquire(self, host: str, port: int, line: str | None = None) -> FrameStream:
        conns = self._idle.get((host, port), [])
        now = time.monotonic()
        while conns:
            stream, last_used_s = conns.pop()
            if stream.is_usable() and now - last_used_s < self.idle_keep_s:
                self.num_connections_reused += 1
                return stream
            stream.abort()
        turn = self._handshakes.get((host, port))
        if turn is None:
            turn = self._handshakes[(host, port)] = asyncio.Semaphore(self.max_handshakes_per_peer)
        async with turn:
            return await self._connect(host, port)

    async def _bootstrap(self, host: str, port: int, line: str | None) -> FrameStream:
        """`_acquire`, again (up to BOOTSTRAP_TRIES in all, backing off) when
        the receiver closes or resets the connection before BEGIN: under load
        our loop can be slow enough for its auth timeout, and nothing of the
        transfer has reached it yet. A refused connection, a refused key and
        our own handshake timeout (a receiver silent to us: a dead one, or a
        cut line) fail at once."""
        for attempt in range(BOOTSTRAP_TRIES):
            try:
                return await self._acquire(host, port, line)
            except (ConnectionError, OSError):
                if attempt == BOOTSTRAP_TRIES - 1:
                    raise
                self.num_bootstrap_retries += 1
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
            raise _ConnectFailed(f"cannot connect to {host}:{port}: timed out after {self.connect_timeout_s} s") from None
        except ssl.SSLError as e:  # the receiver's certificate: another CA, another name, expired
            raise _ConnectFailed(f"TLS with {host}:{port} (as {peer.name}) refused: "
                                  f"{getattr(e, 'verify_message', None) or e.reason or e}") from None
        except OSError as e:  # refused, unreachable, unknown host
            reason = "connection refused" if isinstance(e, ConnectionRefusedError) else f"{type(e).__name__}: {e}"
            raise _ConnectFailed(f"cannot connect to {host}:{port}: {reason}") from None
        self.num_connections_opened += 1
        stream = FrameStream(reader, writer, self.max_frame_bytes)
        try:
            await client_handshake(stream, self.secret, self.auth_timeout_s)
        except (asyncio.TimeoutError, TimeoutError):
            stream.abort()
            raise AuthError(f"no CHALLENGE from {host}:{port} within {self.auth_timeout_s} s") from None
        except ssl.SSLError as e:  # TLS 1.3: the receiver judges our certificate after the handshake
            stream.abort()
            raise _ConnectFailed(f"TLS with {host}:{port} refused by the receiver: {e.reason or e}") from None
        except BaseException:
            stream.abort()
            raise
        return stream

    async def _ack(self, stream: FrameStream, answer: asyncio.Future, dest: tuple[str, int]):
        """The receiver's answer to END, while it keeps saying it is alive
        (WAITs while it imports)."""
        while True:
            done, _ = await asyncio.wait({answer}, timeout=self.stall_timeout_s)
            if done:
                return answer.result()
            if time.monotonic() - stream.last_read_s >= self.stall_timeout_s:
                raise _PeerError(f"no END ack from {dest[0]}:{dest[1]}: the receiver sent nothing for "
                                 f"{self.stall_timeout_s:g} s")

    def _release(self, host: str, port: int, stream: FrameStream) -> None:
        conns = self._idle.setdefault((host, port), [])
        if self.reuse_connections and stream.is_usable() and len(conns) < self.max_idle_per_peer:
            conns.append((stream, time.monotonic()))
        else:
            stream.writer.close()  # graceful: nothing is left to flush after the END ack

    async def _read_have(self, stream: FrameStream, dest: tuple[str, int], hashes: list[bytes]):
        waiting = self._awaiting_have.setdefault(dest, [])
        mine = frozenset(hashes)
        waiting.append(mine)
        try:
            return await stream.read_answer(self.stall_timeout_s)
        except TimeoutError:
            raise _PeerError(f"no HAVE from {dest[0]}:{dest[1]}: the receiver sent nothing for "
                             f"{self.stall_timeout_s:g} s") from None
        finally:
            waiting.remove(mine)
            if not waiting:
                del self._awaiting_have[dest]

    def _awaited(self, dest: tuple[str, int], last_hash: bytes) -> bool:
        """A transfer to `dest` waits for HAVE and needs this copy's blocks."""
        return any(last_hash in w for w in self._awaiting_have.get(dest, ()))

    async def _write_frame(self, stream: FrameStream, frame: bytes, line: str | None, background: bool,
                           status: TransferStatus, dest: tuple[str, int], last_hash: bytes) -> None:
        """One frame, in one write (so a keepalive WAIT never lands
        inside it); a background one (a slice of at most SLICE_BYTES) after
        the foreground transfers on the line are through, in its turn."""
        held = line is not None and background and not self._awaited(dest, last_hash)
        if held:
            left = status.num_blocks - status.num_blocks_skipped - status.num_blocks_sent + 1
            status.yielded_s += await self.gate.turn(line, id(status), left)
        try:
            status.bytes_sent += stream.write(frame)
            await stream.drain()
        finally:
            if held:
                self.gate.release(line, id(status))

    async def _send_blocks(self, handle: TransferHandle, stream: FrameStream, answer: asyncio.Future,
                           hashes: list[bytes], held: set[int], get_block: Callable, parts: PartSource | None,
                           line: str | None, background: bool, dest: tuple[str, int]) -> None:
        """Every block the receiver lacks: whole (BLOCK), or as the source's
        slices (PART, the seal's digest with the last one). A foreground
        transfer holds the line while it has bytes to write, not while its
        source waits for P."""
        status = handle.status
        source = parts(set(held)) if parts is not None else _whole_blocks(get_block, len(hashes), held)
        digests: dict[int, "hashlib._Hash"] = {}
        try:
            while not answer.done():
                t0 = time.monotonic()
                try:
                    item = await source.__anext__()
                except StopAsyncIteration:
                    break
                finally:
                    status.waited_s += time.monotonic() - t0
                if item is None:
                    self._let_go(handle)
                    continue
                if line is not None and not background and handle.holds_line is None:
                    handle.holds_line = line
                    self.gate.enter(line)
                i, offset, total, data = item
                # A background copy goes in slices (PART frames), one per turn on the line.
                step = SLICE_BYTES if line is not None and background else max(len(data), 1)
                view = memoryview(data)
                for k in range(0, max(len(data), 1), step):
                    piece, at = view[k:k + step], offset + k
                    last = at + len(piece) >= total
                    if at == 0 and last:
                        wire = seal_block(data) if self.seal_blocks else data
                        frame = encode_block(i, hashes[i], wire, self.max_frame_bytes)
                    else:
                        digest = None
                        if self.seal_blocks:
                            h = digests.setdefault(i, hashlib.sha256())
                            h.update(piece)
                            if last:
                                digest = digests.pop(i).digest()
                        frame = encode_part(i, hashes[i], at, total, piece, digest, self.max_frame_bytes)
                    status.num_blocks_sent += last
                    status.payload_bytes += len(piece)
                    await self._write_frame(stream, frame, line, background, status, dest, hashes[-1])
        finally:
            await source.aclose()

    async def _run(self, handle: TransferHandle, host: str, port: int, meta: dict, hashes: list[bytes],
                   get_block: Callable, deadline_s: float, line: str | None = None,
                   background: bool = False, finish: Callable | None = None,
                   parts: PartSource | None = None) -> None:
        try:
            await self._transfer(handle, host, port, meta, hashes, get_block, deadline_s, line, background,
                                 finish, parts)
        finally:
            self._let_go(handle)

    def _let_go(self, handle: TransferHandle) -> None:
        if handle.holds_line is not None:
            self.gate.leave(handle.holds_line)
            handle.holds_line = None

    async def _transfer(self, handle: TransferHandle, host: str, port: int, meta: dict, hashes: list[bytes],
                        get_block: Callable, deadline_s: float, line: str | None, background: bool,
                        finish: Callable | None, parts: PartSource | None = None) -> None:
        status = handle.status
        stream: FrameStream | None = None
        try:
            async with asyncio.timeout(deadline_s):
                stream = await self._bootstrap(host, port, line)
                if self.seal_blocks:
                    meta = meta | {"block_digest": BLOCK_DIGEST}
                status.bytes_sent += stream.write(encode_begin(status.request_id, meta, hashes, deadline_s,
                                                               self.max_frame_bytes))
                status.state = TransferState.WAITING
                begun = time.monotonic()
                have = await self._read_have(stream, (host, port), hashes)
                status.handshake_s = time.monotonic() - begun
                if isinstance(have, Error):
                    raise _PeerError(f"receiver refused transfer: {have.message}")
                if not isinstance(have, Have) or have.num_blocks != len(hashes):
                    raise _PeerError(f"protocol error: expected HAVE for {len(hashes)} blocks, got {have}")
                status.num_blocks_skipped = len(have.indices)
                status.state = TransferState.TRANSFERRING
                if line is not None and not background:
                    # Background transfers on the line wait from now until this
                    # one has written its last block (or ended). Not before HAVE:
                    # the receiver may hold HAVE back until a background copy of
                    # the same blocks has landed, which must not wait for us.
                    handle.holds_line = line
                    self.gate.enter(line)
                # Read the receiver's answer while sending: a receiver that refuses
                # mid-transfer (a block failing its seal, a handler error) says why
                # in an ERROR and closes; stop at once and report that reason, not
                # the reset our next write would meet.
                answer = asyncio.ensure_future(stream.read_answer(None))
                ticker = stream.keepalive(self.keepalive_s, "nothing to send yet")
                try:
                    await self._send_blocks(handle, stream, answer, hashes, have.indices, get_block, parts,
                                            line, background, (host, port))
                    self._let_go(handle)
                    extra = None
                    if finish is not None and not answer.done():
                        t0 = time.monotonic()
                        extra = await finish()
                        status.waited_s += time.monotonic() - t0
                    ticker.cancel()
                    if not answer.done():
                        status.bytes_sent += stream.write(encode_end(status.num_blocks_sent, extra))
                    ack = await self._ack(stream, answer, (host, port))
                except (ConnectionError, OSError):
                    await asyncio.sleep(0)       # let a frame that arrived before the reset be read
                    if answer.done() and not answer.cancelled() and answer.exception() is None \
                            and isinstance(answer.result(), Error):
                        raise _PeerError(f"receiver failed transfer: {answer.result().message}") from None
                    raise
                finally:
                    ticker.cancel()
                    if not answer.done():
                        answer.cancel()
                    elif not answer.cancelled():
                        answer.exception()   # retrieved: a failure is reported by the paths below
                if isinstance(ack, Error):
                    raise _PeerError(f"receiver failed transfer: {ack.message}")
                if not isinstance(ack, End) or ack.num_blocks != status.num_blocks_sent:
                    raise _PeerError(f"protocol error: expected END ack of {status.num_blocks_sent} blocks, got {ack}")
            status.succeed(time.monotonic())
            self._release(host, port, stream)
            return
        except asyncio.CancelledError:
            if handle.cancel_reason is None:
                raise
            asyncio.current_task().uncancel()
            status.cancelled = True
            error = f"cancelled: {handle.cancel_reason}"
            if stream is not None and status.state >= TransferState.WAITING:
                stream.write(encode_cancel(handle.cancel_reason))
                status.fail(error, time.monotonic())
                await stream.close(timeout_s=0.5)
                return
        except TimeoutError:
            error = f"deadline of {deadline_s} s exceeded while {status.state.name} " \
                    f"({status.num_blocks_sent} blocks sent)"
        except AuthError as e:
            error = f"authentication with {host}:{port} failed: {e}"
        except (_PeerError, _ConnectFailed) as e:
            error = str(e)
        except FrameError as e:
            error = f"corrupt frame from receiver {host}:{port}: {e}"
        except (ConnectionError, OSError) as e:
            error = f"connection to {host}:{port} lost while {status.state.name}: {e or type(e).__name__}"
            if stream is not None:
                error += await _late_peer_error(stream)
        except Exception as e:  # get_block raised, bad payload type, ...
            error = f"sender error while {status.state.name}: {e!r}"
            if stream is not None and status.state >= TransferState.WAITING:
                stream.write(encode_cancel(error))
                status.fail(error, time.monotonic())
                await stream.close(timeout_s=0.5)
                return
        status.fail(error, time.monotonic())
        if stream is not None:
            stream.abort()


async def _whole_blocks(get_block: Callable, n: int, held: set[int]) -> AsyncIterator[tuple[int, int, int, bytes]]:
    """The blocks the receiver lacks, whole, in order, from a per-block source."""
    for i in range(n):
        if i in held:
            continue
        payload = get_block(i)
        if inspect.isawaitable(payload):
            payload = await payload
        yield i, 0, len(payload), payload


async def _late_peer_error(stream: FrameStream) -> str:
    """The receiver may have said why before closing (e.g. a hash mismatch)."""
    try:
        frame = await stream.read_frame(0.2)
    except Exception:
        return ""
    return f" (receiver said: {frame.message})" if isinstance(frame, Error) else ""


def send_kv(host: str, port: int, secret: str | bytes, request_id: str, meta: dict, block_hashes: list[bytes],
            get_block: BlockSource, deadline_s: float = DEFAULT_DEADLINE_S) -> TransferHandle:
    """One transfer over its own connection (closed afterwards). Servers moving
    many transfers should keep one KVSender and call .send() to reuse connections."""
    return KVSender(secret, reuse_connections=False).send(host, port, request_id, meta, block_hashes,
                                                          get_block, deadline_s)
