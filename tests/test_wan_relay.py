"""The relay over loopback: shaped rate, latency, cut/restore with the KV transport."""

import asyncio
import hashlib
import os
import time

import pytest

from pdd.transport.kv_receiver import KVReceiver
from pdd.transport.kv_sender import KVSender
from pdd.transport.state import TransferState
from pdd.wan.relay import WanLink

SECRET = "s"


def run(coro, timeout_s=20):
    asyncio.run(asyncio.wait_for(coro, timeout_s))


async def sink_server(stats):
    async def sink(reader, writer):
        try:
            while data := await reader.read(1 << 20):
                now = time.monotonic()
                stats.setdefault("first", (now, len(data)))
                stats["last"] = now
                stats["bytes"] = stats.get("bytes", 0) + len(data)
        except ConnectionError:
            pass
        finally:
            stats["num_closed"] = stats.get("num_closed", 0) + 1
            writer.close()
    return await asyncio.start_server(sink, "127.0.0.1", 0)


def test_throughput_matches_configured_rate_on_a_shared_line():
    async def main():
        stats = {}
        server = await sink_server(stats)
        link = WanLink(rate_bytes_s=20e6, latency_s=0.0, jitter_s=0)
        port = await link.add_mapping(0, "127.0.0.1", server.sockets[0].getsockname()[1])
        try:
            chunk = b"x" * (1 << 20)

            async def push(num_mb):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                for _ in range(num_mb):
                    writer.write(chunk)
                    await writer.drain()
                writer.close()
                await writer.wait_closed()
            await asyncio.gather(push(16), push(16))  # two connections share one line
            t_end = time.monotonic() + 3
            while stats.get("num_closed", 0) < 2 and time.monotonic() < t_end:
                await asyncio.sleep(0.02)
            t_first, first_bytes = stats["first"]
            rate = (stats["bytes"] - first_bytes) / (stats["last"] - t_first)
            assert stats["bytes"] == 32 << 20
            assert rate == pytest.approx(20e6, rel=0.10), rate
            assert link.stats.bytes_a_to_b == 32 << 20 and link.stats.num_connections == 2
        finally:
            await link.close()
            server.close()
            await server.wait_closed()
    run(main())


async def _echo_server():
    async def echo(reader, writer):
        try:
            while data := await reader.read(1024):
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        writer.close()
    return await asyncio.start_server(echo, "127.0.0.1", 0)


async def _rtt(port):
    """A 512-byte round trip on a connection already through the relay."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"x")
    await reader.readexactly(1)
    t0 = time.monotonic()
    writer.write(b"p" * 512)
    await reader.readexactly(512)
    writer.close()
    return time.monotonic() - t0


async def _flooded(num_bulk, measure, rate=2e6, latency_s=0.02):
    """`num_bulk` connections write as fast as the line takes them; after 1 s,
    `measure(ctl_port, plain_port)` on the same line."""
    stats = {}
    sink = await sink_server(stats)
    server = await _echo_server()
    link = WanLink(rate_bytes_s=rate, latency_s=latency_s, jitter_s=0)
    bulk_port = await link.add_mapping(0, "127.0.0.1", sink.sockets[0].getsockname()[1])
    echo_port = server.sockets[0].getsockname()[1]
    ctl_port = await link.add_mapping(0, "127.0.0.1", echo_port, control=True)
    plain_port = await link.add_mapping(0, "127.0.0.1", echo_port)
    done = asyncio.Event()
    writers = [(await asyncio.open_connection("127.0.0.1", bulk_port))[1] for _ in range(num_bulk)]

    async def flood(bw):
        stop = time.monotonic() + 8
        while not done.is_set() and time.monotonic() < stop:
            bw.write(b"k" * 65536)
            await bw.drain()
    tasks = [asyncio.create_task(flood(bw)) for bw in writers]
    try:
        await asyncio.sleep(1.0)          # the line's buffer is full
        return await measure(ctl_port, plain_port), link
    finally:
        done.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        for bw in writers:
            bw.close()
        await link.close()
        for s in (server, sink):
            s.close()
            await s.wait_closed()


def test_control_connections_do_not_queue_behind_bulk_bytes():
    """A busy connection keeps the line's buffer about half full to full (plus
    a read); a small request and its echo on a control connection cross in
    about one round trip, on a bulk connection behind that buffer."""
    async def main():
        async def measure(ctl_port, plain_port):
            return await _rtt(ctl_port), await _rtt(plain_port)
        (ctl, plain), link = await _flooded(1, measure)
        limit = link.line_queue(True).limit_bytes()
        assert ctl < 0.1, ctl                                   # 2 x 20 ms, plus serialization
        # behind what the buffer holds: about half to all of it (it dips
        # below half while the loop gets round to the flooder's next read)
        assert plain > ctl + 0.015 and plain > 0.04 + 0.1 * limit / 2e6, (ctl, plain)
        assert plain < 0.04 + 2 * limit / 2e6 + 0.15, plain
    run(main())


def test_the_line_s_buffer_is_shared_by_its_connections():
    """Eight connections flooding one line leave a new connection's round trip
    behind one buffer of the line, not eight: a router's buffer is the
    line's, not each flow's, and the line's rate is shared about evenly."""
    async def main():
        async def measure(ctl_port, plain_port):
            return [await _rtt(plain_port) for _ in range(3)]
        rtts, link = await _flooded(8, measure)
        limit = link.line_queue(True).limit_bytes()
        assert limit < 8 * 65536 * 2, limit      # eight connections' reads would overflow it
        # a per-connection buffer would put ~8 x 0.13 s ahead of the request
        assert max(rtts) < 0.04 + 2 * limit / 2e6 + 0.25, rtts
    run(main(), timeout_s=30)


