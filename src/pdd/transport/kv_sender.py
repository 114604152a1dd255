"""KVSender: pushes one request's KV blocks to a KVReceiver.

Lifecycle of a transfer (TransferHandle.poll() shows it without blocking):
    BOOTSTRAPPING  take a pooled connection or connect + authenticate
    WAITING        BEGIN sent, waiting for HAVE
    TRANSFERRING   BLOCK frames for the missing blocks only, drain() after each
                   (on the local line to a peer on this host: the blocks in a
                   shared-memory segment, one REF frame each; `transport.shm`)
    SUCCESS        the receiver acknowledged END (it holds every block)
    FAILED         deadline, cancel(), refused/reset, auth failure, corrupt frame, receiver error

Connections are pooled per peer (`transport.connections.ConnectionPool`);
how transfers share a named line (turns, pacing) is `transport.line_share`,
and what a caller gives and gets back (the blocks' forms, TransferHandle) is
`transport.transfer`.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import time
from pathlib import Path
from typing import Awaitable, Callable, Union

from pdd.engine.kv_codec import BLOCK_DIGEST, seal_block
from pdd.transport import shm
from pdd.transport.auth import DEFAULT_AUTH_TIMEOUT_S, AuthError, as_secret
from pdd.transport.connections import MAX_HANDSHAKES_PER_PEER, ConnectFailed, ConnectionPool
from pdd.transport.line_share import LineShare
from pdd.transport.priority import SLICE_BYTES
from pdd.transport.frames import (
    DEFAULT_MAX_FRAME_BYTES, End, Error, FrameError, Have, encode_begin, encode_block, encode_cancel, encode_end,
    encode_part, encode_ref, encode_segment,
)
from pdd.transport.state import TransferState, TransferStatus
from pdd.transport.stream import DEFAULT_KEEPALIVE_S, DEFAULT_STALL_TIMEOUT_S, FrameStream
from pdd.transport.tls import TlsPeer
from pdd.transport.transfer import BlockSource, PartSource, TransferHandle, into_segment, whole_blocks

# (host, port) -> how to reach it over TLS, or None: plain TCP there
TlsResolver = Callable[[str, int], Union[TlsPeer, None]]
DEFAULT_DEADLINE_S = 60.0


class _PeerError(Exception):
    pass


class KVSender:
    def __init__(self, secret: str | bytes, *, reuse_connections: bool = True, connect_timeout_s: float = 5.0,
                 auth_timeout_s: float = DEFAULT_AUTH_TIMEOUT_S, idle_keep_s: float = 30.0,
                 max_idle_per_peer: int = 8, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
                 max_handshakes_per_peer: int = MAX_HANDSHAKES_PER_PEER,
                 tls: TlsResolver | None = None, seal_blocks: bool = False,
                 keepalive_s: float = DEFAULT_KEEPALIVE_S, stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S,
                 max_yield_s: float = math.inf, paces: dict[str, float] | None = None,
                 shm_line: str | None = None, shm_dir: Path | None = None):
        """tls: which peers speak TLS and the name each must prove. seal_blocks:
        each BLOCK carries the SHA-256 of its bytes (kv_codec.seal_block), taken
        as get_block returns them, for the receiver to check at import.
        max_yield_s: a background copy waiting this long since it started goes
        before younger ones (`LineGate`, the policy's `copy_max_yield_s`).
        paces: bytes/s per line at which background copies are written, all of
        them together (`pdd.deploy.topology.copy_pace`); a line not named: as
        fast as TCP takes them.
        shm_line: the line (`"local"`) on which a peer at a loopback address
        gets the blocks through a shared-memory segment in `shm_dir` (default:
        the host's /dev/shm) instead of the socket (`transport.shm`); None:
        always the socket. A peer reached over TLS keeps the socket."""
        self.seal_blocks = seal_blocks
        self.tls = tls
        self.shm_line = shm_line
        self.shm_dir = (shm_dir or shm.default_dir()) if shm_line is not None else None
        self.segments = shm.SegmentPool(self.shm_dir) if self.shm_dir is not None else None
        if self.shm_dir is not None:
            shm.sweep_stale(self.shm_dir)
        self.max_frame_bytes = max_frame_bytes
        self.keepalive_s = keepalive_s
        self.stall_timeout_s = stall_timeout_s
        self.pool = ConnectionPool(as_secret(secret), tls=tls, reuse=reuse_connections,
                                   connect_timeout_s=connect_timeout_s, auth_timeout_s=auth_timeout_s,
                                   idle_keep_s=idle_keep_s, max_idle_per_peer=max_idle_per_peer,
                                   max_frame_bytes=max_frame_bytes, max_handshakes_per_peer=max_handshakes_per_peer)
        self._active: set[TransferHandle] = set()
        self.lines = LineShare(max_yield_s, paces)   # the lines this sender's transfers share

    def send(self, host: str, port: int, request_id: str, meta: dict, block_hashes: list[bytes],
             get_block: BlockSource, deadline_s: float = DEFAULT_DEADLINE_S, *,
             line: str | None = None, background: bool = False,
             finish: Callable[[], Awaitable[dict]] | None = None, block_bytes: int = 0,
             parts: PartSource | None = None,
             read_into: Callable[[int, memoryview], None] | None = None) -> TransferHandle:
        """Starts the transfer as a task of the running loop and returns at once.
        `line` names the link it crosses; on it a `background` transfer yields to
        the others (`pdd.transport.priority`). No line: no priority.
        Streaming: `get_block` may wait until a block exists, and `finish`, when
        given, is awaited after the last block; what it returns travels in END
        (P's first token, known only once the prefill is over). `parts`, when
        given, replaces `get_block`: the blocks in slices as they come to exist
        (P sends a chunk's KV layer by layer while computing it). `read_into`,
        when given, writes block i's bytes straight into a buffer; a transfer
        of blocks that all exist takes it on the same-host path, the block
        read once into its slot of the segment."""
        status = TransferStatus(request_id, num_blocks=len(block_hashes), started_s=time.monotonic(), meta=dict(meta))
        handle = TransferHandle(status)
        handle.line, handle.background, handle.block_bytes = line, background, block_bytes
        if parts is None and not callable(get_block):
            blocks = get_block
            if len(blocks) != len(block_hashes):
                raise ValueError(f"{len(blocks)} blocks for {len(block_hashes)} hashes")
            get_block = blocks.__getitem__
        handle.read_into = read_into if parts is None else None
        handle.task = asyncio.get_running_loop().create_task(
            self._run(handle, host, port, meta, list(block_hashes), get_block, deadline_s, line, background,
                      finish, parts))
        self._active.add(handle)
        handle.task.add_done_callback(lambda _t: self._active.discard(handle))
        return handle

    def backlog(self) -> dict[str, dict]:
        """Bytes still to send per line, foreground and background (from the
        block sizes the callers gave), the transfers of each kind, and their
        request ids (which copies the report covers), for the router's line
        estimate."""
        out: dict[str, dict] = {}
        for h in list(self._active):
            if h.line is None or h.done:
                continue
            per = out.setdefault(h.line, {"foreground": 0, "background": 0, "foreground_transfers": 0,
                                          "background_transfers": 0, "requests": []})
            per["background" if h.background else "foreground"] += h.bytes_left()
            per["background_transfers" if h.background else "foreground_transfers"] += 1
            per["requests"].append(h.request_id)
        return out

    async def close(self) -> None:
        """Cancels transfers in flight and drops pooled connections."""
        handles = list(self._active)
        for handle in handles:
            handle.cancel("sender closed")
        await asyncio.gather(*(h.task for h in handles if h.task), return_exceptions=True)
        self.pool.close()
        if self.segments is not None:
            self.segments.clear()

    @property
    def idle(self) -> bool:
        """No transfer in flight."""
        return all(h.done for h in self._active)

    @property
    def num_connections_opened(self) -> int:
        return self.pool.num_opened

    @property
    def num_connections_reused(self) -> int:
        return self.pool.num_reused

    @property
    def num_bootstrap_retries(self) -> int:
        return self.pool.num_retries

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

    async def _read_have(self, stream: FrameStream, dest: tuple[str, int], hashes: list[bytes]):
        with self.lines.awaiting_have(dest, hashes):
            try:
                return await stream.read_answer(self.stall_timeout_s)
            except TimeoutError:
                raise _PeerError(f"no HAVE from {dest[0]}:{dest[1]}: the receiver sent nothing for "
                                 f"{self.stall_timeout_s:g} s") from None

    async def _send_blocks(self, handle: TransferHandle, stream: FrameStream, answer: asyncio.Future,
                           hashes: list[bytes], held: set[int], get_block: Callable, parts: PartSource | None,
                           line: str | None, background: bool, dest: tuple[str, int]) -> None:
        """Every block the receiver lacks: whole (BLOCK), or as the source's
        slices (PART, the seal's digest with the last one). A foreground
        transfer holds the line while it has bytes to write, not while its
        source waits for P."""
        status = handle.status
        source = parts(set(held)) if parts is not None else whole_blocks(get_block, len(hashes), held)
        digests: dict[int, "hashlib._Hash"] = {}
        missing = len(hashes) - len(held)
        seg = self._segment_for(handle, dest, line, missing)
        slots: dict[int, int] = {}      # block index -> its slot in the segment
        if seg is not None:
            # only what this transfer fills: the receiver maps no more (a kept file may be larger)
            status.bytes_sent += stream.write(encode_segment(str(seg.path), missing * handle.block_bytes))
            if handle.read_into is not None:
                await source.aclose()
                source = into_segment(handle, seg, len(hashes), held)
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
                    self.lines.let_go(handle)
                    continue
                # A copy holds the line as a foreground transfer, until it ends or
                # waits for P, when a transfer a user waits on needs its blocks.
                if (line is not None and handle.holds_line is None
                        and (not background or self.lines.awaited(dest, hashes[-1]))):
                    self.lines.hold(handle, line)
                i, offset, total, data = item
                # promoted (above): written as a foreground transfer's, unpaced
                yields = background and handle.holds_line is None
                if seg is not None:
                    # Into the block's slot (data None: read there already); the
                    # receiver hears of it once whole.
                    if total != handle.block_bytes:
                        raise ValueError(f"block {i} of {total} bytes in a segment of "
                                         f"{handle.block_bytes}-byte slots")
                    base = slots.setdefault(i, len(slots)) * total
                    n = total if data is None else len(data)
                    if data is not None:
                        seg.write(base + offset, data)
                    status.payload_bytes += n
                    if offset + n >= total:
                        status.num_blocks_sent += 1
                        await self.lines.write_frame(stream, encode_ref(i, hashes[i], base, total), line,
                                                     yields, status, dest, hashes[-1])
                    continue
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
                    await self.lines.write_frame(stream, frame, line, yields, status, dest, hashes[-1])
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
            if handle.segment is not None:
                self.segments.give_back(handle.segment, handle.status.ok)
                handle.segment = None
            self.lines.let_go(handle)
            if line is not None:
                self.lines.leave(line, handle.status)

    def _segment_for(self, handle: TransferHandle, dest: tuple[str, int], line: str | None,
                     num_missing: int) -> shm.OutSegment | None:
        """A shared-memory segment for this transfer's missing blocks, where
        the same-host path applies and the host has room; else None."""
        if (self.shm_dir is None or line is None or line != self.shm_line or num_missing <= 0
                or handle.block_bytes <= 0 or not shm.is_loopback(dest[0])
                or (self.tls is not None and self.tls(*dest) is not None)):
            return None
        handle.segment = self.segments.take(num_missing * handle.block_bytes)
        return handle.segment

    async def _transfer(self, handle: TransferHandle, host: str, port: int, meta: dict, hashes: list[bytes],
                        get_block: Callable, deadline_s: float, line: str | None, background: bool,
                        finish: Callable | None, parts: PartSource | None = None) -> None:
        status = handle.status
        stream: FrameStream | None = None
        try:
            async with asyncio.timeout(deadline_s):
                stream = await self.pool.take(host, port)
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
                if line is not None:
                    self.lines.join(line, status)
                if line is not None and not background:
                    # Background transfers on the line wait from now until this
                    # one has written its last block (or ended). Not before HAVE:
                    # the receiver may hold HAVE back until a background copy of
                    # the same blocks has landed, which must not wait for us.
                    self.lines.hold(handle, line)
                # Read the receiver's answer while sending: a receiver that refuses
                # mid-transfer (a block failing its seal, a handler error) says why
                # in an ERROR and closes; stop at once and report that reason, not
                # the reset our next write would meet.
                answer = asyncio.ensure_future(stream.read_answer(None))
                ticker = stream.keepalive(self.keepalive_s, "nothing to send yet")
                try:
                    await self._send_blocks(handle, stream, answer, hashes, have.indices, get_block, parts,
                                            line, background, (host, port))
                    self.lines.let_go(handle)
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
            self.pool.give_back(host, port, stream)
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
        except (_PeerError, ConnectFailed) as e:
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
