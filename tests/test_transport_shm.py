"""The same-host KV path (`pdd.transport.shm`) over real loopback sockets and
real shared-memory files: the blocks that arrive, what the socket carries,
what is left on the host afterwards, and every way it can fail."""

import asyncio
import hashlib
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from pdd.engine.kv_codec import LocalBlock, open_payload, seal_block
from pdd.transport import frames as F
from pdd.transport import shm
from pdd.transport.auth import as_secret, client_handshake
from pdd.transport.kv_receiver import KVReceiver
from pdd.transport.kv_sender import KVSender
from pdd.transport.state import TransferState
from pdd.transport.stream import FrameStream

SECRET = "s3cret"
BLOCK = 48 * 1024


class Copier:
    """Takes each block as a decoder does: its bytes copied out during on_block
    (a sealed one opened first), and whether it came through a segment."""

    def __init__(self, held=()):
        self.held = set(held)
        self.blocks: dict[int, bytes] = {}
        self.local: dict[int, bool] = {}
        self.ends = []

    def on_begin(self, request_id, meta, block_hashes):
        return set(self.held)

    def on_block(self, request_id, index, block_hash, payload):
        self.local[index] = isinstance(payload, LocalBlock)
        self.blocks[index] = bytes(open_payload(payload, index))

    def on_end(self, request_id, status):
        self.ends.append(status)


def run(coro, timeout_s=30):
    asyncio.run(asyncio.wait_for(coro, timeout_s))


def blocks_of(n, seed):
    rng = random.Random(seed)
    blocks = [rng.randbytes(BLOCK) for _ in range(n)]
    return blocks, [hashlib.blake2b(b, digest_size=16).digest() for b in blocks]


def ours(directory: Path) -> list[str]:
    return sorted(p for p in os.listdir(directory) if p.startswith(shm.PREFIX))


@pytest.fixture
def shm_dir(tmp_path):
    """A private directory stands in for /dev/shm (one on a tmpfs when the host has it)."""
    base = shm.default_dir()
    d = Path(tempfile.mkdtemp(dir=base)) if base is not None else tmp_path
    yield d
    for p in d.iterdir():
        p.unlink()
    if base is not None:
        d.rmdir()


def test_blocks_cross_through_the_segment_and_nothing_is_left(shm_dir):
    async def main():
        rec = Copier(held={0, 5})
        receiver = await KVReceiver.start("127.0.0.1", 0, SECRET, rec, shm_dir=shm_dir)
        sender = KVSender(SECRET, seal_blocks=True, shm_line="local", shm_dir=shm_dir)
        try:
            blocks, hashes = blocks_of(12, seed=1)
            sealed = {"block_digest": "sha256"}
            h = sender.send("127.0.0.1", receiver.port, "r", sealed, hashes, blocks, line="local",
                            block_bytes=BLOCK)
            st = await h.wait()
            assert st.state == TransferState.SUCCESS, st.error
            assert rec.blocks == {i: blocks[i] for i in range(12) if i not in (0, 5)}
            assert all(rec.local.values()) and len(rec.local) == 10
            # the socket carried frames, not the 10 blocks' 480 KB
            assert st.payload_bytes == 10 * BLOCK and st.bytes_sent < 8 * 1024
            assert rec.ends[0].ok and rec.ends[0].payload_bytes == 10 * BLOCK
            # the sender keeps its file for the next transfer, which reuses it
            (kept,) = ours(shm_dir)
            rec.blocks.clear()
            st = await sender.send("127.0.0.1", receiver.port, "r2", sealed, hashes[::-1], blocks[::-1],
                                   line="local", block_bytes=BLOCK).wait()
            assert st.ok and rec.blocks == {i: blocks[::-1][i] for i in range(12) if i not in (0, 5)}
            assert ours(shm_dir) == [kept] and sender.segments.num_created == 1 == sender.segments.num_reused
            # a smaller transfer in the same (larger) file: the receiver maps what it fills
            rec.blocks.clear()
            st = await sender.send("127.0.0.1", receiver.port, "r3", sealed, hashes[6:9], blocks[6:9],
                                   line="local", block_bytes=BLOCK).wait()
            assert st.ok and rec.blocks == {1: blocks[7], 2: blocks[8]} and sender.segments.num_reused == 2
            # another line (the WAN, even through a relay on this host) keeps the socket, sealed
            rec2 = Copier()
            receiver.handler = rec2
            st = await sender.send("127.0.0.1", receiver.port, "w", sealed, hashes[:3], blocks[:3], line="wan",
                                   block_bytes=BLOCK).wait()
            assert st.ok and not any(rec2.local.values()) and st.bytes_sent > 3 * BLOCK
            assert rec2.blocks == dict(enumerate(blocks[:3]))
        finally:
            await sender.close()
            await receiver.close()
        assert ours(shm_dir) == [], "a closed sender leaves no file"
    run(main())


