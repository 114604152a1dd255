"""Small helpers shared by the router and the instances: sampling params on
the wire, NDJSON streams, and signed internal calls."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import AsyncIterator, Mapping

import aiohttp
from aiohttp import web

from pdd.deploy.spec import DeploymentSpec
from pdd.deploy.topology import address
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

    Each call is signed for its target instance (see http_auth.py); `targets`
    maps a base URL, as the router reaches the instance (directly or through
    the WAN relay), to that instance's name, so callers just pass the URL.

    tls: base URL ("http://host:port", as the cluster addresses an instance)
    -> the TLS peer there. Such calls go over https and succeed only if the
    server's certificate names that instance (the address may be the WAN
    relay's, so the name is checked, not the host).
    """

    def __init__(self, key: bytes, session: aiohttp.ClientSession, targets: Mapping[str, str],
                 tls: Mapping[str, TlsPeer] | None = None):
        self.key = key
        self.session = session
        self.targets = dict(targets)
        self.tls = dict(tls or {})

    @classmethod
    def for_deployment(cls, spec: DeploymentSpec, key: bytes, session: aiohttp.ClientSession,
                       from_dc: str, tls: Mapping[str, TlsPeer] | None = None) -> "InternalClient":
        return cls(key, session, {address(spec, i, from_dc).url: i.name for i in spec.instances}, tls=tls)

    def _signed(self, method: str, base: str, path: str, body: bytes = b"") -> dict[str, str]:
        target = self.targets.get(base)
        if target is None:
            raise InternalCallError(f"no instance is known at {base} (cannot sign a call for it)")
        headers = sign(self.key, method, path, target, body)
        if body:
            headers["Content-Type"] = "application/json"
        return headers

    def _url(self, base: str, path: str) -> tuple[str, dict]:
        peer = self.tls.get(base)
        if peer is None:
            return base + path, {}
        return "https" + base.removeprefix("http") + path, {"ssl": peer.context, "server_hostname": peer.name}

    async def post(self, base: str, path: str, body: dict, timeout_s: float = 30.0) -> dict:
        data = json.dumps(body).encode()   # the exact bytes the signature's digest covers
        url, tls = self._url(base, path)
        async with self.session.post(
            url, data=data, headers=self._signed("POST", base, path, data),
            timeout=aiohttp.ClientTimeout(total=timeout_s), **tls,
        ) as r:
            data = await r.json(content_type=None)
            if r.status >= 400:
                raise InternalCallError(f"{path} -> {r.status}: {data}")
            return data

    async def get(self, base: str, path: str, timeout_s: float = 5.0) -> dict:
        url, tls = self._url(base, path)
        async with self.session.get(
            url, headers=self._signed("GET", base, path), timeout=aiohttp.ClientTimeout(total=timeout_s), **tls,
        ) as r:
            if r.status >= 400:
                raise InternalCallError(f"{path} -> {r.status}")
            return await r.json(content_type=None)

    async def stream(self, base: str, path: str, body: dict, timeout_s: float) -> AsyncIterator[dict]:
        """Yields NDJSON objects; the whole stream is bounded by timeout_s."""
        data = json.dumps(body).encode()
        url, tls = self._url(base, path)
        async with self.session.post(
            url, data=data, headers=self._signed("POST", base, path, data),
            timeout=aiohttp.ClientTimeout(total=timeout_s, sock_read=timeout_s), **tls,
        ) as r:
            if r.status >= 400:
                raise InternalCallError(f"{path} -> {r.status}: {await r.text()}")
            async for line in r.content:
                if line.strip():
                    yield json.loads(line)


class InternalCallError(RuntimeError):
    pass
