"""KV blocks as bytes: the identity a peer must match, and a self-checking blob.

A transfer carries a KVManifest (model identity, layout, the token ids of the
full blocks and their chained hashes) and one payload per block. The receiver
checks the identity and re-derives every hash from the token ids, so KV from
another model, dtype or layout, or for other tokens, is refused with a clear
error instead of silently corrupting a cache.

Blob layout (export_kv / import_kv): b"PDDKV1" | u32 header length | header
JSON | payloads of the listed blocks, concatenated; the header carries a
SHA-256 of the payload bytes.

Over the KV transport blocks travel one by one, each sealed (seal_block):
the SHA-256 of its bytes, taken where the sender reads them out of its pool,
then the bytes. The receiver opens it (open_block) just before the block goes
into its own pool, so a block altered anywhere between the two pools (in
either process, or on a link whose CRC was recomputed) is refused; the
frames' CRC32 only catches accidents, and TLS only guards the wire.

Between two processes on one host a block may instead come through a
shared-memory segment (`pdd.transport.shm`): no wire lies between the pools,
and the receiver hands it over unsealed as a `LocalBlock`, a type it makes
only from a segment it mapped itself. `open_payload` takes either.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import asdict, dataclass

from pdd.engine.config import DTYPE_BYTES
from pdd.engine.hashing import hash_blocks

MAGIC = b"PDDKV1"
# A streamed copy's PART frames carry at least this much of a block (but its
# last layers), so that the frames' Python overhead stays small beside P's step.
STREAM_PART_MIN_BYTES = 64 * 1024
BLOCK_DIGEST = "sha256"          # the transfer's meta names the seal, so a receiver can insist on it
DIGEST_BYTES = 32


class KVImportError(ValueError):
    """KV bytes that do not belong to this engine (model, layout, checksum)."""


@dataclass(frozen=True)
class KVLayout:
    model_id: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.bytes_per_token

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token, every layer, in the layout's dtype."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    @property
    def layers_per_part(self) -> int:
        return layers_per_part(self.block_bytes, self.num_layers)

    @property
    def stream_slices(self) -> int:
        return stream_parts(self.block_bytes, self.num_layers)


def layers_per_part(block_bytes: int, num_layers: int) -> int:
    """Layers of one block that a streamed copy sends in one PART frame:
    enough for STREAM_PART_MIN_BYTES (a block's last layers go as soon as
    they are written, however few). One layer a frame (12 KB of a bf16
    block here) cost P's core ~45 ms of Python a 512-token chunk and copy,
    its prefill steps running 15-18% slower with two copies (RLD's and
    MD's) than with one."""
    per_layer = max(1, block_bytes // max(1, num_layers))
    return max(1, min(num_layers, -(-STREAM_PART_MIN_BYTES // per_layer)))


def stream_parts(block_bytes: int, num_layers: int) -> int:
    """How many parts a streamed block goes in (the router's and the
    simulator's model of what hides behind a step)."""
    return -(-num_layers // layers_per_part(block_bytes, num_layers))


@dataclass(frozen=True)
class KVManifest:
    layout: KVLayout
    token_ids: tuple[int, ...]     # tokens of the full blocks, in order
    block_hashes: tuple[bytes, ...]

    def to_meta(self) -> dict:
        return {"layout": asdict(self.layout), "token_ids": list(self.token_ids)}

    def prefix(self, num_blocks: int) -> "KVManifest":
        """The manifest of the first `num_blocks` blocks (a cached prefix on its own)."""
        n = max(0, min(num_blocks, len(self.block_hashes)))
        bs = self.layout.block_size
        return KVManifest(self.layout, self.token_ids[: n * bs], self.block_hashes[:n])

    @classmethod
    def from_meta(cls, meta: dict, block_hashes: list[bytes]) -> "KVManifest":
        try:
            layout = KVLayout(**meta["layout"])
            token_ids = tuple(int(t) for t in meta["token_ids"])
        except (KeyError, TypeError, ValueError) as e:
            raise KVImportError(f"malformed KV metadata: {e}") from None
        return cls(layout, token_ids, tuple(block_hashes))

    def check_against(self, local: KVLayout) -> None:
        for field in ("model_id", "dtype", "block_size", "num_layers", "num_kv_heads", "head_dim"):
            theirs, ours = getattr(self.layout, field), getattr(local, field)
            if theirs != ours:
                raise KVImportError(f"KV {field} mismatch: sender has {theirs!r}, this engine {ours!r}")
        bs = local.block_size
        if len(self.token_ids) != len(self.block_hashes) * bs:
            raise KVImportError(
                f"KV manifest covers {len(self.token_ids)} tokens but lists {len(self.block_hashes)} blocks"
            )
        expected = hash_blocks(list(self.token_ids), bs, local.model_id.encode())
        if tuple(expected) != self.block_hashes:
            raise KVImportError("KV block hashes do not match their token ids")


def encode_blob(manifest: KVManifest, indices: list[int], payloads: list[bytes]) -> bytes:
    body = b"".join(payloads)
    header = manifest.to_meta() | {
        "block_hashes": [h.hex() for h in manifest.block_hashes],
        "indices": indices,
        "sha256": hashlib.sha256(body).hexdigest(),
    }
    hb = json.dumps(header).encode()
    return MAGIC + struct.pack("<I", len(hb)) + hb + body


def decode_blob(blob: bytes, local: KVLayout) -> tuple[KVManifest, list[int], list[bytes]]:
    if len(blob) < 10 or blob[:6] != MAGIC:
        raise KVImportError("not a PDD KV blob (bad magic)")
    (hlen,) = struct.unpack("<I", blob[6:10])
    try:
        header = json.loads(blob[10 : 10 + hlen])
        hashes = [bytes.fromhex(h) for h in header["block_hashes"]]
        indices = [int(i) for i in header["indices"]]
    except (ValueError, KeyError, TypeError) as e:
        raise KVImportError(f"malformed KV blob header: {e}") from None
    manifest = KVManifest.from_meta(header, hashes)
    manifest.check_against(local)
    body = blob[10 + hlen :]
    if hashlib.sha256(body).hexdigest() != header.get("sha256"):
        raise KVImportError("KV blob checksum mismatch (corrupted payload)")
    n = local.block_bytes
    if len(body) != n * len(indices) or any(not 0 <= i < len(hashes) for i in indices):
        raise KVImportError("KV blob payload size or block indices do not match its header")
    return manifest, indices, [body[i * n : (i + 1) * n] for i in range(len(indices))]


def seal_block(payload: bytes) -> bytes:
    """digest (32) | payload."""
    return hashlib.sha256(payload).digest() + payload


class LocalBlock:
    """A block's bytes in a same-host segment the receiver mapped itself
    (`pdd.transport.shm`): nothing crossed a wire, so it carries no seal."""

    __slots__ = ("view",)

    def __init__(self, view: memoryview):
        self.view = view

    def __len__(self) -> int:
        return len(self.view)


def open_payload(payload: "bytes | LocalBlock", index: int) -> "bytes | memoryview":
    """A received block's bytes: a sealed one opened (`open_block`), a
    same-host one as it lies in its segment (copy it to keep it)."""
    if isinstance(payload, LocalBlock):
        return payload.view
    return open_block(payload, index)


def open_block(sealed: bytes, index: int) -> bytes:
    """The payload of a sealed block, or KVImportError if it does not match its digest."""
    view = memoryview(sealed)
    if len(view) < DIGEST_BYTES:
        raise KVImportError(f"KV block {index}: {len(view)} bytes, too short to carry its SHA-256")
    if hashlib.sha256(view[DIGEST_BYTES:]).digest() != view[:DIGEST_BYTES]:
        raise KVImportError(f"KV block {index} fails its end-to-end SHA-256 check (altered after the sender "
                            f"read it); refused")
    return bytes(view[DIGEST_BYTES:])
