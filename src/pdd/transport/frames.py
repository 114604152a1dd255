"""Sans-I/O codec of the KV transport's binary frames (no sockets, no clock).

Every frame is a 16-byte header followed by its payload:

    magic b"PDKV" | version u8 | type u8 | flags u16 (0) | length u32 | crc32 u32

`length` counts the payload only and is bounded by `max_frame_bytes`, so a
garbled header cannot make the decoder allocate gigabytes; `crc32` covers the
payload, so a corrupted frame is detected (FrameError) instead of landing as
silently wrong KV. Payloads (big-endian):

    HELLO      client nonce (16)
    CHALLENGE  server nonce (16) | server proof (32)
    AUTH       client proof (32)
    BEGIN      id len u16 | id utf8 | meta len u32 | meta JSON | deadline_s f64 | n u32 | n x hash (16)
    HAVE       n u32 | bitmap, ceil(n/8) bytes, bit i (LSB first) = receiver holds block i
    BLOCK      index u32 | hash (16) | payload
    PART       index u32 | hash (16) | offset u32 | total u32 | flags u8 | [digest (32)] | bytes
               a slice of a block's payload at `offset` (slices in order, no gaps);
               the block counts as received once `total` bytes are in. flags bit 0:
               the block's digest (a sealed block's SHA-256) comes with this slice.
               Lets P send a chunk's KV layer by layer while it computes the chunk.
    END        number of BLOCK frames u32 (sender: sent; receiver's ack: received)
               [| meta JSON: what the sender learnt while streaming, e.g. P's first token]
    ERROR      utf8 message
    CANCEL     utf8 reason
    WAIT       utf8 reason: the sender is alive with nothing to send yet (P is
               still computing the next block, or a background copy waits its
               turn on the line); it resets the receiver's stall timer, so
               "stalled" means a silent peer, not a queued one
    SEGMENT    size u64 | path utf8: a same-host transfer's blocks lie in this
               shared-memory file (`transport.shm`), sent once, after HAVE
    REF        index u32 | hash (16) | offset u64 | length u32: block `index`
               is whole in the segment at [offset, offset + length)
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Union

MAGIC = b"PDKV"
VERSION = 1
HASH_BYTES = 16
NONCE_BYTES = 16
PROOF_BYTES = 32
DEFAULT_MAX_FRAME_BYTES = 64 * 1024 * 1024
# Until the handshake completes a peer is a stranger: the largest frame it may
# declare (HELLO/CHALLENGE/AUTH are <= 48 bytes, an ERROR at most 4096), so a
# stranger cannot make us buffer a 64 MB "frame" before proving the key.
PREAUTH_MAX_FRAME_BYTES = 4096

_HEADER = struct.Struct(">4sBBHII")
HEADER_BYTES = _HEADER.size  # 16
_BLOCK_HEAD = struct.Struct(">I16s")
_PART_HEAD = struct.Struct(">I16sIIB")
_REF = struct.Struct(">I16sQI")
_SEGMENT_HEAD = struct.Struct(">Q")
DIGEST_BYTES = 32


class FrameType(IntEnum):
    HELLO = 1
    CHALLENGE = 2
    AUTH = 3
    BEGIN = 4
    HAVE = 5
    BLOCK = 6
    END = 7
    ERROR = 8
    CANCEL = 9
    PART = 10
    WAIT = 11
    SEGMENT = 12
    REF = 13


class FrameError(Exception):
    """The byte stream is not a valid frame sequence (bad magic, CRC, size, layout)."""


@dataclass
class _Frame:
    # header + payload size, set by the decoder (for byte accounting)
    wire_bytes: int = field(default=0, kw_only=True, compare=False)


@dataclass
class Hello(_Frame):
    client_nonce: bytes


@dataclass
class Challenge(_Frame):
    server_nonce: bytes
    server_proof: bytes


@dataclass
class Auth(_Frame):
    client_proof: bytes


@dataclass
class Begin(_Frame):
    request_id: str
    meta: dict
    block_hashes: list[bytes]
    deadline_s: float = 0.0  # 0: none


@dataclass
class Have(_Frame):
    num_blocks: int
    indices: set[int] = field(default_factory=set)


@dataclass
class Block(_Frame):
    index: int
    block_hash: bytes
    payload: bytes


@dataclass
class Part(_Frame):
    index: int
    block_hash: bytes
    offset: int
    total: int
    data: bytes
    digest: bytes | None = None    # the whole block's seal, if this slice carries it


@dataclass
class Segment(_Frame):
    path: str
    size: int


@dataclass
class Ref(_Frame):
    index: int
    block_hash: bytes
    offset: int
    length: int


@dataclass
class End(_Frame):
    num_blocks: int
    meta: dict = field(default_factory=dict)


@dataclass
class Error(_Frame):
    message: str


@dataclass
class Cancel(_Frame):
    reason: str


@dataclass
class Wait(_Frame):
    reason: str


Frame = Union[Hello, Challenge, Auth, Begin, Have, Block, Part, Segment, Ref, End, Error, Cancel, Wait]


def encode_frame(ftype: FrameType, payload: bytes, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> bytes:
    if len(payload) > max_frame_bytes:
        raise FrameError(f"{ftype.name} frame of {len(payload)} bytes exceeds max_frame_bytes={max_frame_bytes}")
    return _HEADER.pack(MAGIC, VERSION, ftype, 0, len(payload), zlib.crc32(payload)) + payload


def encode_hello(client_nonce: bytes) -> bytes:
    return encode_frame(FrameType.HELLO, _exact(client_nonce, NONCE_BYTES, "nonce"))


def encode_challenge(server_nonce: bytes, server_proof: bytes) -> bytes:
    payload = _exact(server_nonce, NONCE_BYTES, "nonce") + _exact(server_proof, PROOF_BYTES, "proof")
    return encode_frame(FrameType.CHALLENGE, payload)


def encode_auth(client_proof: bytes) -> bytes:
    return encode_frame(FrameType.AUTH, _exact(client_proof, PROOF_BYTES, "proof"))


def encode_begin(request_id: str, meta: dict, block_hashes: list[bytes], deadline_s: float = 0.0,
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> bytes:
    rid = request_id.encode()
    meta_bytes = json.dumps(meta, separators=(",", ":")).encode()
    for h in block_hashes:
        _exact(h, HASH_BYTES, "block hash")
    payload = b"".join([
        struct.pack(">H", len(rid)), rid, struct.pack(">I", len(meta_bytes)), meta_bytes,
        struct.pack(">dI", deadline_s, len(block_hashes)), *block_hashes,
    ])
    return encode_frame(FrameType.BEGIN, payload, max_frame_bytes)


def encode_have(num_blocks: int, indices: set[int] | list[int]) -> bytes:
    bitmap = bytearray((num_blocks + 7) // 8)
    for i in indices:
        if not 0 <= i < num_blocks:
            raise FrameError(f"HAVE index {i} out of range for {num_blocks} blocks")
        bitmap[i >> 3] |= 1 << (i & 7)
    return encode_frame(FrameType.HAVE, struct.pack(">I", num_blocks) + bytes(bitmap))


def encode_block(index: int, block_hash: bytes, payload: bytes,
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> bytes:
    head = _BLOCK_HEAD.pack(index, _exact(block_hash, HASH_BYTES, "block hash"))
    return encode_frame(FrameType.BLOCK, head + bytes(payload), max_frame_bytes)


def encode_part(index: int, block_hash: bytes, offset: int, total: int, data: bytes,
                digest: bytes | None = None, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> bytes:
    if offset < 0 or offset + len(data) > total:
        raise FrameError(f"PART of {len(data)} bytes at {offset} overruns its block of {total}")
    head = _PART_HEAD.pack(index, _exact(block_hash, HASH_BYTES, "block hash"), offset, total,
                           0 if digest is None else 1)
    seal = b"" if digest is None else _exact(digest, DIGEST_BYTES, "block digest")
    return encode_frame(FrameType.PART, head + seal + bytes(data), max_frame_bytes)


def encode_segment(path: str, size: int) -> bytes:
    if size < 0:
        raise FrameError(f"SEGMENT of {size} bytes")
    return encode_frame(FrameType.SEGMENT, _SEGMENT_HEAD.pack(size) + path.encode()[:4096])


def encode_ref(index: int, block_hash: bytes, offset: int, length: int) -> bytes:
    if offset < 0 or length < 0:
        raise FrameError(f"REF of {length} bytes at {offset}")
    return encode_frame(FrameType.REF, _REF.pack(index, _exact(block_hash, HASH_BYTES, "block hash"), offset, length))


def encode_end(num_blocks: int, meta: dict | None = None) -> bytes:
    tail = json.dumps(meta, separators=(",", ":")).encode() if meta else b""
    return encode_frame(FrameType.END, struct.pack(">I", num_blocks) + tail)


def encode_error(message: str) -> bytes:
    return encode_frame(FrameType.ERROR, message.encode()[:4096])


def encode_cancel(reason: str) -> bytes:
    return encode_frame(FrameType.CANCEL, reason.encode()[:4096])


def encode_wait(reason: str) -> bytes:
    return encode_frame(FrameType.WAIT, reason.encode()[:256])


def _exact(value: bytes, n: int, what: str) -> bytes:
    if len(value) != n:
        raise FrameError(f"{what} must be {n} bytes, got {len(value)}")
    return bytes(value)


class FrameDecoder:
    """Incremental decoder: `feed(bytes) -> list[Frame]`. After a FrameError the
    stream is out of sync for good, so every later feed raises the same error.

    `small_frames_until(kind)`: frames of at most PREAUTH_MAX_FRAME_BYTES until
    a frame of that kind has been decoded. The switch happens inside the
    decoder, frame by frame, because a legitimate sender pipelines its BEGIN
    (often > 4 KB) right behind AUTH, in the same read; the caller still
    checks the AUTH before it asks for the next frame, so a stranger gets at
    most one read's worth of bytes buffered past a bogus AUTH."""

    def __init__(self, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES):
        self.max_frame_bytes = max_frame_bytes
        self._small_until: FrameType | None = None
        self._buf = bytearray()
        self._error: FrameError | None = None
        self.num_bytes = 0  # wire bytes of complete frames decoded so far

    @property
    def num_buffered_bytes(self) -> int:
        return len(self._buf)

    def small_frames_until(self, kind: FrameType) -> None:
        self._small_until = kind

    @property
    def frame_limit_bytes(self) -> int:
        if self._small_until is None:
            return self.max_frame_bytes
        return min(self.max_frame_bytes, PREAUTH_MAX_FRAME_BYTES)

    def feed(self, data: bytes) -> list[Frame]:
        if self._error is not None:
            raise self._error
        self._buf += data
        frames: list[Frame] = []
        offset = 0
        try:
            with memoryview(self._buf) as view:
                while len(view) - offset >= HEADER_BYTES:
                    magic, version, ftype, _flags, length, crc = _HEADER.unpack_from(view, offset)
                    if magic != MAGIC:
                        raise FrameError(f"bad frame magic {bytes(magic)!r} (stream out of sync or not a PDD peer)")
                    if version != VERSION:
                        raise FrameError(f"unsupported protocol version {version} (expected {VERSION})")
                    if length > self.frame_limit_bytes:
                        when = " before authentication" if self._small_until is not None else ""
                        raise FrameError(f"frame of {length} bytes exceeds max_frame_bytes="
                                         f"{self.frame_limit_bytes}{when}")
                    end = offset + HEADER_BYTES + length
                    if len(view) < end:
                        break
                    body = view[offset + HEADER_BYTES : end]
                    try:
                        if zlib.crc32(body) != crc:
                            name = FrameType(ftype).name if ftype in FrameType._value2member_map_ else str(ftype)
                            raise FrameError(f"CRC32 mismatch in {name} frame of {length} bytes (corrupted on the wire)")
                        frame = _parse(ftype, body)
                    finally:
                        body.release()
                    if ftype == self._small_until:
                        self._small_until = None
                    frame.wire_bytes = end - offset
                    frames.append(frame)
                    self.num_bytes += end - offset
                    offset = end
        except FrameError as e:
            self._error = e
            raise
        del self._buf[:offset]
        return frames


