"""Shared-secret challenge-response, mutual, the secret never on the wire.

    client -> HELLO(client_nonce)
    server -> CHALLENGE(server_nonce, HMAC(secret, "pdd-server" | client_nonce | server_nonce))
    client checks the server's proof (a wrong-secret receiver is refused too)
    client -> AUTH(HMAC(secret, "pdd-client" | server_nonce | client_nonce))
The labels differ per role so a proof cannot be reflected back. Fresh random
nonces on both sides defeat replay. The server drops a peer whose proof is
wrong or who does not finish within `timeout_s`, and counts the attempt.
`secret` is the KV purpose key derived from the deployment secret
(`pdd.keys`), never the master secret itself.

Pre-authentication limits: during the handshake both sides accept frames of
at most PREAUTH_MAX_FRAME_BYTES (a larger declared length is refused from the
16-byte header, before any payload is buffered); the full limit applies only
from the frame after the peer's last handshake frame (FrameDecoder). The
receiver also caps how many strangers may be mid-handshake at once
(kv_receiver.py), and the whole exchange has `timeout_s`.
The pure functions here take no I/O; the two coroutines drive a FrameStream.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os

from pdd.transport.frames import (
    NONCE_BYTES, Auth, Challenge, FrameType, Hello, encode_auth, encode_challenge, encode_hello,
)
from pdd.transport.stream import FrameStream

DEFAULT_AUTH_TIMEOUT_S = 5.0


class AuthError(Exception):
    pass


def as_secret(secret: str | bytes) -> bytes:
    key = secret.encode() if isinstance(secret, str) else bytes(secret)
    if not key:
        raise ValueError("the shared secret must not be empty")
    return key


def make_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def server_proof(secret: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    return hmac.new(secret, b"pdd-server" + client_nonce + server_nonce, hashlib.sha256).digest()


def client_proof(secret: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(secret, b"pdd-client" + server_nonce + client_nonce, hashlib.sha256).digest()


async def client_handshake(stream: FrameStream, secret: bytes, timeout_s: float = DEFAULT_AUTH_TIMEOUT_S) -> None:
    """Raises AuthError (wrong secret on either side, or protocol mix-up),
    TimeoutError, ConnectionError, FrameError."""
    stream.decoder.small_frames_until(FrameType.CHALLENGE)   # a stranger's reply is small too
    client_nonce = make_nonce()
    stream.write(encode_hello(client_nonce))
    frame = await stream.read_frame(timeout_s)
    if not isinstance(frame, Challenge):
        raise AuthError(f"expected CHALLENGE from receiver, got {type(frame).__name__}: {frame}")
    expected = server_proof(secret, client_nonce, frame.server_nonce)
    if not hmac.compare_digest(expected, frame.server_proof):
        raise AuthError("receiver failed authentication (its proof does not match: wrong shared secret?)")
    stream.write(encode_auth(client_proof(secret, frame.server_nonce, client_nonce)))


async def server_handshake(stream: FrameStream, secret: bytes, timeout_s: float = DEFAULT_AUTH_TIMEOUT_S) -> None:
    """The whole exchange must finish within timeout_s. Raises AuthError,
    TimeoutError, ConnectionError, FrameError; the caller drops the connection."""
    stream.decoder.small_frames_until(FrameType.AUTH)
    async with asyncio.timeout(timeout_s):
        hello = await stream.read_frame(None)
        if not isinstance(hello, Hello):
            raise AuthError(f"expected HELLO, got {type(hello).__name__}")
        server_nonce = make_nonce()
        stream.write(encode_challenge(server_nonce, server_proof(secret, hello.client_nonce, server_nonce)))
        frame = await stream.read_frame(None)
        if not isinstance(frame, Auth):
            raise AuthError(f"expected AUTH, got {type(frame).__name__}")
        expected = client_proof(secret, server_nonce, hello.client_nonce)
        if not hmac.compare_digest(expected, frame.client_proof):
            raise AuthError("sender failed authentication (wrong shared secret?)")
