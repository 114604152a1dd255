"""Per-purpose keys derived from the deployment's master secret (HKDF-SHA256).

The master secret (the run directory's `secret` file, or an operator's
`--secret-file`) never keys anything directly and never travels: each link
gets its own key,

    internal_http  HMAC of signed /internal/* calls (router -> instances)
    kv             challenge-response of the KV transport port
    wan_control    HMAC of signed calls to the WAN emulator's control API

so a key that leaks from one purpose (e.g. a relay that only needs the
control key) opens nothing else, and no credential on the wire can be
replayed against another port. HKDF (RFC 5869) with a fixed, public salt and
the purpose as `info`; pure standard library.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from enum import Enum

KEY_BYTES = 32
SALT = b"pdd deployment keys v1"   # public; makes our derivation domain-specific


class Purpose(Enum):
    INTERNAL_HTTP = "internal-http"
    KV = "kv-transport"
    WAN_CONTROL = "wan-control"


def hkdf_sha256(ikm: bytes, info: bytes, length: int = KEY_BYTES, salt: bytes = b"") -> bytes:
    """RFC 5869 extract-then-expand with SHA-256."""
    if length > 255 * 32:
        raise ValueError("HKDF-SHA256 output is at most 8160 bytes")
    prk = hmac.new(salt or bytes(32), ikm, hashlib.sha256).digest()
    okm, block = b"", b""
    for i in range((length + 31) // 32):
        block = hmac.new(prk, block + info + bytes([i + 1]), hashlib.sha256).digest()
        okm += block
    return okm[:length]


def as_master(secret: str | bytes) -> bytes:
    key = secret.encode() if isinstance(secret, str) else bytes(secret)
    if not key:
        raise ValueError("the deployment secret must not be empty")
    return key


def derive_key(master: str | bytes, purpose: Purpose) -> bytes:
    return hkdf_sha256(as_master(master), b"pdd/" + purpose.value.encode(), KEY_BYTES, SALT)


@dataclass(frozen=True, repr=False)
class DeploymentKeys:
    internal_http: bytes
    kv: bytes
    wan_control: bytes

    @classmethod
    def derive(cls, master: str | bytes) -> "DeploymentKeys":
        return cls(derive_key(master, Purpose.INTERNAL_HTTP), derive_key(master, Purpose.KV),
                   derive_key(master, Purpose.WAN_CONTROL))

    def __repr__(self) -> str:   # keys never end up in a log line or a traceback
        return "DeploymentKeys(<redacted>)"
