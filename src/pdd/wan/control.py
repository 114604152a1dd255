"""HTTP control API of a WanLink (aiohttp), on its own port.

    POST /cut       {"mode": "reset" | "blackhole"} (body optional; default reset)
    POST /restore
    POST /set       {"rate_mbps" | "rate_bytes_s", "latency_ms" | "latency_s",
                     "jitter_ms" | "jitter_s"}  (any subset; rate 0 or null: unlimited)
    GET  /stats     counters and current configuration (JSON)
    GET  /health    {"ok": true}
Every request is signed (`X-PDD-Auth`, see server/http_auth.py) with the
WAN-control key derived from the deployment secret (`pdd.keys`) for this
relay's name (`wan0`, ...), over method, path, timestamp, nonce and body;
else 401, before the body is read. Nothing that travels is a reusable token:
a captured call can be neither replayed nor re-bodied nor sent to another
relay. `WanControlClient` is the matching client for benchmarks and `pdd up`.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import ClientSession, ClientTimeout, web

from pdd.server.http_auth import sign, signed_call_middleware
from pdd.wan.relay import WanLink
from pdd.wan.shaper import MBIT_BYTES_S

DEFAULT_NAME = "wan"
MAX_BODY_BYTES = 64 * 1024   # settings are a few keys; nothing bigger is read
_UNITS = {  # JSON key -> (shaper argument, factor)
    "rate_bytes_s": ("rate_bytes_s", 1.0), "rate_mbps": ("rate_bytes_s", MBIT_BYTES_S),
    "latency_s": ("latency_s", 1.0), "latency_ms": ("latency_s", 1e-3),
    "jitter_s": ("jitter_s", 1.0), "jitter_ms": ("jitter_s", 1e-3),
}


def parse_settings(body: dict) -> dict[str, Any]:
    """JSON body of /set -> WanLink.set kwargs; ValueError on anything unknown."""
    if not isinstance(body, dict):
        raise ValueError("body must be a JSON object")
    out: dict[str, Any] = {}
    for key, value in body.items():
        if key not in _UNITS:
            raise ValueError(f"unknown setting {key!r} (known: {sorted(_UNITS)})")
        name, factor = _UNITS[key]
        if name in out:
            raise ValueError(f"{name} given twice")
        if value is None and name == "rate_bytes_s":
            out[name] = None
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
            out[name] = value * factor
        else:
            raise ValueError(f"{key} must be a number >= 0")
    return out


class ControlServer:
    """`key`: the WAN-control key (`DeploymentKeys.wan_control`); `name`: this
    relay's name, which every call must be signed for."""

    def __init__(self, link: WanLink, key: str | bytes, name: str = DEFAULT_NAME):
        if not key:
            raise ValueError("the control API needs a non-empty key")
        self.link = link
        self.name = name
        self._auth = signed_call_middleware(key.encode() if isinstance(key, str) else key, name, lambda _path: True)
        self._runner: web.AppRunner | None = None
        self.port = 0

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        app = web.Application(middlewares=[self._auth], client_max_size=MAX_BODY_BYTES)
        app.add_routes([
            web.post("/cut", self._cut), web.post("/restore", self._restore), web.post("/set", self._set),
            web.get("/stats", self._stats), web.get("/health", self._health),
        ])
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self.port

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _json(self, request: web.Request) -> dict:
        body = await request.read()   # already read (and checked) by the signature middleware
        if not body:
            return {}
        try:
            return json.loads(body)
        except ValueError:
            raise web.HTTPBadRequest(text="body is not JSON") from None

    async def _cut(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        try:
            self.link.cut(body.get("mode", "reset") if isinstance(body, dict) else "reset")
        except ValueError as e:
            return web.json_response({"error": str(e)}, status=400)
        return web.json_response(self.link.stats_dict())

    async def _restore(self, request: web.Request) -> web.Response:
        self.link.restore()
        return web.json_response(self.link.stats_dict())

    async def _set(self, request: web.Request) -> web.Response:
        try:
            self.link.set(**parse_settings(await self._json(request)))
        except ValueError as e:
            return web.json_response({"error": str(e)}, status=400)
        return web.json_response(self.link.stats_dict())

    async def _stats(self, request: web.Request) -> web.Response:
        return web.json_response(self.link.stats_dict())

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True})


class WanControlClient:
    """await client.cut(); await client.set(rate_mbps=100); await client.stats()

    `key`: the WAN-control key; `name`: the relay's name (as in ControlServer)."""

    def __init__(self, host: str, port: int, key: str | bytes, name: str = DEFAULT_NAME, timeout_s: float = 5.0):
        self.base = f"http://{host}:{port}"
        self.key = key.encode() if isinstance(key, str) else key
        self.name = name
        self.timeout = ClientTimeout(total=timeout_s)

    async def _call(self, method: str, path: str, body: dict | None = None) -> dict:
        data = b"" if body is None else json.dumps(body).encode()
        headers = sign(self.key, method, path, self.name, data)
        if data:
            headers["Content-Type"] = "application/json"
        async with ClientSession(timeout=self.timeout) as session:
            async with session.request(method, self.base + path, data=data or None, headers=headers) as resp:
                data = await resp.json()
                if resp.status != 200:
                    raise RuntimeError(f"wan control {path}: HTTP {resp.status}: {data}")
                return data

    async def cut(self, mode: str = "reset") -> dict:
        return await self._call("POST", "/cut", {"mode": mode})

    async def restore(self) -> dict:
        return await self._call("POST", "/restore")

    async def set(self, **settings: float | None) -> dict:
        return await self._call("POST", "/set", settings)

    async def stats(self) -> dict:
        return await self._call("GET", "/stats")

    async def health(self) -> dict:
        return await self._call("GET", "/health")
