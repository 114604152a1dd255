"""A recording TCP proxy for tests: every byte either side sends, as it crossed
a real socket (import with `from wire_tap import WireTap`)."""

from __future__ import annotations

import asyncio


class WireTap:
    def __init__(self, target_host: str, target_port: int):
        self.target = (target_host, target_port)
        self.upstream = bytearray()     # client -> server
        self.downstream = bytearray()   # server -> client
        self.port = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def captured(self) -> bytes:
        return bytes(self.upstream) + bytes(self.downstream)

    async def start(self) -> "WireTap":
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def close(self) -> None:
        self._server.close()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.target)
        pumps = [asyncio.create_task(self._pump(reader, up_writer, self.upstream)),
                 asyncio.create_task(self._pump(up_reader, writer, self.downstream))]
        self._tasks.update(pumps)
        await asyncio.gather(*pumps, return_exceptions=True)
        self._tasks.difference_update(pumps)
        for w in (writer, up_writer):
            w.close()

    @staticmethod
    async def _pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter, log: bytearray) -> None:
        try:
            while data := await src.read(65536):
                log += data
                dst.write(data)
                await dst.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            if dst.can_write_eof():
                try:
                    dst.write_eof()
                except (ConnectionError, OSError):
                    pass
