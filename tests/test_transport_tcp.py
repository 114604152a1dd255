"""The KV transport over real loopback sockets: integrity, HAVE, faults, deadlines."""

import asyncio
import hashlib
import os
import random
import time

from pdd.transport import frames as F
from pdd.transport.auth import client_handshake
from pdd.transport.kv_receiver import KVReceiver
from pdd.transport.kv_sender import KVSender, send_kv
from pdd.transport.state import TransferState
from pdd.transport.stream import FrameStream

SECRET = "s3cret"


class Recorder:
    """Receiver handler that records everything; `held` = indices it already has."""

    def __init__(self, held=(), block_delay_s=0.0):
        self.held = set(held)
        self.block_delay_s = block_delay_s
        self.begins, self.ends = [], []
        self.blocks: dict[str, dict[int, bytes]] = {}

    def on_begin(self, request_id, meta, block_hashes):
        self.begins.append((request_id, meta, block_hashes))
        self.blocks[request_id] = {}
        return set(self.held)

    async def on_block(self, request_id, index, block_hash, payload):
        if self.block_delay_s:
            await asyncio.sleep(self.block_delay_s)
        self.blocks[request_id][index] = payload

    def on_end(self, request_id, status):
        self.ends.append((request_id, status))


def run(coro, timeout_s=20):
    asyncio.run(asyncio.wait_for(coro, timeout_s))


def make_blocks(n, seed, size=(1_000, 120_000)):
    rng = random.Random(seed)
    blocks = [rng.randbytes(rng.randint(*size)) for _ in range(n)]
    return blocks, [hashlib.blake2b(b, digest_size=16).digest() for b in blocks]


async def wait_until(cond, timeout_s=5.0):
    t_end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < t_end, "condition not reached in time"
        await asyncio.sleep(0.01)


def test_payloads_arrive_identical():
    async def main():
        rec = Recorder()
        receiver = await KVReceiver.start("127.0.0.1", 0, SECRET, rec)
        try:
            blocks, hashes = make_blocks(64, seed=0)
            handle = send_kv("127.0.0.1", receiver.port, SECRET, "r1", {"k": 1}, hashes, blocks, deadline_s=10)
            assert handle.poll().state >= TransferState.BOOTSTRAPPING  # never blocks
            st = await handle.wait()
            assert st.state == TransferState.SUCCESS, st.error
            got = rec.blocks["r1"]
            assert [hashlib.sha256(got[i]).digest() for i in range(64)] == [hashlib.sha256(b).digest() for b in blocks]
            assert rec.begins[0][1] == {"k": 1} and rec.begins[0][2] == hashes
            (rid, rst), = rec.ends
            assert rid == "r1" and rst.ok and rst.num_blocks_sent == 64
            assert st.payload_bytes == rst.payload_bytes == sum(map(len, blocks))
            assert st.bytes_sent == rst.bytes_received > st.payload_bytes
        finally:
            await receiver.close()
    run(main())


def test_only_missing_blocks_cross():
    async def main():
        held = set(range(0, 40)) | {45}
        rec = Recorder(held=held)
        receiver = await KVReceiver.start("127.0.0.1", 0, SECRET, rec)
        try:
            blocks, hashes = make_blocks(50, seed=1, size=(10_000, 10_000))
            calls = []
            st = await send_kv("127.0.0.1", receiver.port, SECRET, "r2", {}, hashes,
                               lambda i: calls.append(i) or blocks[i], deadline_s=10).wait()
            missing = sorted(set(range(50)) - held)
            assert st.ok and sorted(calls) == missing  # get_block never called for held blocks
            assert st.num_blocks_skipped == 41 and st.num_blocks_sent == 9
            assert st.payload_bytes == 9 * 10_000
            assert st.bytes_sent < 9 * 10_000 + 2_000  # BEGIN + 9 BLOCKs + END, nothing more
            assert sorted(rec.blocks["r2"]) == missing
            assert receiver.stats.num_blocks_skipped == 41
        finally:
            await receiver.close()
    run(main())


def test_all_held_and_connection_reuse():
    async def main():
        rec = Recorder(held=range(4))
        receiver = await KVReceiver.start("127.0.0.1", 0, SECRET, rec)
        sender = KVSender(SECRET)
        try:
            blocks, hashes = make_blocks(4, seed=2)
            for i in range(3):
                st = await sender.send("127.0.0.1", receiver.port, f"r{i}", {}, hashes, blocks, 5).wait()
                assert st.ok and st.num_blocks_sent == 0 and st.num_blocks_skipped == 4
            assert sender.num_connections_opened == 1 and sender.num_connections_reused == 2
            assert receiver.stats.num_connections == 1 and len(rec.ends) == 3
        finally:
            await sender.close()
            await receiver.close()
    run(main())