def test_ping_pong_rtt_is_twice_the_latency():
    async def main():
        echo_done = asyncio.Event()

        async def echo(reader, writer):
            try:
                while data := await reader.read(1024):
                    writer.write(data)
            except ConnectionError:
                pass
            writer.close()
            echo_done.set()
        server = await asyncio.start_server(echo, "127.0.0.1", 0)
        link = WanLink(rate_bytes_s=50e6, latency_s=0.03, jitter_s=0.005, seed=3)
        port = await link.add_mapping(0, "127.0.0.1", server.sockets[0].getsockname()[1])
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            rtts = []
            for _ in range(6):
                t0 = time.monotonic()
                writer.write(b"ping")
                assert await reader.readexactly(4) == b"ping"
                rtts.append(time.monotonic() - t0)
            writer.close()
            await writer.wait_closed()
            await asyncio.wait_for(echo_done.wait(), 2)  # the EOF crossed the relay too
            assert all(0.05 <= r <= 0.085 for r in rtts), rtts  # 2 x (30 +- 5) ms + scheduling slack
            assert sum(rtts) / len(rtts) == pytest.approx(0.06, abs=0.012)
        finally:
            await link.close()
            server.close()
            await server.wait_closed()
    run(main())


class Sink:
    def __init__(self):
        self.ends = []

    def on_begin(self, request_id, meta, block_hashes):
        return set()

    def on_block(self, request_id, index, block_hash, payload):
        pass

    def on_end(self, request_id, status):
        self.ends.append(status)


def test_cut_fails_kv_transfer_within_deadline_and_restore_recovers():
    async def main():
        sink = Sink()
        receiver = await KVReceiver.start("127.0.0.1", 0, SECRET, sink)
        link = WanLink(rate_bytes_s=10e6, latency_s=0.01, jitter_s=0)
        port = await link.add_mapping(0, "127.0.0.1", receiver.port)
        sender = KVSender(SECRET)
        blocks = [os.urandom(200_000)] * 50  # 10 MB: ~1 s on this line
        hashes = [hashlib.blake2b(bytes([i]), digest_size=16).digest() for i in range(50)]
        try:
            for mode in ("reset", "blackhole"):
                t0 = time.monotonic()
                handle = sender.send("127.0.0.1", port, f"cut-{mode}", {}, hashes, blocks, deadline_s=2.0)
                while handle.poll().num_blocks_sent < 10:
                    assert time.monotonic() - t0 < 3
                    await asyncio.sleep(0.01)
                link.cut(mode)
                st = await handle.wait()
                assert st.state == TransferState.FAILED, st
                assert time.monotonic() - t0 < 2.0 + 0.3
                assert ("lost" in st.error) if mode == "reset" else ("deadline" in st.error), st.error
                if mode == "reset":  # new connections are refused while cut
                    refused = await sender.send("127.0.0.1", port, "refused", {}, hashes[:1], blocks[:1], 1.0).wait()
                    assert refused.state == TransferState.FAILED and link.stats.num_refused >= 1
                link.restore()
                ok = await sender.send("127.0.0.1", port, f"after-{mode}", {}, hashes[:5], blocks[:5], 3.0).wait()
                assert ok.state == TransferState.SUCCESS, ok.error
            t_end = time.monotonic() + 4  # the receiver ends every transfer, failed ones included
            while len(sink.ends) < 4 and time.monotonic() < t_end:
                await asyncio.sleep(0.02)
            ends = {s.request_id: s for s in sink.ends}
            assert len(sink.ends) == 4 and sorted(ends) == ["after-blackhole", "after-reset", "cut-blackhole", "cut-reset"]
            assert ends["after-reset"].ok and ends["after-blackhole"].ok
            # Both cut transfers ended failed on the receiver too; the reset cut refused a connection.
            assert not ends["cut-reset"].ok and not ends["cut-blackhole"].ok
            assert link.stats.num_resets >= 1
        finally:
            await sender.close()
            await link.close()
            await receiver.close()
    run(main())


def test_the_relay_carries_each_far_instance_s_http_port_in_the_control_class():
    """The launcher marks a mapping as control by `topology.control_ports`:
    the very ports `address` gives the near side for the far instances'
    HTTP APIs, never their KV ports."""
    from pathlib import Path

    from pdd.deploy.spec import load_spec
    from pdd.deploy.topology import address, control_ports, far_side, relay_mappings

    spec = load_spec(Path(__file__).resolve().parents[1] / "examples" / "pdd.toml")
    link = spec.links[0]
    ctl = control_ports(spec, link)
    far = far_side(spec, link)
    assert far and ctl == {address(spec, i, link.a).port for i in far}
    assert not ctl & {address(spec, i, link.a).kv_port for i in far}
    assert ctl < {lp for lp, _, _ in relay_mappings(spec, link)}
