import os
import random
import zlib

import pytest

from pdd.transport import frames as F


def _hashes(n):
    return [os.urandom(16) for _ in range(n)]


def test_roundtrip_every_frame_type_fed_byte_by_byte():
    hashes = _hashes(5)
    wire = b"".join([
        F.encode_hello(b"n" * 16),
        F.encode_challenge(b"s" * 16, b"p" * 32),
        F.encode_auth(b"a" * 32),
        F.encode_begin("req-1", {"model": "m", "n": 3}, hashes, deadline_s=2.5),
        F.encode_have(11, {0, 3, 10}),
        F.encode_block(7, hashes[2], b"payload"),
        F.encode_end(4),
        F.encode_error("boom"),
        F.encode_cancel("why"),
        F.encode_segment("/dev/shm/pdd-kv-1-2", 3 << 33),
        F.encode_ref(9, hashes[4], 5 << 32, 368640),
    ])
    dec = F.FrameDecoder()
    out = []
    for i in range(len(wire)):
        out += dec.feed(wire[i : i + 1])
    assert [type(f).__name__ for f in out] == ["Hello", "Challenge", "Auth", "Begin", "Have", "Block", "End", "Error",
                                               "Cancel", "Segment", "Ref"]
    assert out[3] == F.Begin("req-1", {"model": "m", "n": 3}, hashes, 2.5)
    assert out[4].indices == {0, 3, 10} and out[4].num_blocks == 11
    assert out[5] == F.Block(7, hashes[2], b"payload")
    assert out[6].num_blocks == 4 and out[7].message == "boom" and out[8].reason == "why"
    assert out[9] == F.Segment("/dev/shm/pdd-kv-1-2", 3 << 33)      # sizes and offsets past 4 GB
    assert out[10] == F.Ref(9, hashes[4], 5 << 32, 368640)
    assert sum(f.wire_bytes for f in out) == len(wire) == dec.num_bytes
    assert dec.num_buffered_bytes == 0


def test_random_chunking_preserves_large_payloads():
    rng = random.Random(1)
    payloads = [rng.randbytes(rng.randint(0, 300_000)) for _ in range(8)]
    hashes = _hashes(len(payloads))
    wire = b"".join(F.encode_block(i, hashes[i], p) for i, p in enumerate(payloads))
    dec, out, pos = F.FrameDecoder(), [], 0
    while pos < len(wire):
        step = rng.randint(1, 200_000)
        out += dec.feed(wire[pos : pos + step])
        pos += step
    assert [b.payload for b in out] == payloads


def test_corrupted_payload_fails_crc_and_stays_failed():
    frame = bytearray(F.encode_block(0, b"h" * 16, b"x" * 1000))
    frame[F.HEADER_BYTES + 500] ^= 0x01
    dec = F.FrameDecoder()
    with pytest.raises(F.FrameError, match="CRC32 mismatch in BLOCK"):
        dec.feed(bytes(frame))
    with pytest.raises(F.FrameError):
        dec.feed(F.encode_end(0))


def test_bad_magic_version_and_size_bound():
    with pytest.raises(F.FrameError, match="magic"):
        F.FrameDecoder().feed(b"GET / HTTP/1.1\r\n\r\n")
    bad_version = bytearray(F.encode_end(1))
    bad_version[4] = 99
    with pytest.raises(F.FrameError, match="version"):
        F.FrameDecoder().feed(bytes(bad_version))
    with pytest.raises(F.FrameError, match="max_frame_bytes"):
        F.FrameDecoder(max_frame_bytes=1000).feed(F.encode_block(0, b"h" * 16, b"x" * 2000))
    with pytest.raises(F.FrameError, match="max_frame_bytes"):
        F.encode_block(0, b"h" * 16, b"x" * 2000, max_frame_bytes=1000)


def test_malformed_payload_with_valid_crc():
    payload = b"\x00\x01"  # a HAVE frame cut short
    raw = F._HEADER.pack(F.MAGIC, F.VERSION, F.FrameType.HAVE, 0, len(payload), zlib.crc32(payload)) + payload
    with pytest.raises(F.FrameError, match="malformed HAVE"):
        F.FrameDecoder().feed(raw)
    with pytest.raises(F.FrameError, match="16 bytes"):
        F.encode_begin("r", {}, [b"short"])
    for kind, body in [(F.FrameType.REF, b"\x00" * 31), (F.FrameType.SEGMENT, b"\x00" * 3)]:
        raw = F._HEADER.pack(F.MAGIC, F.VERSION, kind, 0, len(body), zlib.crc32(body)) + body
        with pytest.raises(F.FrameError, match=f"malformed {kind.name}"):
            F.FrameDecoder().feed(raw)


def test_part_frames_carry_a_slice_and_optionally_the_blocks_digest():
    h = bytes(range(16))
    plain = F.FrameDecoder().feed(F.encode_part(3, h, 100, 400, b"x" * 50))
    assert plain == [F.Part(3, h, 100, 400, b"x" * 50, None)]
    digest = bytes(32 * [7])
    (sealed,) = F.FrameDecoder().feed(F.encode_part(3, h, 350, 400, b"y" * 50, digest))
    assert sealed.digest == digest and sealed.data == b"y" * 50 and sealed.offset == 350
    with pytest.raises(F.FrameError, match="overruns"):
        F.encode_part(0, h, 390, 400, b"z" * 20)
    # a slice past its block's end is refused on decode too (a forged length)
    bad = bytearray(F.encode_part(0, h, 0, 400, b"z" * 20))
    bad[36:40] = (395).to_bytes(4, "big")          # header 16 | index 4 | hash 16 | offset: 395 + 20 > 400
    bad[12:16] = zlib.crc32(bytes(bad[16:])).to_bytes(4, "big")
    with pytest.raises(F.FrameError, match="overrun"):
        F.FrameDecoder().feed(bytes(bad))
