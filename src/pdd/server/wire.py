"""Small helpers shared by the router and the instances: sampling params on
the wire, NDJSON streams, and signed internal calls."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import AsyncIterator

import aiohttp
from aiohttp import web

from pdd.engine.request import SamplingParams
from pdd.server.http_auth import sign
from pdd.transport.tls import TlsPeer


def sampling_to_dict(sp: SamplingParams) -> dict:
    return asdict(sp)


def sampling_from_dict(d: dict) -> SamplingParams:
    d = dict(d)
    d["stop"] = tuple(d.get("stop", ()))
    d["stop_token_ids"] = tuple(d.get("stop_token_ids", ()))
    return SamplingParams(**d)


class NdjsonWriter:
    """A streaming response of one JSON object per line."""

    def __init__(self, request: web.Request):
        self.request = request
        self.resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})

    async def __aenter__(self) -> "NdjsonWriter":
        await self.resp.prepare(self.request)
        return self

    async def send(self, obj: dict) -> None:
        await self.resp.write(json.dumps(obj).encode() + b"\n")

    async def __aexit__(self, *exc) -> None:
        try:
            await self.resp.write_eof()
        except (ConnectionError, RuntimeError):
            pass


class InternalClient:
    """Signed calls from the router to instances (JSON in, JSON or NDJSON out).

    tls: base URL ("http://host:port", as the cluster addresses an instance)
    -> the TLS peer there. Such calls go over https and succeed only if the
    server's certificate names that instance (the address may be the WAN
    relay's, so the name is checked, not the host)."""

    def __init__(self, secret: bytes, session: aiohttp.ClientSession, tls: dict[str, TlsPeer] | None = None):
        self.secret = secret
        self.session = session
        self.tls = dict(tls or {})

    def _url(self, base: str, path: str) -> tuple[str, dict]:
        peer = self.tls.get(base)
        if peer is None:
            return base + path, {}
        return "https" + base.removeprefix("http") + path, {"ssl": peer.context, "server_hostname": peer.name}

    async def post(self, base: str, path: str, body: dict, timeout_s: float = 30.0) -> dict:
        url, tls = self._url(base, path)
        async with self.session.post(
            url, json=body, headers=sign(self.secret, "POST", path),
            timeout=aiohttp.ClientTimeout(total=timeout_s), **tls,
        ) as r:
            data = await r.json(content_type=None)
            if r.status >= 400:
                raise InternalCallError(f"{path} -> {r.status}: {data}")
            return data

    async def get(self, base: str, path: str, timeout_s: float = 5.0) -> dict:
        url, tls = self._url(base, path)
        async with self.session.get(
            url, headers=sign(self.secret, "GET", path), timeout=aiohttp.ClientTimeout(total=timeout_s), **tls,
        ) as r:
            if r.status >= 400:
                raise InternalCallError(f"{path} -> {r.status}")
            return await r.json(content_type=None)

    async def stream(self, base: str, path: str, body: dict, timeout_s: float) -> AsyncIterator[dict]:
        """Yields NDJSON objects; the whole stream is bounded by timeout_s."""
        url, tls = self._url(base, path)
        async with self.session.post(
            url, json=body, headers=sign(self.secret, "POST", path),
            timeout=aiohttp.ClientTimeout(total=timeout_s, sock_read=timeout_s), **tls,
        ) as r:
            if r.status >= 400:
                raise InternalCallError(f"{path} -> {r.status}: {await r.text()}")
            async for line in r.content:
                if line.strip():
                    yield json.loads(line)


class InternalCallError(RuntimeError):
    pass
