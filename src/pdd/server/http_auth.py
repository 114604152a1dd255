"""Signed internal HTTP calls: peers prove the deployment's shared secret.

Every /internal/* request carries `X-PDD-Auth: <unix_ts>:<nonce>:<hmac>`, the
HMAC-SHA256 over ts, nonce, method and path; the secret itself never crosses
the wire. A signature older than the window, or wrong, gets a 401 and nothing
else happens.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import time

from aiohttp import web

HEADER = "X-PDD-Auth"
WINDOW_S = 120.0


def _mac(secret: bytes, ts: str, nonce: str, method: str, path: str) -> str:
    msg = f"{ts}:{nonce}:{method.upper()}:{path}".encode()
    return hmac.new(secret, msg, hashlib.sha256).hexdigest()


def sign(secret: bytes, method: str, path: str) -> dict[str, str]:
    ts, nonce = str(int(time.time())), os.urandom(8).hex()
    return {HEADER: f"{ts}:{nonce}:{_mac(secret, ts, nonce, method, path)}"}


def verify(secret: bytes, header: str | None, method: str, path: str, now: float) -> bool:
    try:
        ts, nonce, mac = (header or "").split(":")
        fresh = abs(now - int(ts)) <= WINDOW_S
    except ValueError:
        return False
    return fresh and hmac.compare_digest(mac, _mac(secret, ts, nonce, method, path))


def internal_auth_middleware(secret: bytes):
    @web.middleware
    async def middleware(request: web.Request, handler):
        if request.path.startswith("/internal/") and not verify(
            secret, request.headers.get(HEADER), request.method, request.path, time.time()
        ):
            return web.json_response(
                {"error": {"message": "unauthenticated internal call", "type": "unauthorized"}}, status=401
            )
        return await handler(request)

    return middleware


def read_secret(path: str | os.PathLike) -> bytes:
    data = open(path, "rb").read().strip()
    if not data:
        raise ValueError(f"secret file {path} is empty")
    return data
