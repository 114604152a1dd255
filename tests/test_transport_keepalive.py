"""A queued or busy side of a KV transfer is not a dead one (real loopback sockets).

Under overload a copy can wait long for P's next chunk or for its turn on the
line, and a receiver can hold HAVE back or take a while to import: the side
that waits sends WAIT frames, so each side's stall timeout fires only for a
peer that went silent. Each test also runs the same transfer without the
keepalive, to show the timeout it guards against is real.
"""

import asyncio
import time

from pdd.engine.kv_codec import open_block
from pdd.transport import frames as F
from pdd.transport.auth import as_secret, client_handshake
from pdd.transport.kv_receiver import KVReceiver
from pdd.transport.kv_sender import KVSender
from pdd.transport.priority import SLICE_BYTES
from pdd.transport.state import TransferState
from pdd.transport.stream import FrameStream

from test_transport_tcp import SECRET, Recorder, make_blocks, run

STALL_S = 0.6


def _late_source(blocks, pause_s):
    """A PartSource whose blocks exist only after `pause_s` (P still computing)."""
    def parts(held):
        async def gen():
            t_end = time.monotonic() + pause_s
            while time.monotonic() < t_end:
                yield None
                await asyncio.sleep(0.02)
            for i, b in enumerate(blocks):
                if i not in held:
                    yield i, 0, len(b), b
        return gen()
    return parts


def test_a_copy_waiting_for_p_longer_than_the_stall_timeout_lands():
    async def main():
        for keepalive_s, ok in ((STALL_S / 4, True), (60.0, False)):
            rec = Recorder()
            receiver = await KVReceiver.start("127.0.0.1", 0, SECRET, rec, stall_timeout_s=STALL_S)
            sender = KVSender(SECRET, keepalive_s=keepalive_s, stall_timeout_s=STALL_S)
            try:
                blocks, hashes = make_blocks(4, seed=11)
                st = await sender.send("127.0.0.1", receiver.port, "r", {}, hashes, None, deadline_s=10,
                                       parts=_late_source(blocks, 3 * STALL_S)).wait()
                if ok:
                    assert st.ok, st.error
                    assert [rec.blocks["r"][i] for i in range(4)] == blocks
                else:
                    assert st.state is TransferState.FAILED
                    (_, rst), = rec.ends
                    assert "sender stalled" in rst.error, rst.error
            finally:
                await sender.close()
                await receiver.close()
    run(main())


def test_a_background_copy_queued_behind_a_foreground_one_longer_than_the_stall_timeout_lands():
    async def main():
        for keepalive_s, ok in ((STALL_S / 4, True), (60.0, False)):
            rec = Recorder()
            receiver = await KVReceiver.start("127.0.0.1", 0, SECRET, rec, stall_timeout_s=STALL_S)
            sender = KVSender(SECRET, keepalive_s=keepalive_s, stall_timeout_s=STALL_S, seal_blocks=True)
            try:
                blocks, hashes = make_blocks(3, seed=13, size=(3 * SLICE_BYTES, 3 * SLICE_BYTES + 99))
                sender.lines.gate.enter("wan")          # a foreground transfer holds the line ...
                asyncio.get_running_loop().call_later(3 * STALL_S, sender.lines.gate.leave, "wan")   # ... this long
                st = await sender.send("127.0.0.1", receiver.port, "bg", {}, hashes, blocks, deadline_s=10,
                                       line="wan", background=True).wait()
                if ok:
                    assert st.ok, st.error
                    assert st.yielded_s > 2 * STALL_S
                    # In slices (PART frames), each in its turn; whole and sealed on arrival.
                    assert [open_block(rec.blocks["bg"][i], i) for i in range(3)] == blocks
                else:
                    assert st.state is TransferState.FAILED
                    (_, rst), = rec.ends
                    assert "sender stalled" in rst.error, rst.error
            finally:
                await asyncio.sleep(3 * STALL_S)    # the line's holder has left before the next round
                await sender.close()
                await receiver.close()
    run(main())


class SlowBegin(Recorder):
    """Holds HAVE back (a sibling copy bringing the same blocks) for `delay_s`."""

    def __init__(self, delay_s):
        super().__init__()
        self.delay_s = delay_s

    async def on_begin(self, request_id, meta, block_hashes):
        await asyncio.sleep(self.delay_s)
        return super().on_begin(request_id, meta, block_hashes)


