"""How one request moves through the deployment, per mode.

Each flow is an async generator of output token ids, in order, for one
request; it records what happened on the RequestTrace and sets
`ctx.finish_reason` (or raises FlowError with a clear message). The router
turns the tokens into OpenAI responses.

  colocated  router -> C (generate)
  pd-*       router -> D (decode: waits for KV) and -> P (prefill, KV to D);
             P and D by `choose_pd`: the simulator's rule, from the cache index
  pdd        router -> policy: DIRECT (P -> MD), RELAY (P -> RLD + MD, handoff),
             RELAY_ONLY (P -> RLD; the abnormal-traffic filter or WAN down)
The PDD handoff itself lives in handoff_flow.py.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

from pdd.deploy.spec import Role
from pdd.engine.request import SamplingParams
from pdd.policy import NoRouteError, RequestFacts, choose_pipeline
from pdd.server.cluster import Cluster, Member
from pdd.server.tasks import spawn
from pdd.server.trace import RequestTrace
from pdd.server.wire import InternalClient, sampling_to_dict


class FlowError(RuntimeError):
    """The request cannot be completed; the message goes to the client."""


@dataclass
class RequestContext:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    trace: RequestTrace
    deadline_s: float
    kv_bytes_per_token: int
    block_size: int
    finish_reason: str | None = None
    tokens: list[int] = field(default_factory=list)

    def emit(self, token_id: int, source: str) -> int:
        """Commit one token to the user's stream (flows yield what this returns)."""
        self.tokens.append(token_id)
        self.trace.token(source)
        return token_id

    def remaining_s(self) -> float:
        return max(0.1, self.deadline_s - time.monotonic())


class Streams:
    """Merges several NDJSON streams into one queue of (source, event)."""

    def __init__(self, client: InternalClient):
        self.client = client
        self.queue: asyncio.Queue = asyncio.Queue()
        self.tasks: dict[str, asyncio.Task] = {}

    def open(self, source: str, member: Member, path: str, body: dict, timeout_s: float) -> None:
        async def pump() -> None:
            try:
                async for ev in self.client.stream(member.http.url, path, body, timeout_s):
                    await self.queue.put((source, ev))
                    if ev.get("event") == "finished":
                        return
                await self.queue.put((source, {"event": "closed"}))
            except asyncio.CancelledError:
                raise
            except Exception as e:
                await self.queue.put((source, {"event": "finished", "reason": "error",
                                               "error": f"{member.spec.name} unreachable: {e!r}"}))

        self.tasks[source] = asyncio.get_running_loop().create_task(pump())

    def close(self, source: str) -> None:
        t = self.tasks.pop(source, None)
        if t is not None:
            t.cancel()

    async def next(self, ctx: RequestContext) -> tuple[str, dict]:
        try:
            return await asyncio.wait_for(self.queue.get(), ctx.remaining_s())
        except asyncio.TimeoutError:
            raise FlowError("request deadline exceeded") from None

    def close_all(self) -> None:
        for s in list(self.tasks):
            self.close(s)


def decode_body(ctx: RequestContext, hold: bool = False) -> dict:
    return {"request_id": ctx.request_id, "prompt_ids": ctx.prompt_ids,
            "sampling": sampling_to_dict(ctx.sampling), "hold": hold, "kv_timeout_s": ctx.remaining_s()}


def prefill_body(ctx: RequestContext, cluster: Cluster, p: Member, targets: list[Member]) -> dict:
    return {"request_id": ctx.request_id, "prompt_ids": ctx.prompt_ids,
            "sampling": sampling_to_dict(ctx.sampling),
            "targets": [target(cluster, p, t, ctx) for t in targets]}


def target(cluster: Cluster, p: Member, t: Member, ctx: RequestContext, background: bool = False,
           stream: bool = True) -> dict:
    """Where P sends the KV; `background`: the copy yields the line to the
    transfers a user waits on (`pdd.policy.copy_yields_line`); `stream`: it
    leaves while P computes, not once the prefill has ended (`Transfer.streamed`).

    The copy may take as long as its request may: a streamed copy starts
    with P's first chunk and a yielding one waits its turn, so under
    overload a healthy copy can take minutes (P's queue, the line's); a
    fixed cap would fail it and push its request onto RLD (failover), or,
    in a PD baseline, fail the request. A dead or silent peer is caught by
    the transport's stall timeout (the sender's WAIT frames keep a queued
    copy alive), a cut link by the connection."""
    a = cluster.kv_address(t.spec.name, p.spec.name)
    return {"name": t.spec.name, "host": a.host, "kv_port": a.kv_port, "link": a.link,
            "deadline_s": ctx.remaining_s(), "background": background, "stream": stream}


