"""A tiny fake OpenAI-compatible streaming server, and a fake Deployment on it.

For tests of the client and the runner without a model: it streams one SSE
chunk per token at a configurable pace, can fail, stall or cut a stream, keeps
a block prefix cache so `cached_tokens` is realistic, and answers the
router's `GET /v1/requests/{id}/trace` endpoint. It runs on its own event
loop in a background thread, so synchronous code can use it.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path


@dataclass(frozen=True)
class FakeBehaviour:
    first_token_delay_s: float = 0.0
    token_delay_s: float = 0.0
    stall_after_tokens: int | None = None   # then stall until stop() (the client must time out)
    cut_after_tokens: int | None = None     # then close the stream without [DONE]
    fail_status: int | None = None          # answer this HTTP status instead
    tokens_per_chunk: int = 1
    with_usage: bool = True
    serve_trace: bool = True                # False: the trace endpoint answers 404
    block_size: int = 16
    trace_facts: dict = field(default_factory=dict)  # merged into every trace


class FakeOpenAIServer:
    def __init__(self, behaviour: FakeBehaviour | None = None) -> None:
        self.behaviour = behaviour or FakeBehaviour()
        self.bodies: list[dict] = []          # every completion request received
        self.traces: dict[str, dict] = {}
        self._cache: set[tuple[int, ...]] = set()
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner = None
        self._closing: asyncio.Event | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def _cached_tokens(self, prompt: list[int]) -> int:
        bs = self.behaviour.block_size
        hit, matching = 0, True
        for b in range(len(prompt) // bs):
            key = tuple(prompt[:(b + 1) * bs])
            if matching and key in self._cache and (b + 1) * bs < len(prompt):
                hit = (b + 1) * bs
            else:
                matching = False
            self._cache.add(key)
        return hit

    async def _completions(self, request):
        from aiohttp import web

        body = await request.json()
        self.bodies.append(body)
        bh = self.behaviour
        if bh.fail_status:
            return web.json_response({"error": {"message": "fake failure"}}, status=bh.fail_status)
        cid = f"cmpl-{next(self._ids)}"
        prompt = body["prompt"]
        cached = self._cached_tokens(prompt)
        n = int(body["max_tokens"])
        self.traces[cid] = {"cached_tokens": cached, "uncached_kv_bytes": (len(prompt) - cached) * 100,
                            "wan_bytes": (len(prompt) - cached) * 100, **bh.trace_facts}
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        async def send(obj) -> None:
            await resp.write(f"data: {json.dumps(obj) if not isinstance(obj, str) else obj}\n\n".encode())

        await asyncio.sleep(bh.first_token_delay_s)
        sent = 0
        while sent < n:
            if bh.stall_after_tokens is not None and sent >= bh.stall_after_tokens:
                await self._closing.wait()
                return resp
            if bh.cut_after_tokens is not None and sent >= bh.cut_after_tokens:
                return resp
            k = min(bh.tokens_per_chunk, n - sent)
            sent += k
            choice = {"index": 0, "text": " t" * k, "logprobs": None,
                      "finish_reason": "length" if sent == n else None}
            if body.get("return_token_ids"):   # ids of its own: 5000 + prompt length + position
                choice["token_ids"] = [5000 + len(prompt) + i for i in range(sent - k, sent)]
            await send({"id": cid, "object": "text_completion", "choices": [choice]})
            if sent < n:
                await asyncio.sleep(bh.token_delay_s)
        if bh.with_usage:
            await send({"id": cid, "object": "text_completion", "choices": [], "usage": {
                "prompt_tokens": len(prompt), "completion_tokens": n,
                "total_tokens": len(prompt) + n, "prompt_tokens_details": {"cached_tokens": cached}}})
        await send("[DONE]")
        return resp

    async def _trace(self, request):
        from aiohttp import web

        cid = request.match_info["cid"]
        if not self.behaviour.serve_trace or cid not in self.traces:
            return web.json_response({"error": "unknown request"}, status=404)
        return web.json_response(self.traces[cid])

    async def _models(self, request):
        from aiohttp import web

        return web.json_response({"object": "list", "data": [{"id": "fake-model"}]})

    async def _serve(self, ready: threading.Event) -> None:
        from aiohttp import web

        self._closing = asyncio.Event()
        app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/requests/{cid}/trace", self._trace)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        ready.set()

    def start(self) -> "FakeOpenAIServer":
        ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._serve(ready), self._loop)
        if not ready.wait(10):
            raise RuntimeError("fake server did not start")
        return self

    def stop(self) -> None:
        if self._loop is None:
            return
        async def close() -> None:
            self._closing.set()   # releases stalled handlers
            await asyncio.sleep(0.05)
            await self._runner.cleanup()

        fut = asyncio.run_coroutine_threadsafe(close(), self._loop)
        try:
            fut.result(5)
        except Exception:  # noqa: BLE001 - stalled handlers may be cancelled noisily
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop = None


class FakeDeployment:
    """Duck-types pdd.deploy.launcher.Deployment on a FakeOpenAIServer."""

    def __init__(self, config_path, overrides=None, run_dir=None,
                 behaviour: FakeBehaviour | None = None, cost_per_hour: float = 10.0) -> None:
        self.name = Path(config_path).stem
        self.overrides = overrides
        self.cost_per_hour = cost_per_hour
        self.server = FakeOpenAIServer(behaviour).start()
        self.router_url = self.server.url

    @classmethod
    def factory(cls, behaviour: FakeBehaviour | None = None, **per_name: FakeBehaviour):
        """A `Deployment.start`-like callable; `per_name` overrides the behaviour by file stem."""
        def start(config_path, overrides=None, run_dir=None):
            bh = per_name.get(Path(config_path).stem, behaviour)
            if overrides and bh is not None:
                bh = replace(bh, trace_facts={**bh.trace_facts, "overrides": overrides})
            return cls(config_path, overrides, run_dir, bh)
        return start

    def stop(self) -> None:
        self.server.stop()