def test_corrupted_frame_fails_and_receiver_keeps_serving(monkeypatch):
    import pdd.transport.kv_sender as kv_sender

    def corrupting_encode_block(index, block_hash, payload, max_frame_bytes=F.DEFAULT_MAX_FRAME_BYTES):
        data = bytearray(F.encode_block(index, block_hash, payload, max_frame_bytes))
        if index == 3:
            data[-10] ^= 0xFF  # a bit flip the CRC must catch
        return bytes(data)

    async def main():
        rec = Recorder()
        receiver = await KVReceiver.start("127.0.0.1", 0, SECRET, rec)
        try:
            blocks, hashes = make_blocks(8, seed=3, size=(5_000, 5_000))
            monkeypatch.setattr(kv_sender, "encode_block", corrupting_encode_block)
            bad = await send_kv("127.0.0.1", receiver.port, SECRET, "bad", {}, hashes, blocks, 5).wait()
            monkeypatch.setattr(kv_sender, "encode_block", F.encode_block)
            good = await send_kv("127.0.0.1", receiver.port, SECRET, "good", {}, hashes, blocks, 5).wait()
            await wait_until(lambda: len(rec.ends) == 2)
            ends = dict(rec.ends)
            assert ends["bad"].state == TransferState.FAILED and "CRC32 mismatch" in ends["bad"].error
            assert bad.state == TransferState.FAILED and "CRC32" in bad.error, bad.error
            assert good.ok and ends["good"].ok and rec.blocks["good"] == dict(enumerate(blocks))
        finally:
            await receiver.close()
    run(main())


def test_wrong_secret_and_silent_peer_are_dropped():
    async def main():
        rec = Recorder()
        receiver = await KVReceiver.start("127.0.0.1", 0, SECRET, rec, auth_timeout_s=0.3)
        try:
            blocks, hashes = make_blocks(2, seed=4)
            st = await send_kv("127.0.0.1", receiver.port, "wrong", "r", {}, hashes, blocks, 5).wait()
            assert st.state == TransferState.FAILED and "authentication" in st.error and "secret" in st.error
            reader, writer = await asyncio.open_connection("127.0.0.1", receiver.port)
            t0 = time.monotonic()
            assert await asyncio.wait_for(reader.read(), 3) == b""  # silent peer: closed by the receiver
            assert time.monotonic() - t0 < 2
            writer.close()
            await wait_until(lambda: receiver.stats.num_auth_failures == 2)
            assert rec.begins == [] and rec.ends == []
        finally:
            await receiver.close()
    run(main())


def test_deadline_on_stalled_receiver():
    async def main():
        rec = Recorder(block_delay_s=1.0)
        receiver = await KVReceiver.start("127.0.0.1", 0, SECRET, rec)
        try:
            blocks, hashes = make_blocks(40, seed=5, size=(500_000, 500_000))
            t0 = time.monotonic()
            st = await send_kv("127.0.0.1", receiver.port, SECRET, "slow", {}, hashes, blocks, deadline_s=0.5).wait()
            assert st.state == TransferState.FAILED and "deadline" in st.error
            assert 0.45 < time.monotonic() - t0 < 0.5 + 0.3
            await wait_until(lambda: rec.ends, timeout_s=3)
            assert rec.ends[0][1].state == TransferState.FAILED
        finally:
            await receiver.close()
    run(main())


def test_connection_refused():
    async def main():
        st = await send_kv("127.0.0.1", 1, SECRET, "r", {}, [b"h" * 16], [b"x"], 2).wait()
        assert st.state == TransferState.FAILED and "refused" in st.error
    run(main())


def test_receiver_dies_mid_transfer():
    async def main():
        rec = Recorder(block_delay_s=0.02)
        receiver = await KVReceiver.start("127.0.0.1", 0, SECRET, rec)
        blocks, hashes = make_blocks(200, seed=6, size=(50_000, 50_000))
        handle = send_kv("127.0.0.1", receiver.port, SECRET, "r", {}, hashes, blocks, deadline_s=10)
        await wait_until(lambda: len(rec.blocks.get("r", {})) >= 3)
        await receiver.close()
        st = await handle.wait()
        assert st.state == TransferState.FAILED and "lost" in st.error, st.error
        assert len(rec.ends) == 1 and "shutting down" in rec.ends[0][1].error
    run(main())