def note_prefill(ctx: RequestContext, ev: dict) -> None:
    ctx.trace.cached_tokens = int(ev.get("cached_tokens", 0))
    ctx.trace.uncached_kv_bytes = (len(ctx.prompt_ids) - ctx.trace.cached_tokens) * ctx.kv_bytes_per_token
    ctx.trace.event("prefill_start", ts_abs=ev.get("prefill_start"))
    ctx.trace.event("prefill_end", first_token=ev.get("token"))


def _observe(estimator, ev: dict) -> None:
    """A landed copy's times, as P's sender reports them, into a line's estimator."""
    estimator.observe_transfer(time.monotonic(), int(ev.get("payload_bytes", 0)), float(ev["elapsed_s"]),
                               float(ev.get("handshake_s") or 0.0), float(ev.get("yielded_s") or 0.0),
                               float(ev.get("waited_s") or 0.0), bool(ev.get("shared_line")))


def note_transfer(ctx: RequestContext, ev: dict, cluster: Cluster) -> None:
    link = ev.get("link", "local")
    if ev.get("ok"):
        blocks = int(ev.get("blocks_sent") or 0) + int(ev.get("blocks_skipped") or 0)
        cluster.landed(str(ev.get("target")), ctx.prompt_ids, blocks)
        if link == "wan":
            ctx.trace.wan_bytes += int(ev.get("payload_bytes", 0))
            if ev.get("elapsed_s"):
                _observe(cluster.wan, ev)
        else:
            ctx.trace.local_bytes += int(ev.get("payload_bytes", 0))
            if ev.get("elapsed_s"):
                _observe(cluster.local, ev)
        ctx.trace.kv_landed_s[ev["target"]] = ev.get("ts", time.time()) - ctx.trace.arrival_s
    elif link == "wan":
        ctx.trace.wan_bytes += int(ev.get("payload_bytes", 0))
    ctx.trace.event("kv_transfer", **{k: ev.get(k) for k in
                                      ("target", "link", "ok", "error", "payload_bytes", "blocks_sent",
                                       "blocks_skipped", "elapsed_s", "handshake_s", "waited_s", "yielded_s",
                                       "shared_line", "background")})


async def colocated_flow(ctx: RequestContext, cluster: Cluster, client: InternalClient) -> AsyncIterator[int]:
    members = [m for m in cluster.role(Role.COLOCATED)]
    matched = await cluster.matched_tokens([m.spec.name for m in members], ctx.prompt_ids) if len(members) > 1 else {}
    from pdd.policy import pick_instance

    view = cluster.view(matched, time.monotonic())
    name = pick_instance(view.instances, matched, len(ctx.prompt_ids), view.now, cluster.policy)
    c = cluster.members[name]
    ctx.trace.instances["colocated"] = name
    streams = Streams(client)
    body = {"request_id": ctx.request_id, "prompt_ids": ctx.prompt_ids, "sampling": sampling_to_dict(ctx.sampling)}
    streams.open("c", c, "/internal/generate", body, ctx.remaining_s())
    cluster.dispatched(name, +1)
    try:
        while True:
            _, ev = await streams.next(ctx)
            kind = ev.get("event")
            if kind == "token":
                yield ctx.emit(ev["t"], "colocated")
            elif kind in ("finished", "closed"):
                ctx.trace.cached_tokens = int(ev.get("cached_tokens", 0))
                ctx.trace.uncached_kv_bytes = (len(ctx.prompt_ids) - ctx.trace.cached_tokens) * ctx.kv_bytes_per_token
                finish(ctx, ev)
                return
    finally:
        cluster.dispatched(name, -1)
        streams.close_all()


def finish(ctx: RequestContext, ev: dict) -> None:
    if ev.get("event") == "closed" or ev.get("reason") in (None, "error", "abort"):
        raise FlowError(ev.get("error") or f"instance stream ended early ({ev.get('reason')})")
    ctx.finish_reason = ev["reason"]


def choose_pd(ctx: RequestContext, cluster: Cluster, now: float) -> tuple[Member, Member | None]:
    """P and D of a PD baseline: cache affinity against load, by the very
    function the simulator routes these modes with (`choose_pipeline`: its
    P, and its decoder, which counts D's cache only under DRC). The cached
    prefixes come from the index the load poll keeps (no round trip); an
    instance whose index is not current counts as holding none. D is None
    for a one-token request: P's first token is the answer."""
    names = [m.spec.name for m in cluster.role(Role.PREFILL, Role.DECODE)]
    matched = cluster.indexed_matches(names, ctx.prompt_ids, now)
    facts = RequestFacts(ctx.request_id, len(ctx.prompt_ids), ctx.sampling.max_tokens,
                         ctx.kv_bytes_per_token, ctx.block_size)
    try:
        d = choose_pipeline(facts, cluster.view(matched, now), cluster.policy)
    except NoRouteError as e:
        raise FlowError(f"no route: {e}") from None
    return cluster.members[d.p_id], cluster.members[d.md_id] if d.md_id is not None else None