def test_a_receiver_holding_have_back_keeps_the_sender_waiting_and_a_silent_one_fails_it():
    async def main():
        for keepalive_s, ok in ((STALL_S / 4, True), (60.0, False)):
            rec = SlowBegin(3 * STALL_S)
            receiver = await KVReceiver.start("127.0.0.1", 0, SECRET, rec, keepalive_s=keepalive_s)
            sender = KVSender(SECRET, stall_timeout_s=STALL_S)
            try:
                blocks, hashes = make_blocks(2, seed=14)
                t0 = time.monotonic()
                st = await sender.send("127.0.0.1", receiver.port, "r", {}, hashes, blocks, deadline_s=10).wait()
                if ok:
                    assert st.ok, st.error
                    assert [rec.blocks["r"][i] for i in range(2)] == blocks
                else:
                    assert st.state is TransferState.FAILED and "no HAVE" in st.error, st.error
                    assert time.monotonic() - t0 < 2 * STALL_S
            finally:
                await sender.close()
                await receiver.close()
    run(main())


def test_a_slow_receiver_keeps_the_sender_waiting_for_its_ack_and_a_silent_one_fails_it():
    """The sender has handed every block to the kernel long before a slow
    receiver (backpressure: it imports a block at a time) has read them; the
    receiver's WAITs keep the sender waiting for the END ack."""
    async def main():
        for keepalive_s, ok in ((STALL_S / 4, True), (60.0, False)):
            rec = Recorder(block_delay_s=0.4)
            receiver = await KVReceiver.start("127.0.0.1", 0, SECRET, rec, keepalive_s=keepalive_s)
            sender = KVSender(SECRET, stall_timeout_s=STALL_S)
            try:
                blocks, hashes = make_blocks(5, seed=15, size=(20_000, 20_000))
                st = await sender.send("127.0.0.1", receiver.port, "r", {}, hashes, blocks, deadline_s=20).wait()
                if ok:
                    assert st.ok, st.error
                    assert [rec.blocks["r"][i] for i in range(5)] == blocks
                else:
                    assert st.state is TransferState.FAILED and "no END ack" in st.error, st.error
            finally:
                await sender.close()
                await receiver.close()
    run(main())


def test_a_frame_trickling_in_is_progress_not_a_stall():
    """The receiver's stall clock runs between bytes, not frames: one block
    whose bytes take 3x the stall timeout to arrive (a big frame on a slow
    line) lands."""
    async def main():
        rec = Recorder()
        receiver = await KVReceiver.start("127.0.0.1", 0, SECRET, rec, stall_timeout_s=STALL_S)
        reader, writer = await asyncio.open_connection("127.0.0.1", receiver.port)
        stream = FrameStream(reader, writer)
        try:
            await client_handshake(stream, as_secret(SECRET), 5.0)
            blocks, hashes = make_blocks(1, seed=16, size=(100_000, 100_000))
            stream.write(F.encode_begin("r", {}, hashes, 10.0))
            assert isinstance(await stream.read_answer(5.0), F.Have)
            frame = F.encode_block(0, hashes[0], blocks[0])
            n = 12
            for k in range(n):
                stream.write(frame[k * len(frame) // n:(k + 1) * len(frame) // n])
                await stream.drain()
                await asyncio.sleep(3 * STALL_S / n)
            stream.write(F.encode_end(1))
            ack = await stream.read_answer(5.0)
            assert isinstance(ack, F.End) and ack.num_blocks == 1, ack
            assert rec.blocks["r"][0] == blocks[0]
        finally:
            stream.abort()
            await receiver.close()
    run(main())


def test_a_connection_closed_mid_handshake_is_tried_again_before_begin():
    """The receiver drops the first connection during the handshake (its
    auth timeout passed while our loop was busy, say): nothing of the
    transfer had reached it, so the sender connects again and the copy lands."""
    async def main():
        rec = Recorder()
        receiver = await KVReceiver.start("127.0.0.1", 0, SECRET, rec)
        dropped = []

        async def flaky(reader, writer):
            if not dropped:
                dropped.append(1)
                writer.close()          # the first connection: closed before CHALLENGE
                return
            await receiver._serve(reader, writer)

        front = await asyncio.start_server(flaky, "127.0.0.1", 0)
        port = front.sockets[0].getsockname()[1]
        sender = KVSender(SECRET)
        try:
            blocks, hashes = make_blocks(3, seed=17)
            st = await sender.send("127.0.0.1", port, "r", {}, hashes, blocks, deadline_s=10).wait()
            assert st.ok, st.error
            assert dropped and sender.num_bootstrap_retries == 1
            assert [rec.blocks["r"][i] for i in range(3)] == blocks
        finally:
            await sender.close()
            front.close()
            await receiver.close()
    run(main())
