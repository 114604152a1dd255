"""WanLink: an asyncio TCP relay that makes loopback look like a WAN line.

One WanLink is one line between datacenter A and B: ONE Shaper per direction
(A->B, B->A) shared by every connection of every port mapping, as a real line
is shared. A mapping `listen_port -> (target_host, target_port)` carries
clients in A to a server in B (`reverse=True`: clients in B, server in A).

Each relayed connection is two Pipes (pdd.wan.pipe), one per direction:
shaped, in order, with backpressure towards the sender. The line's buffer is
one per direction too (`LineQueue`), shared by every bulk connection.

cut(): every current connection is reset (RST) at once, queued bytes are
dropped, and new connections are accepted and reset until restore().
cut(mode="blackhole"): connections stay up but nothing gets through; bytes
are held (senders stall once the hold is full) and flow again on restore(),
like a transient outage that TCP rides out.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import asdict, dataclass

from pdd.wan.pipe import LineQueue, Pipe, reset_transport
from pdd.wan.shaper import (
    KEEP, DEFAULT_BURST_BYTES, DEFAULT_JITTER_S, DEFAULT_LATENCY_S, DEFAULT_RATE_BYTES_S, Shaper,
)

log = logging.getLogger(__name__)


@dataclass
class WanStats:
    bytes_a_to_b: int = 0  # delivered
    bytes_b_to_a: int = 0
    num_connections: int = 0  # accepted and relayed
    num_active: int = 0
    num_refused: int = 0  # accepted and reset while cut
    num_resets: int = 0  # connections reset by cut()
    num_upstream_failures: int = 0
    num_bytes_dropped: int = 0  # queued bytes thrown away by cut() or a reset


class _Side(asyncio.BufferedProtocol):
    """One TCP endpoint of a relayed connection; `mapping` is set on accepted clients.
    Reads go into a buffer of the size its pipe asks for (`Pipe.read_bytes`),
    so connections that the line lets read again add a bounded amount each."""

    def __init__(self, link: "WanLink", mapping: "_Mapping | None" = None):
        self.conn: _Relayed | None = None
        self.link = link
        self.mapping = mapping
        self.transport: asyncio.Transport | None = None
        self.pipe_out: Pipe | None = None  # pipe that reads from this side
        self._buf = bytearray()

    def connection_made(self, transport) -> None:
        self.transport = transport
        if self.mapping is not None:
            self.link._accept(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        size = self.pipe_out.read_bytes() if self.pipe_out is not None else 64 * 1024
        if len(self._buf) != size:
            self._buf = bytearray(size)
        return memoryview(self._buf)

    def buffer_updated(self, nbytes: int) -> None:
        if self.pipe_out is not None:
            self.pipe_out.push(bytes(memoryview(self._buf)[:nbytes]))   # one copy

    def eof_received(self) -> bool:
        if self.pipe_out is not None:
            self.pipe_out.on_eof()
        return True  # keep the other direction open

    def connection_lost(self, exc) -> None:
        if self.conn is not None:
            self.conn.on_lost(self, exc)

    def pause_writing(self) -> None:
        if self.conn is not None:
            self.conn.pipe_into(self).dst_full = True
            self.conn.pipe_into(self).update_reading()

    def resume_writing(self) -> None:
        if self.conn is not None:
            self.conn.pipe_into(self).dst_full = False
            self.conn.pipe_into(self).update_reading()


class _Relayed:
    """One relayed connection: client side, upstream side, two pipes."""

    def __init__(self, link: "WanLink", client: _Side, upstream: _Side, reverse: bool):
        self.link, self.client, self.upstream = link, client, upstream
        client.conn = upstream.conn = self
        control = client.mapping is not None and client.mapping.control
        self.up = Pipe(link, client, upstream, a_to_b=not reverse, priority=control)
        self.down = Pipe(link, upstream, client, a_to_b=reverse, priority=control)
        self.closed = False

    def pipe_into(self, side: _Side) -> Pipe:
        return self.up if side is self.upstream else self.down

    def maybe_close(self) -> None:
        if self.up.eof_sent and self.down.eof_sent:
            self.close(reset=False)

    def on_lost(self, side: _Side, exc) -> None:
        self.close(reset=exc is not None)

    def close(self, reset: bool) -> None:
        if self.closed:
            return
        self.closed = True
        self.link._forget(self)
        self.link.stats.num_bytes_dropped += self.up.drop() + self.down.drop()
        for side in (self.client, self.upstream):
            if reset:
                reset_transport(side.transport)
            elif side.transport is not None and not side.transport.is_closing():
                side.transport.close()


@dataclass
class _Mapping:
    listen_port: int
    target_host: str
    target_port: int
    reverse: bool
    server: asyncio.Server | None = None
    control: bool = False        # priority class (`Shaper.schedule`), both directions


class WanLink:
    def __init__(self, rate_bytes_s: float | None = DEFAULT_RATE_BYTES_S, latency_s: float = DEFAULT_LATENCY_S,
                 jitter_s: float = DEFAULT_JITTER_S, burst_bytes: int = DEFAULT_BURST_BYTES, seed: int = 0):
        self.shaper_a_to_b = Shaper(rate_bytes_s, latency_s, jitter_s, burst_bytes, seed=seed)
        self.shaper_b_to_a = Shaper(rate_bytes_s, latency_s, jitter_s, burst_bytes, seed=seed + 1)
        self._queues = {True: LineQueue(self.shaper_a_to_b), False: LineQueue(self.shaper_b_to_a)}
        self.stats = WanStats()
        self.mappings: list[_Mapping] = []
        self.is_cut = False
        self.blackholed = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self._conns: set[_Relayed] = set()
        self._tasks: set[asyncio.Task] = set()

    async def add_mapping(self, listen_port: int, target_host: str, target_port: int, *,
                          listen_host: str = "127.0.0.1", reverse: bool = False, control: bool = False) -> int:
        """Relay listen_port -> target; returns the bound port (listen_port 0: any).
        `control`: its connections' bytes, both ways, go in the priority class."""
        self.loop = asyncio.get_running_loop()
        mapping = _Mapping(listen_port, target_host, target_port, reverse, control=control)
        mapping.server = await self.loop.create_server(lambda: _Side(self, mapping), listen_host, listen_port)
        mapping.listen_port = mapping.server.sockets[0].getsockname()[1]
        self.mappings.append(mapping)
        return mapping.listen_port

    def set(self, *, rate_bytes_s=KEEP, latency_s=KEEP, jitter_s=KEEP, burst_bytes=KEEP) -> None:
        """Reconfigure both directions at run time (rate None or 0: unlimited)."""
        for shaper in (self.shaper_a_to_b, self.shaper_b_to_a):
            shaper.configure(rate_bytes_s=rate_bytes_s, latency_s=latency_s, jitter_s=jitter_s,
                             burst_bytes=burst_bytes)

    def cut(self, mode: str = "reset") -> None:
        if mode not in ("reset", "blackhole"):
            raise ValueError(f"unknown cut mode {mode!r} (reset or blackhole)")
        self.is_cut = True
        self.blackholed = mode == "blackhole"
        if mode == "reset":
            for conn in list(self._conns):
                self.stats.num_resets += 1
                conn.close(reset=True)
            for shaper in (self.shaper_a_to_b, self.shaper_b_to_a):
                shaper.restore()   # the dropped bytes no longer occupy the line

    def restore(self) -> None:
        was_blackholed = self.blackholed
        self.is_cut = self.blackholed = False
        if was_blackholed:
            for conn in list(self._conns):
                conn.up.release_held()
                conn.down.release_held()

    def line_queue(self, a_to_b: bool) -> LineQueue:
        """The buffer of one direction of the line, shared by its bulk connections."""
        return self._queues[a_to_b]

    def stats_dict(self) -> dict:
        return {
            **asdict(self.stats),
            "is_cut": self.is_cut,
            "cut_mode": ("blackhole" if self.blackholed else "reset") if self.is_cut else None,
            "a_to_b": self.shaper_a_to_b.config(),
            "b_to_a": self.shaper_b_to_a.config(),
            "mappings": [{"listen_port": m.listen_port, "target": f"{m.target_host}:{m.target_port}",
                          "reverse": m.reverse} for m in self.mappings],
        }

    async def close(self) -> None:
        for mapping in self.mappings:
            if mapping.server is not None:
                mapping.server.close()
        for conn in list(self._conns):
            conn.close(reset=True)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for mapping in self.mappings:
            if mapping.server is not None:
                await mapping.server.wait_closed()
                mapping.server = None

    # -- internals called by the protocols ------------------------------
    def _accept(self, client: _Side) -> None:
        if self.is_cut and not self.blackholed:
            self.stats.num_refused += 1
            reset_transport(client.transport)
            return
        client.transport.pause_reading()  # until the upstream side is connected
        mapping = client.mapping
        conn = _Relayed(self, client, _Side(self), mapping.reverse)
        self._conns.add(conn)
        self.stats.num_connections += 1
        self.stats.num_active = len(self._conns)
        task = self.loop.create_task(self._connect(conn, mapping))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _connect(self, conn: _Relayed, mapping: _Mapping) -> None:
        try:
            await self.loop.create_connection(lambda: conn.upstream, mapping.target_host, mapping.target_port)
        except OSError as e:
            self.stats.num_upstream_failures += 1
            log.warning("wan: cannot reach %s:%s: %s", mapping.target_host, mapping.target_port, e)
            conn.close(reset=True)
            return
        if conn.closed:  # client gone or line cut while connecting
            reset_transport(conn.upstream.transport)
            return
        conn.up.update_reading()

    def _forget(self, conn: _Relayed) -> None:
        self._conns.discard(conn)
        self.stats.num_active = len(self._conns)

    def _count(self, a_to_b: bool, nbytes: int) -> None:
        if a_to_b:
            self.stats.bytes_a_to_b += nbytes
        else:
            self.stats.bytes_b_to_a += nbytes
