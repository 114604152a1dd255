"""The router: the OpenAI-compatible gateway users talk to.

POST /v1/completions, /v1/chat/completions (SSE streaming or not),
GET /v1/models, /v1/requests/{id}/trace, /health, /metrics.
It tokenizes, picks the flow of the deployment's mode, turns the flow's
tokens into text (cut at stop strings) and keeps a trace per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time

import aiohttp
from aiohttp import web

from pdd.deploy.spec import DeploymentSpec, Role
from pdd.policy import PolicyConfig
from pdd.server.cluster import Cluster
from pdd.server.flows import FlowError, RequestContext, colocated_flow, new_request_id, pd_flow
from pdd.server.openai_api import ApiError, StopTrimmer, chunk, full, parse_request, usage
from pdd.server.pdd_flow import pdd_flow
from pdd.server.router_metrics import RouterMetrics
from pdd.server.trace import RequestTrace, TraceStore
from pdd.server.wire import InternalClient

log = logging.getLogger(__name__)


class RouterServer:
    def __init__(self, spec: DeploymentSpec, secret: bytes, tokenizer, model_cfg, served_model: str,
                 internal_tls: dict | None = None):
        self.spec, self.secret, self.tokenizer, self.model_cfg = spec, secret, tokenizer, model_cfg
        self.internal_tls = internal_tls or {}     # base URL -> TlsPeer (pdd.transport.tls.router_peers)
        self.served_model = served_model
        self.mode = spec.mode
        self.policy = PolicyConfig.from_dict(spec.policy)
        engines = [i.engine for i in spec.instances]
        self.block_size = engines[0].block_size
        self.kv_bytes_per_token = model_cfg.kv_bytes_per_token(4 if engines[0].dtype == "float32" else 2)
        self.max_model_len = min(e.max_model_len or model_cfg.max_position_embeddings for e in engines)
        self.max_model_len = min(self.max_model_len, model_cfg.max_position_embeddings)
        self.traces = TraceStore()
        self.metrics = RouterMetrics(self.mode)
        self.cluster: Cluster | None = None
        self.client: InternalClient | None = None
        self.app = web.Application(client_max_size=32 << 20)
        r = self.app.router
        r.add_post("/v1/completions", lambda req: self.completions(req, chat=False))
        r.add_post("/v1/chat/completions", lambda req: self.completions(req, chat=True))
        r.add_get("/v1/models", self.models)
        r.add_get("/v1/requests/{rid}/trace", self.trace)
        r.add_get("/health", self.health)
        r.add_get("/metrics", self.metrics_endpoint)
        self.app.on_startup.append(self._startup)
        self.app.on_cleanup.append(self._cleanup)

    async def _startup(self, app) -> None:
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1024))
        self.client = InternalClient(self.secret, session, tls=self.internal_tls)
        self.cluster = Cluster(self.spec, self.client, self.policy)
        await self.cluster.refresh()
        self._poller = asyncio.get_running_loop().create_task(self.cluster.poll_forever())

    async def _cleanup(self, app) -> None:
        self._poller.cancel()
        await self.client.session.close()

    # -- simple endpoints ---------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        await self.cluster.refresh()
        down = [m.spec.name for m in self.cluster.members.values() if not m.healthy]
        return web.json_response({"status": "degraded" if down else "ok", "mode": self.mode, "down": down},
                                 status=200)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.served_model, "object": "model", "created": 0, "owned_by": "pdd",
             "max_model_len": self.max_model_len}]})

    async def trace(self, request: web.Request) -> web.Response:
        t = self.traces.get(request.match_info["rid"])
        if t is None:
            return web.json_response(ApiError("no such request", 404).body(), status=404)
        return web.json_response(t.to_dict())

    async def metrics_endpoint(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4"})

    # -- generation ---------------------------------------------------------------
    def flow(self, ctx: RequestContext):
        if self.mode == "colocated":
            return colocated_flow(ctx, self.cluster, self.client)
        if self.mode == "pdd":
            return pdd_flow(ctx, self.cluster, self.client)
        p = self._least_loaded(Role.PREFILL)
        d = self._least_loaded(Role.DECODE)
        return pd_flow(ctx, self.cluster, self.client, p, d)

    def _least_loaded(self, role: Role):
        ms = [m for m in self.cluster.role(role) if m.healthy] or self.cluster.role(role)
        return min(ms, key=lambda m: (m.view.num_running + m.view.num_waiting + m.in_flight, m.spec.name))

    async def completions(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            body = json.loads(await request.text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return self._error(ApiError(f"request body is not valid JSON: {e}"))
        try:
            parsed = parse_request(body, chat, self.tokenizer, self.served_model, self.max_model_len)
        except ApiError as e:
            return self._error(e)
        rid = new_request_id()
        trace = RequestTrace(rid, self.mode, len(parsed.prompt_ids))
        self.traces.add(trace)
        ctx = RequestContext(rid, parsed.prompt_ids, parsed.sampling, trace,
                             time.monotonic() + self.spec.request_timeout_s, self.kv_bytes_per_token,
                             self.block_size)
        if parsed.stream:
            return await self._stream(request, parsed, ctx)
        text = ""
        async for delta in self._texts(ctx, parsed):
            text += delta
        if trace.error:
            return self._error(ApiError(trace.error, status=502, type_="server_error", code="upstream_failed"))
        return web.json_response(full(rid, parsed.model, chat, text, ctx.finish_reason or "stop",
                                      usage(len(ctx.prompt_ids), len(ctx.tokens), trace.cached_tokens)))

    async def _stream(self, request, parsed, ctx: RequestContext) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)

        async def send(obj: dict) -> None:
            await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")

        first = True
        try:
            async for delta in self._texts(ctx, parsed):
                await send(chunk(ctx.request_id, parsed.model, parsed.chat, delta, None, first))
                first = False
            if ctx.trace.error:
                await send(ApiError(ctx.trace.error, 502, type_="server_error", code="upstream_failed").body())
            else:
                await send(chunk(ctx.request_id, parsed.model, parsed.chat, None if parsed.chat else "",
                                 ctx.finish_reason or "stop"))
                if parsed.include_usage:
                    c = chunk(ctx.request_id, parsed.model, parsed.chat, None, None)
                    c["choices"] = []
                    c["usage"] = usage(len(ctx.prompt_ids), len(ctx.tokens), ctx.trace.cached_tokens)
                    await send(c)
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except (ConnectionResetError, asyncio.CancelledError):
            pass   # the client went away; _texts' cleanup aborted the request
        return resp

    async def _texts(self, ctx: RequestContext, parsed):
        """One text delta per token (possibly empty), cut at stop strings."""
        detok = self.tokenizer.detokenizer()
        trim = StopTrimmer(parsed.sampling.stop)
        t = ctx.trace
        try:
            async with contextlib.aclosing(self.flow(ctx)) as tokens:
                async for tok in tokens:
                    yield trim.push(detok.feed(tok))
                    if trim.stopped:
                        ctx.finish_reason = "stop"
                        break
            tail = trim.push(detok.finish(), final=True)
            if tail:
                yield tail
            t.finish_reason = ctx.finish_reason
        except FlowError as e:
            t.error = str(e)
            log.warning("request %s failed: %s; events: %s", ctx.request_id, e, t.events)
        except Exception as e:  # never leave a request hanging on a bug
            log.exception("request %s failed", ctx.request_id)
            t.error = f"internal error: {e!r}"
        finally:
            t.finished_s = time.time()
            if t.error:
                t.finish_reason = "error"
            self.metrics.observe(t)

    def _error(self, e: ApiError) -> web.Response:
        self.metrics.rejected.inc()
        return web.json_response(e.body(), status=e.status)