def test_sender_dies_or_cancels_mid_transfer():
    async def main():
        rec = Recorder(block_delay_s=0.01)
        receiver = await KVReceiver.start("127.0.0.1", 0, SECRET, rec)
        try:
            # more than the socket buffers hold, so the cancel lands before END
            hashes = [os.urandom(16) for _ in range(300)]
            blocks = [os.urandom(100_000)] * 300
            # a sender process that dies: the socket is aborted after a few blocks
            reader, writer = await asyncio.open_connection("127.0.0.1", receiver.port)
            stream = FrameStream(reader, writer)
            await client_handshake(stream, SECRET.encode())
            stream.write(F.encode_begin("dead", {}, hashes))
            assert isinstance(await stream.read_frame(2), F.Have)
            for i in range(3):
                stream.write(F.encode_block(i, hashes[i], blocks[i]))
            await stream.drain()
            stream.abort()
            # an orderly cancel
            handle = send_kv("127.0.0.1", receiver.port, SECRET, "cancelled", {}, hashes, blocks, 10)
            await wait_until(lambda: handle.poll().num_blocks_sent >= 2)
            handle.cancel("abnormal request finished on RLD")
            st = await handle.wait()
            assert st.state == TransferState.FAILED and st.cancelled and "abnormal" in st.error
            await wait_until(lambda: len(rec.ends) == 2)
            ends = dict(rec.ends)
            assert ends["dead"].state == TransferState.FAILED and "lost" in ends["dead"].error
            assert ends["cancelled"].state == TransferState.FAILED
            assert ends["cancelled"].cancelled and "abnormal" in ends["cancelled"].error
        finally:
            await receiver.close()
    run(main())


def test_rejecting_handler_fails_sender_with_reason():
    class Rejecting(Recorder):
        def on_begin(self, request_id, meta, block_hashes):
            raise RuntimeError("no free blocks")

    async def main():
        rec = Rejecting()
        receiver = await KVReceiver.start("127.0.0.1", 0, SECRET, rec)
        try:
            st = await send_kv("127.0.0.1", receiver.port, SECRET, "r", {}, [os.urandom(16)], [b"x"], 5).wait()
            assert st.state == TransferState.FAILED and "no free blocks" in st.error
            assert len(rec.ends) == 1 and not rec.ends[0][1].ok
        finally:
            await receiver.close()
    run(main())


def _sliced(blocks, held, pieces=4):
    """A PartSource: every missing block in `pieces` slices, blocks interleaved
    (slice k of every block before slice k+1 of any), as P sends a chunk's
    KV layer by layer."""
    async def parts(skip):
        assert skip == set(held)
        todo = [i for i in range(len(blocks)) if i not in skip]
        for k in range(pieces):
            for i in todo:
                b = blocks[i]
                lo, hi = len(b) * k // pieces, len(b) * (k + 1) // pieces
                await asyncio.sleep(0)
                yield i, lo, len(b), b[lo:hi]
    return parts


def test_blocks_sent_in_interleaved_slices_arrive_whole_sealed_or_not():
    from pdd.engine.kv_codec import open_block

    async def main():
        for seal in (False, True):
            rec = Recorder(held={1, 5})
            receiver = await KVReceiver.start("127.0.0.1", 0, SECRET, rec)
            sender = KVSender(SECRET, seal_blocks=seal)
            try:
                blocks, hashes = make_blocks(8, seed=3)
                h = sender.send("127.0.0.1", receiver.port, "r", {}, hashes, None, deadline_s=10,
                                parts=_sliced(blocks, {1, 5}))
                st = await h.wait()
                assert st.ok, st.error
                got = rec.blocks["r"]
                assert set(got) == set(range(8)) - {1, 5}
                for i, payload in got.items():
                    # sealed: the digest of the whole block, taken slice by slice at the sender
                    assert (open_block(payload, i) if seal else payload) == blocks[i]
                (_, rst), = rec.ends
                assert rst.ok and rst.num_blocks_sent == st.num_blocks_sent == 6
                assert st.payload_bytes == sum(len(blocks[i]) for i in got)
            finally:
                await sender.close()
                await receiver.close()
    run(main())


def test_a_slice_out_of_order_fails_the_transfer_with_its_reason():
    async def main():
        rec = Recorder()
        receiver = await KVReceiver.start("127.0.0.1", 0, SECRET, rec)
        sender = KVSender(SECRET)
        try:
            blocks, hashes = make_blocks(2, seed=4, size=(4_000, 4_000))

            async def skipping(skip):
                yield 0, 0, 4_000, blocks[0][:1_000]
                yield 0, 2_000, 4_000, blocks[0][2_000:]     # a gap: 1,000 bytes never sent
            st = await sender.send("127.0.0.1", receiver.port, "r", {}, hashes, None, deadline_s=5,
                                   parts=skipping).wait()
            assert not st.ok and "does not follow" in st.error, st.error
            (_, rst), = rec.ends
            assert not rst.ok and rec.blocks["r"] == {}
            # the receiver keeps serving: a clean transfer on a new connection
            ok = await sender.send("127.0.0.1", receiver.port, "r2", {}, hashes, blocks, deadline_s=5).wait()
            assert ok.ok and rec.blocks["r2"] == dict(enumerate(blocks))
        finally:
            await sender.close()
            await receiver.close()
    run(main())
