"""Signed HTTP calls between the parts of a deployment.

Every protected request carries

    X-PDD-Auth: v1:<ts_ms>:<nonce>:<sha256(body) hex>:<mac hex>

where mac = HMAC-SHA256(key, "pdd-http-v1" | METHOD | path?query | TARGET | ts_ms |
nonce | body digest), the key being the purpose's derived key (`pdd.keys`),
never the master secret, and TARGET the name of the instance the call is meant
for. The receiver puts its *own* name in that message, so a header captured
on its way to p0 is worthless on md0. It then checks, in this order:

1. header well formed, timestamp within WINDOW_S of its clock, MAC right:
   all from the headers alone, so an unauthenticated request is refused
   before a byte of its body is read (no pre-auth memory);
2. the nonce was not seen within the window (`ReplayCache`): a captured
   header works once, and the original already used it;
3. only now the body is read (up to the app's client_max_size) and its
   SHA-256 must equal the signed digest: a captured header cannot carry
   another body.

Any failure is a 401 naming the reason; nothing else happens.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import time
from dataclasses import dataclass
from enum import Enum
from typing import Callable

from aiohttp import web

from pdd.server.replay_cache import DEFAULT_MAX_ENTRIES, ReplayCache

log = logging.getLogger(__name__)

HEADER = "X-PDD-Auth"
VERSION = "v1"
WINDOW_S = 120.0       # clock skew between hosts plus a slow request's queueing
_FORMAT = re.compile(r"v1:(\d{1,16}):([0-9a-f]{32}):([0-9a-f]{64}):([0-9a-f]{64})")


class Refusal(Enum):
    MALFORMED = "missing or malformed signature"
    STALE = "signature timestamp outside the validity window"
    BAD_MAC = "bad signature (wrong key, target, method, path or body digest)"
    REPLAYED = "signature already used (replay)"
    BODY_MISMATCH = "body does not match the signed digest"


@dataclass(frozen=True)
class SignedHeader:
    ts_ms: int
    nonce: str
    body_sha256: str
    mac: str


def body_digest(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


def _mac(key: bytes, method: str, path: str, target: str, ts_ms: int, nonce: str, digest: str) -> str:
    msg = "\n".join(["pdd-http-v1", method.upper(), path, target, str(ts_ms), nonce, digest]).encode()
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


def sign(key: bytes, method: str, path: str, target: str, body: bytes = b"",
         now: float | None = None) -> dict[str, str]:
    """Headers for one call of `method path` (path with its query, if any) to
    the instance named `target`, carrying exactly `body`."""
    ts_ms = int((time.time() if now is None else now) * 1000)
    nonce, digest = os.urandom(16).hex(), body_digest(body)
    return {HEADER: f"{VERSION}:{ts_ms}:{nonce}:{digest}:{_mac(key, method, path, target, ts_ms, nonce, digest)}"}


def parse(header: str | None) -> SignedHeader | None:
    m = _FORMAT.fullmatch(header or "")
    return SignedHeader(int(m[1]), m[2], m[3], m[4]) if m else None


def check_header(key: bytes, me: str, header: str | None, method: str, path: str,
                 now: float) -> SignedHeader | Refusal:
    """Step 1 (pure): the header alone, checked against the receiver's own name."""
    signed = parse(header)
    if signed is None:
        return Refusal.MALFORMED
    if abs(now - signed.ts_ms / 1000) > WINDOW_S:
        return Refusal.STALE
    expected = _mac(key, method, path, me, signed.ts_ms, signed.nonce, signed.body_sha256)
    if not hmac.compare_digest(expected, signed.mac):
        return Refusal.BAD_MAC
    return signed


class SignatureChecker:
    """Steps 1 and 2 with this receiver's replay cache; step 3 needs the body."""

    def __init__(self, key: bytes, me: str, max_entries: int = DEFAULT_MAX_ENTRIES):
        if not key or not me:
            raise ValueError("a signature checker needs a key and the receiver's name")
        self.key, self.me = key, me
        self.replays = ReplayCache(WINDOW_S, max_entries)

    def check(self, header: str | None, method: str, path: str, now: float) -> SignedHeader | Refusal:
        signed = check_header(self.key, self.me, header, method, path, now)
        if isinstance(signed, Refusal):
            return signed
        if not self.replays.accept(signed.nonce, signed.ts_ms / 1000, now):
            return Refusal.REPLAYED
        return signed


def signed_call_middleware(key: bytes, me: str, protects: Callable[[str], bool],
                           clock: Callable[[], float] = time.time):
    """aiohttp middleware: requests whose path `protects` must be signed for `me`."""
    checker = SignatureChecker(key, me)

    @web.middleware
    async def middleware(request: web.Request, handler):
        if not protects(request.path):
            return await handler(request)
        signed = checker.check(request.headers.get(HEADER), request.method, request.raw_path, clock())
        if not isinstance(signed, Refusal):
            body = await request.read()   # cached: the handler's request.json() reuses it
            if hmac.compare_digest(body_digest(body), signed.body_sha256):
                return await handler(request)
            signed = Refusal.BODY_MISMATCH
        log.warning("%s: refused %s %s from %s: %s", me, request.method, request.path, request.remote, signed.value)
        return web.json_response({"error": {"message": f"unauthenticated call: {signed.value}",
                                            "type": "unauthorized"}}, status=401)

    return middleware


def internal_auth_middleware(key: bytes, me: str):
    """The instances' form: /internal/* is signed, /health and /metrics are public."""
    return signed_call_middleware(key, me, lambda path: path.startswith("/internal/"))


def read_secret(path: str | os.PathLike) -> bytes:
    with open(path, "rb") as f:
        data = f.read().strip()
    if not data:
        raise ValueError(f"secret file {path} is empty")
    return data