def test_a_sealed_socket_transfer_and_a_segment_give_the_same_bytes(shm_dir):
    async def main():
        blocks, hashes = blocks_of(6, seed=2)
        got = []
        for line in ("local", "wan"):
            rec = Copier()
            receiver = await KVReceiver.start("127.0.0.1", 0, SECRET, rec, shm_dir=shm_dir)
            sender = KVSender(SECRET, seal_blocks=True, shm_line="local", shm_dir=shm_dir)
            try:
                st = await sender.send("127.0.0.1", receiver.port, "r", {}, hashes, blocks, line=line,
                                       block_bytes=BLOCK).wait()
                assert st.ok, st.error
                assert all(rec.local.values()) == (line == "local")
                got.append(rec.blocks)
            finally:
                await sender.close()
                await receiver.close()
        assert got[0] == got[1] == dict(enumerate(blocks))
    run(main())


def test_blocks_read_straight_into_the_segment(shm_dir):
    """P's copy of a finished prompt reads each block straight into its slot
    (`read_into`); `get_block` is not called on that path, and is on the
    socket's, where the same call falls back to it."""
    async def main():
        blocks, hashes = blocks_of(5, seed=5)
        calls = []

        def get(i):
            calls.append(i)
            return blocks[i]

        def into(i, out):
            out[:] = blocks[i]
        got = {}
        for line in ("local", "wan"):
            rec = Copier(held={1})
            receiver = await KVReceiver.start("127.0.0.1", 0, SECRET, rec, shm_dir=shm_dir)
            sender = KVSender(SECRET, seal_blocks=True, shm_line="local", shm_dir=shm_dir)
            try:
                st = await sender.send("127.0.0.1", receiver.port, "r", {}, hashes, get, line=line,
                                       block_bytes=BLOCK, read_into=into).wait()
                assert st.ok, st.error
                got[line] = (rec.blocks, all(rec.local.values()), list(calls))
                calls.clear()
            finally:
                await sender.close()
                await receiver.close()
        want = {i: blocks[i] for i in (0, 2, 3, 4)}
        assert got["local"] == (want, True, [])
        assert got["wan"] == (want, False, [0, 2, 3, 4])
        assert ours(shm_dir) == []
    run(main())


def test_streamed_slices_land_whole(shm_dir):
    """P's layer-by-layer stream (PART slices as P computes) goes into the
    slots as it comes; the receiver hears of a block once it is whole."""
    async def main():
        blocks, hashes = blocks_of(4, seed=3)
        step = BLOCK // 3 + 1

        async def parts(held):
            for lo in range(0, BLOCK, step):         # interleaved: every block's slice k, then k + 1
                for i in range(4):
                    if i not in held:
                        yield i, lo, BLOCK, memoryview(blocks[i])[lo:lo + step]
                yield None
        rec = Copier(held={2})
        receiver = await KVReceiver.start("127.0.0.1", 0, SECRET, rec, shm_dir=shm_dir)
        sender = KVSender(SECRET, seal_blocks=True, shm_line="local", shm_dir=shm_dir)
        try:
            st = await sender.send("127.0.0.1", receiver.port, "s", {}, hashes, None, line="local",
                                   block_bytes=BLOCK, parts=parts).wait()
            assert st.ok, st.error
            assert rec.blocks == {0: blocks[0], 1: blocks[1], 3: blocks[3]} and all(rec.local.values())
        finally:
            await sender.close()
            await receiver.close()
        assert ours(shm_dir) == []
    run(main())