def _parse(ftype: int, body: memoryview) -> Frame:
    try:
        kind = FrameType(ftype)
    except ValueError:
        raise FrameError(f"unknown frame type {ftype}") from None
    try:
        if kind == FrameType.BLOCK:
            index, block_hash = _BLOCK_HEAD.unpack_from(body, 0)
            return Block(index, block_hash, bytes(body[_BLOCK_HEAD.size :]))
        if kind == FrameType.PART:
            index, block_hash, offset, total, flags = _PART_HEAD.unpack_from(body, 0)
            pos = _PART_HEAD.size
            digest = None
            if flags & 1:
                digest = _exact(bytes(body[pos : pos + DIGEST_BYTES]), DIGEST_BYTES, "PART digest")
                pos += DIGEST_BYTES
            data = bytes(body[pos:])
            if offset + len(data) > total:
                raise ValueError(f"{len(data)} bytes at {offset} overrun a block of {total}")
            return Part(index, block_hash, offset, total, data, digest)
        if kind == FrameType.REF:
            if len(body) != _REF.size:
                raise ValueError(f"{len(body)} bytes, expected {_REF.size}")
            index, block_hash, offset, length = _REF.unpack_from(body, 0)
            return Ref(index, bytes(block_hash), offset, length)
        data = bytes(body)
        if kind == FrameType.SEGMENT:
            (size,) = _SEGMENT_HEAD.unpack_from(data, 0)
            return Segment(data[_SEGMENT_HEAD.size:].decode(), size)
        if kind == FrameType.HELLO:
            return Hello(_exact(data, NONCE_BYTES, "HELLO payload"))
        if kind == FrameType.CHALLENGE:
            _exact(data, NONCE_BYTES + PROOF_BYTES, "CHALLENGE payload")
            return Challenge(data[:NONCE_BYTES], data[NONCE_BYTES:])
        if kind == FrameType.AUTH:
            return Auth(_exact(data, PROOF_BYTES, "AUTH payload"))
        if kind == FrameType.BEGIN:
            return _parse_begin(data)
        if kind == FrameType.HAVE:
            (n,) = struct.unpack_from(">I", data, 0)
            bitmap = _exact(data[4:], (n + 7) // 8, "HAVE bitmap")
            return Have(n, {i for i in range(n) if bitmap[i >> 3] >> (i & 7) & 1})
        if kind == FrameType.END:
            (n,) = struct.unpack_from(">I", data, 0)
            meta = json.loads(data[4:]) if len(data) > 4 else {}
            if not isinstance(meta, dict):
                raise ValueError("END meta must be a JSON object")
            return End(n, meta)
        if kind == FrameType.ERROR:
            return Error(data.decode(errors="replace"))
        if kind == FrameType.WAIT:
            return Wait(data.decode(errors="replace"))
        return Cancel(data.decode(errors="replace"))
    except (struct.error, ValueError, UnicodeDecodeError) as e:
        raise FrameError(f"malformed {kind.name} frame: {e}") from None


def _parse_begin(data: bytes) -> Begin:
    (rid_len,) = struct.unpack_from(">H", data, 0)
    pos = 2 + rid_len
    request_id = data[2:pos].decode()
    (meta_len,) = struct.unpack_from(">I", data, pos)
    meta = json.loads(data[pos + 4 : pos + 4 + meta_len])
    if not isinstance(meta, dict):
        raise ValueError("metadata is not a JSON object")
    pos += 4 + meta_len
    deadline_s, n = struct.unpack_from(">dI", data, pos)
    pos += 12
    if len(data) - pos != n * HASH_BYTES:
        raise ValueError(f"{n} hashes announced but {len(data) - pos} bytes follow")
    hashes = [data[pos + i * HASH_BYTES : pos + (i + 1) * HASH_BYTES] for i in range(n)]
    return Begin(request_id, meta, hashes, deadline_s)
