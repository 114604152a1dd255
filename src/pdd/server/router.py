"""The router: the OpenAI-compatible gateway users talk to.

POST /v1/completions, /v1/chat/completions (SSE streaming or not),
GET /v1/models, /v1/requests/{id}/trace, /health, /metrics.
It tokenizes, picks the flow of the deployment's mode, turns the flow's
tokens into text (cut at stop strings) and keeps a trace per request.

Every answer that is not a success is OpenAI-style JSON: bad input is a 4xx
(ApiError) and is refused before any instance is asked; a missing or wrong
API key (when keys are configured) a 401. /health is 503 while some role has
no live instance, so a load balancer can take the router out.
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
from pdd.keys import DeploymentKeys
from pdd.policy import PolicyConfig
from pdd.server.api_keys import ApiKeys
from pdd.server.cluster import Cluster
from pdd.server.flows import FlowError, RequestContext, choose_pd, colocated_flow, new_request_id, pd_flow
from pdd.server.openai_api import ApiError, StopTrimmer, chunk, decode_body, full, parse_request, usage
from pdd.server.pdd_flow import pdd_flow
from pdd.server.router_metrics import RouterMetrics
from pdd.server.trace import RequestTrace, TraceStore
from pdd.server.wire import InternalClient

log = logging.getLogger(__name__)


class RouterServer:
    def __init__(self, spec: DeploymentSpec, secret: bytes, tokenizer, model_cfg, served_model: str,
                 api_keys: ApiKeys | None = None, internal_tls: dict | None = None):
        self.spec, self.tokenizer, self.model_cfg = spec, tokenizer, model_cfg
        self.keys = DeploymentKeys.derive(secret)   # per purpose; the master secret is not kept
        self.internal_tls = internal_tls or {}     # base URL -> TlsPeer (pdd.transport.tls.router_peers)
        self.served_model = served_model
        self.mode = spec.mode
        self.policy = PolicyConfig.from_dict(spec.policy)
        engines = [i.engine for i in spec.instances]
        self.block_size = engines[0].block_size
        self.kv_bytes_per_token = model_cfg.kv_bytes_per_token(engines[0].dtype_bytes)
        self.max_model_len = min(e.max_model_len or model_cfg.max_position_embeddings for e in engines)
        self.max_model_len = min(self.max_model_len, model_cfg.max_position_embeddings)
        # A request whose prompt + completion cannot fit an instance's whole
        # KV pool would fail there (a 502); refuse it here as a 400 instead.
        self.max_model_len = min([self.max_model_len] + [e.num_blocks * e.block_size for e in engines])
        self.api_keys = api_keys or ApiKeys()
        self.traces = TraceStore(spec.router_max_traces)
        self.metrics = RouterMetrics(self.mode)
        self.cluster: Cluster | None = None
        self.client: InternalClient | None = None
        self.app = web.Application(client_max_size=32 << 20, middlewares=[self._guard])
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
        self.client = InternalClient.for_deployment(
            self.spec, self.keys.internal_http, session, self.spec.router_datacenter, tls=self.internal_tls)
        self.cluster = Cluster(self.spec, self.client, self.policy)
        await self.cluster.refresh()
        self._poller = asyncio.get_running_loop().create_task(self.cluster.poll_forever())

    async def _cleanup(self, app) -> None:
        self._poller.cancel()
        await self.client.session.close()

    @web.middleware
    async def _guard(self, request: web.Request, handler) -> web.StreamResponse:
        """API keys first; then every error, aiohttp's own included, as OpenAI-style JSON."""
        if not self.api_keys.allows(request.path, request.headers.get("Authorization")):
            return self._error(ApiError("Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                                        status=401, code="invalid_api_key"),
                               headers={"WWW-Authenticate": "Bearer"})
        try:
            return await handler(request)
        except ApiError as e:
            return self._error(e)
        except web.HTTPException as e:   # unknown path, wrong method, body over the size limit
            if e.status < 400:
                raise
            return self._error(ApiError(f"{e.reason}: {request.method} {request.path[:200]}", e.status,
                                        type_="invalid_request_error" if e.status < 500 else "server_error"),
                               headers={k: v for k, v in e.headers.items() if k == "Allow"})
        except Exception as e:   # a bug: still JSON, and logged
            log.exception("%s %s failed", request.method, request.path[:200])
            return self._error(ApiError(f"internal error: {e!r}", 500, type_="server_error"))

    # -- simple endpoints ---------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        await self.cluster.refresh()
        body, status = health_report(self.cluster, self.mode)
        return web.json_response(body, status=status)

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
        counts = {n: m.in_flight for n, m in self.cluster.members.items()} if self.cluster else {}
        return web.Response(body=self.metrics.render(counts), headers={"Content-Type": "text/plain; version=0.0.4"})

    # -- generation ---------------------------------------------------------------
    def flow(self, ctx: RequestContext):
        if self.mode == "colocated":
            return colocated_flow(ctx, self.cluster, self.client)
        if self.mode == "pdd":
            return pdd_flow(ctx, self.cluster, self.client)
        p, d = choose_pd(ctx, self.cluster, time.monotonic())
        return pd_flow(ctx, self.cluster, self.client, p, d)

    async def _check_serviceable(self) -> None:
        """A clear 503 instead of a failed dispatch when a role the flow needs
        has no live instance. The poll's view may be up to a poll old, so a
        fresh look decides (an instance just restarted is taken at once)."""
        if not unserviceable_roles(self.cluster, self.mode):
            return
        await self.cluster.refresh()
        missing = unserviceable_roles(self.cluster, self.mode)
        if missing:
            raise ApiError(f"no live {' or '.join(missing)} instance: the deployment cannot serve now, retry later",
                           status=503, type_="server_error", code="service_unavailable")

    async def completions(self, request: web.Request, chat: bool) -> web.StreamResponse:
        body = decode_body(await request.read())   # ApiError -> 400 in _guard
        parsed = parse_request(body, chat, self.tokenizer, self.served_model, self.max_model_len)
        await self._check_serviceable()
        rid = new_request_id()
        trace = RequestTrace(rid, self.mode, len(parsed.prompt_ids))
        self.traces.add(trace)
        ctx = RequestContext(rid, parsed.prompt_ids, parsed.sampling, trace,
                             time.monotonic() + self.spec.request_timeout_s, self.kv_bytes_per_token,
                             self.block_size)
        if parsed.stream:
            return await self._stream(request, parsed, ctx)
        text = ""
        async for _, delta in self._texts(ctx, parsed):
            text += delta
        if trace.error:
            return self._error(ApiError(trace.error, status=502, type_="server_error", code="upstream_failed"))
        return web.json_response(full(rid, parsed.model, chat, text, ctx.finish_reason or "stop",
                                      usage(len(ctx.prompt_ids), len(ctx.tokens), trace.cached_tokens),
                                      list(ctx.tokens) if parsed.return_token_ids else None))

    async def _stream(self, request, parsed, ctx: RequestContext) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)

        async def send(obj: dict) -> None:
            await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")

        first = True
        try:
            async for tok, delta in self._texts(ctx, parsed):
                ids = None if not parsed.return_token_ids else [] if tok is None else [tok]
                await send(chunk(ctx.request_id, parsed.model, parsed.chat, delta, None, first, ids))
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
        """(token id, text delta) per token (the delta possibly empty), cut at
        stop strings; a last (None, text) carries what the detokenizer held."""
        detok = self.tokenizer.detokenizer()
        trim = StopTrimmer(parsed.sampling.stop)
        t = ctx.trace
        try:
            async with contextlib.aclosing(self.flow(ctx)) as tokens:
                async for tok in tokens:
                    yield tok, trim.push(detok.feed(tok))
                    if trim.stopped:
                        ctx.finish_reason = "stop"
                        break
            tail = trim.push(detok.finish(), final=True)
            if tail:
                yield None, tail
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

    def _error(self, e: ApiError, headers: dict | None = None) -> web.Response:
        self.metrics.rejected.inc()
        return web.json_response(e.body(), status=e.status, headers=headers)


def unserviceable_roles(cluster: Cluster, mode: str) -> list[str]:
    """Roles without which no request can be served: P and either decoder
    in PDD (RLD and MD stand in for each other), every role elsewhere."""
    dead = {r for r in {m.spec.role for m in cluster.members.values()}
            if not any(m.healthy for m in cluster.role(r))}
    if mode == "pdd" and not {Role.RELAY, Role.MAIN} <= dead:
        dead -= {Role.RELAY, Role.MAIN}
    return sorted(r.value for r in dead)


def health_report(cluster: Cluster, mode: str) -> tuple[dict, int]:
    """(body, status): 503 names the roles with no live instance; 200 lists
    any instance that is down while its role still has another."""
    down = sorted(m.spec.name for m in cluster.members.values() if not m.healthy)
    roles = sorted({m.spec.role for m in cluster.members.values()}, key=lambda r: r.value)
    dead_roles = [r.value for r in roles if not any(m.healthy for m in cluster.role(r))]
    status = "unavailable" if dead_roles else "degraded" if down else "ok"
    body = {"status": status, "mode": mode, "down": down, "roles_without_live_instance": dead_roles}
    return body, 503 if dead_roles else 200