def test_no_room_or_no_directory_keeps_the_socket(shm_dir, monkeypatch):
    async def main():
        blocks, hashes = blocks_of(3, seed=4)
        rec = Copier()
        receiver = await KVReceiver.start("127.0.0.1", 0, SECRET, rec, shm_dir=shm_dir)
        try:
            # a directory that would be left with less than its reserve: the socket
            monkeypatch.setattr(shm, "KEEP_FREE_FRACTION", 1.0)
            sender = KVSender(SECRET, seal_blocks=True, shm_line="local", shm_dir=shm_dir)
            st = await sender.send("127.0.0.1", receiver.port, "a", {}, hashes, blocks, line="local",
                                   block_bytes=BLOCK).wait()
            await sender.close()
            assert st.ok and not any(rec.local.values()) and st.bytes_sent > 3 * BLOCK
            assert rec.blocks == dict(enumerate(blocks))
            monkeypatch.setattr(shm, "KEEP_FREE_FRACTION", 0.10)
            # a receiver that takes no segments refuses the transfer with the reason
            receiver.shm_dir = None
            sender = KVSender(SECRET, seal_blocks=True, shm_line="local", shm_dir=shm_dir)
            st = await sender.send("127.0.0.1", receiver.port, "b", {}, hashes, blocks, line="local",
                                   block_bytes=BLOCK).wait()
            assert ours(shm_dir) == [], "the file of a failed transfer is not kept (the receiver may read it)"
            await sender.close()
            assert not st.ok and "segment" in st.error
            assert not rec.ends[-1].ok and "no shm directory" in rec.ends[-1].error
            assert ours(shm_dir) == []
        finally:
            await receiver.close()
    run(main())


async def _raw_transfer(port, frames_after_have, n=2):
    """A hand-written authenticated sender: BEGIN for n blocks, then the given
    frames; returns the receiver's answer."""
    r, w = await asyncio.open_connection("127.0.0.1", port)
    stream = FrameStream(r, w)
    await client_handshake(stream, as_secret(SECRET))
    hashes = [bytes([i]) * 16 for i in range(n)]
    stream.write(F.encode_begin("x", {}, hashes, 5.0))
    have = await stream.read_answer(5.0)
    assert isinstance(have, F.Have)
    for f in frames_after_have:
        stream.write(f if isinstance(f, bytes) else f(hashes))
    answer = await stream.read_answer(5.0)
    await stream.close(timeout_s=0.5)
    return answer


def test_the_receiver_refuses_a_segment_it_should_not_open(shm_dir, tmp_path):
    async def main():
        rec = Copier()
        receiver = await KVReceiver.start("127.0.0.1", 0, SECRET, rec, shm_dir=shm_dir)
        try:
            elsewhere = tmp_path / f"{shm.PREFIX}1-1"
            elsewhere.write_bytes(b"\0" * BLOCK)
            stranger = shm_dir / "not-ours"
            stranger.write_bytes(b"\0" * BLOCK)
            small = shm_dir / f"{shm.PREFIX}1-2"
            small.write_bytes(b"\0" * 100)
            cases = [
                ([F.encode_segment(str(elsewhere), BLOCK)], "is not a"),
                ([F.encode_segment(str(stranger), BLOCK)], "is not a"),
                ([F.encode_segment(str(shm_dir / f"{shm.PREFIX}1-9"), BLOCK)], "cannot open"),
                ([F.encode_segment(str(small), BLOCK)], "holds 100 bytes"),
                ([lambda h: F.encode_ref(0, h[0], 0, BLOCK)], "before any SEGMENT"),
            ]
            for frames, why in cases:
                answer = await _raw_transfer(receiver.port, frames)
                assert isinstance(answer, F.Error) and why in answer.message, (why, answer)
                assert not rec.ends[-1].ok and why in rec.ends[-1].error
            assert elsewhere.exists() and stranger.exists(), "files not ours are never touched"
            # a REF outside the file, or for a block the receiver holds or never announced
            for ref, why in [((0, 0, BLOCK + 1), "outside the segment"), ((5, 0, BLOCK), "unexpected block"),
                             ((0, BLOCK, BLOCK), "outside the segment")]:
                seg = shm.OutSegment.create(BLOCK, shm_dir)
                i, off, n = ref
                answer = await _raw_transfer(receiver.port, [
                    F.encode_segment(str(seg.path), BLOCK),
                    lambda h, i=i, off=off, n=n: F.encode_ref(i, h[min(i, 1)], off, n)])
                assert isinstance(answer, F.Error) and why in answer.message, (why, answer)
                seg.close()
            assert ours(shm_dir) == [small.name]
        finally:
            await receiver.close()
    run(main())