_cleanups: set[asyncio.Task] = set()     # aborts the user's answer does not wait for (`spawn`)


async def pd_flow(ctx: RequestContext, cluster: Cluster, client: InternalClient,
                  p: Member, d: Member | None, role_name: str = "d") -> AsyncIterator[int]:
    """Prefill on P, KV to D, D decodes from the first token on (in-DC or
    naive cross-DC PD); a one-token request is P's alone (D None)."""
    single = ctx.sampling.max_tokens == 1
    if d is None and not single:
        raise FlowError("no decode instance for a request of more than one token")
    ctx.trace.instances |= {"p": p.spec.name} | ({role_name: d.spec.name} if d is not None else {})
    streams = Streams(client)
    if not single:
        streams.open("d", d, "/internal/decode", decode_body(ctx), ctx.remaining_s())
        cluster.dispatched(d.spec.name, +1)
    streams.open("p", p, "/internal/prefill", prefill_body(ctx, cluster, p, [] if single else [d]),
                 ctx.remaining_s())
    prefilling = True            # P counts this request as its own until it has prefilled it
    cluster.dispatched(p.spec.name, +1)
    try:
        while True:
            src, ev = await streams.next(ctx)
            kind = ev.get("event")
            if src == "p":
                if kind == "prefilled":
                    note_prefill(ctx, ev)
                    cluster.landed(p.spec.name, ctx.prompt_ids)   # P's cache holds the prompt now
                    if prefilling:
                        prefilling = False
                        cluster.dispatched(p.spec.name, -1)
                    if single or ev.get("stop"):
                        ctx.finish_reason = "stop" if ev.get("stop") else "length"
                        yield ctx.emit(ev["token"], "p")
                        return
                elif kind == "transfer":
                    note_transfer(ctx, ev, cluster)
                    if ev.get("ok"):
                        # Not awaited: D's first tokens must not wait for P's answer,
                        # which may be slow to come back.
                        spawn(release(client, p, ctx), _cleanups)
                    else:
                        # D would wait for KV that will never come: end it now. The abort
                        # may cross the very line that failed, so the user's error does
                        # not wait for it (D also drops the request when its stream closes).
                        streams.close("d")
                        spawn(abort(client, d, ctx), _cleanups)
                        raise FlowError(f"KV transfer {p.spec.name} -> {d.spec.name} failed: {ev.get('error')}")
                elif kind in ("finished", "closed"):
                    if not ctx.trace.token_times_s and kind == "finished":
                        raise FlowError(f"prefill failed: {ev.get('error')}")
            else:
                if kind == "kv_ready":
                    ctx.trace.event("kv_ready", instance=d.spec.name)
                elif kind == "token":
                    yield ctx.emit(ev["t"], role_name)
                elif kind in ("finished", "closed"):
                    finish(ctx, ev)
                    return
    finally:
        if prefilling:
            cluster.dispatched(p.spec.name, -1)
        if not single:
            cluster.dispatched(d.spec.name, -1)
        streams.close_all()


async def control(client: InternalClient, m: Member, path: str, body: dict, ctx: RequestContext,
                  timeout_s: float = 10.0) -> None:
    """A best-effort control call (abort, release, extend...): a failure is recorded
    on the trace, not raised; an unreachable instance drops the request anyway
    when its stream closes."""
    try:
        await client.post(m.http.url, path, body, timeout_s=min(timeout_s, ctx.remaining_s()))
    except Exception as e:
        ctx.trace.event("control_error", instance=m.spec.name, path=path, error=repr(e))


async def abort(client: InternalClient, m: Member, ctx: RequestContext) -> None:
    await control(client, m, "/internal/abort", {"request_id": ctx.request_id}, ctx, timeout_s=5.0)


async def release(client: InternalClient, p: Member, ctx: RequestContext) -> None:
    """P frees the prompt KV (closing the prefill stream frees it as well)."""
    await control(client, p, "/internal/release", {"request_id": ctx.request_id}, ctx, timeout_s=5.0)


def new_request_id() -> str:
    return "cmpl-" + uuid.uuid4().hex[:24]