def test_a_sender_killed_mid_transfer_fails_it_and_its_file_is_swept(shm_dir):
    """A sender process on this host dies after writing some blocks: the
    receiver's transfer fails (no hang, the reason said); the files the dead
    sender made are removed by the next sender on the host."""
    code = f"""
import asyncio, hashlib, os, sys, time
from pathlib import Path
from pdd.transport.kv_sender import KVSender
from pdd.transport import shm
port, d = int(sys.argv[1]), Path(sys.argv[2])
blocks = [bytes([i]) * {BLOCK} for i in range(8)]
hashes = [hashlib.blake2b(b, digest_size=16).digest() for b in blocks]
async def main():
    s = KVSender("{SECRET}", shm_line="local", shm_dir=d)
    async def get(i):
        if i == 3:
            shm.OutSegment.create({BLOCK}, d)        # a second file nobody will open
            print("dying", flush=True)
            os._exit(9)
        return blocks[i]
    await s.send("127.0.0.1", port, "k", {{}}, hashes, get, line="local", block_bytes={BLOCK}).wait()
asyncio.run(main())
"""

    async def main():
        rec = Copier()
        receiver = await KVReceiver.start("127.0.0.1", 0, SECRET, rec, shm_dir=shm_dir, stall_timeout_s=5.0)
        try:
            proc = await asyncio.create_subprocess_exec(sys.executable, "-c", code, str(receiver.port), str(shm_dir),
                                                        stdout=subprocess.PIPE)
            out, _ = await asyncio.wait_for(proc.communicate(), 20)
            assert b"dying" in out and proc.returncode == 9
            t_end = time.monotonic() + 10
            while not rec.ends and time.monotonic() < t_end:
                await asyncio.sleep(0.05)
            (st,) = rec.ends
            assert not st.ok and "connection lost" in st.error
            assert sorted(rec.blocks) == [0, 1, 2]
            left = ours(shm_dir)
            assert len(left) == 2, left          # the sender's, and the one nobody opened
            assert shm.sweep_stale(shm_dir) == 2 and ours(shm_dir) == []
        finally:
            await receiver.close()
    run(main())


def test_a_kv_block_from_a_segment_goes_into_the_pool_without_a_seal():
    """`open_payload` opens a sealed block and passes a same-host one as is;
    a sealed block that was altered is still refused."""
    data = os.urandom(1024)
    assert open_payload(seal_block(data), 0) == data
    assert bytes(open_payload(LocalBlock(memoryview(data)), 0)) == data
    bad = bytearray(seal_block(data))
    bad[-1] ^= 1
    with pytest.raises(ValueError, match="SHA-256"):
        open_payload(bytes(bad), 3)


def test_the_deployment_file_chooses_the_same_host_path():
    """`[kv] same_host`: "shm" by default, "socket" to keep every byte on the
    loopback connection; anything else is a clear error."""
    import tomllib

    from pdd.deploy.spec import SpecError, parse_spec

    doc = tomllib.loads((Path(__file__).parent.parent / "examples" / "pdd.toml").read_text())
    assert parse_spec(dict(doc)).kv_same_host == "shm"
    assert parse_spec(dict(doc, kv={"same_host": "socket"})).kv_same_host == "socket"
    for bad, why in [({"same_host": "rdma"}, "must be"), ({"same": "shm"}, "same"), ("shm", "must be a table")]:
        with pytest.raises(SpecError, match=why):
            parse_spec(dict(doc, kv=bad))
