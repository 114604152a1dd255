"""One instance process: an Engine behind an internal HTTP API and, for the
decoding roles, a KV receiver.

Roles and their calls (all under /internal/, signed, see http_auth.py):
  colocated   POST generate    prompt -> token stream
  prefill     POST prefill     prompt -> first token, then KV sent to the targets
              POST send/cancel/release   more targets, cancel one, free the KV
  decode,     POST decode      wait for the prompt KV, then stream tokens
  relay, main POST extend      append token ids made elsewhere (handoff)
  all         POST abort, POST match (cached prefix length), GET stats
Public: GET /health, GET /metrics (Prometheus text).

The incoming KV a decode call waits on is kept by `kv_arrivals.KVArrivals`
(the KV receiver's handler).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict
from pathlib import Path

from aiohttp import web

from pdd.deploy.spec import ROUTER_CERT_NAME, DeploymentSpec, InstanceSpec, Role
from pdd.deploy.topology import copy_pace
from pdd.engine.engine import Engine, InvalidRequestError, vocab_error
from pdd.engine.hashing import hash_blocks
from pdd.engine.request import EngineRequest
from pdd.engine.runner import trim_heap
from pdd.keys import DeploymentKeys
from pdd.policy import PolicyConfig
from pdd.server.engine_loop import EngineLoop
from pdd.server.http_auth import internal_auth_middleware
from pdd.server.instance_metrics import InstanceMetrics
from pdd.server.kv_arrivals import KVArrivals
from pdd.server.tasks import spawn
from pdd.server.prefill_job import PrefillJob
from pdd.server.wire import NdjsonWriter, sampling_from_dict
from pdd.transport import tls
from pdd.transport.kv_receiver import KVReceiver
from pdd.transport.kv_sender import KVSender
from pdd.transport.shm import WARM_SEGMENT_BYTES

log = logging.getLogger(__name__)


def bad_request(msg: str, status: int = 400) -> web.Response:
    return web.json_response({"error": {"message": msg, "type": "invalid_request_error"}}, status=status)


def _tls_peer_middleware(allowed: frozenset[str]):
    """On a TLS port, /internal/ calls need a client certificate naming an allowed peer
    (the router): a certificate the CA signed for another instance is refused too."""
    @web.middleware
    async def check(request: web.Request, handler):
        if request.path.startswith("/internal/") and not tls.peer_names(request.transport) & allowed:
            return bad_request("internal calls on this port need the router's TLS client certificate", 403)
        return await handler(request)
    return check


class InstanceServer:
    arrivals_class = KVArrivals       # what handles incoming KV (the vLLM server stages it instead)

    def __init__(self, spec: DeploymentSpec, inst: InstanceSpec, secret: bytes, engine: Engine,
                 tls_dir: Path | None = None):
        self.spec, self.inst, self.engine = spec, inst, engine
        self.keys = DeploymentKeys.derive(secret)   # per purpose; the master secret is not kept
        self.tls_files = tls.TlsFiles(tls_dir, inst.name) if tls_dir is not None else None
        self.loop: EngineLoop | None = None
        self.receiver: KVReceiver | None = None
        self.sender: KVSender | None = None
        self.jobs: dict[str, PrefillJob] = {}
        self._cleanups: set[asyncio.Task] = set()   # fire-and-forget releases, kept referenced
        self.metrics = InstanceMetrics(inst.name, inst.role.value)
        self.policy = PolicyConfig.from_dict(spec.policy)
        self.arrivals = self.arrivals_class(spec, engine, self.policy, self.metrics)
        # Bodies are read (up to client_max_size) only after the signature checked out.
        middlewares = [internal_auth_middleware(self.keys.internal_http, inst.name)]
        if tls.http_tls(spec, inst):
            middlewares.append(_tls_peer_middleware(frozenset({ROUTER_CERT_NAME})))
        self.app = web.Application(middlewares=middlewares, client_max_size=64 << 20)
        r = self.app.router
        r.add_get("/health", self.health)
        r.add_get("/metrics", self.metrics_endpoint)
        r.add_get("/internal/stats", self.stats)
        r.add_get("/internal/steps", self.steps)
        r.add_post("/internal/match", self.match)
        r.add_post("/internal/abort", self.abort)
        if inst.role == Role.COLOCATED:
            r.add_post("/internal/generate", self.generate)
        if inst.role == Role.PREFILL:
            r.add_post("/internal/prefill", self.prefill)
            r.add_post("/internal/send", self.send_more)
            r.add_post("/internal/cancel", self.cancel_transfer)
            r.add_post("/internal/release", self.release)
        if inst.role.decodes:
            r.add_post("/internal/decode", self.decode)
            r.add_post("/internal/extend", self.extend)

    # -- lifecycle ----------------------------------------------------------
    async def start(self) -> web.AppRunner:
        self.loop = EngineLoop(self.engine, asyncio.get_running_loop())
        self.loop.on_step = self.metrics.on_events
        self.loop.start()
        self.arrivals.loop = self.loop
        self.arrivals.after_transfer = self.trim_if_quiet
        spec, inst = self.spec, self.inst
        if inst.role.decodes:
            kv_tls = tls.server_context(self._tls_files()) if tls.kv_tls(spec, inst) else None
            self.receiver = await KVReceiver.start(inst.host, inst.kv_port, self.keys.kv, self.arrivals,
                                                   tls=kv_tls, tls_peers=tls.kv_senders(spec),
                                                   stall_timeout_s=spec.kv_stall_s,
                                                   keepalive_s=spec.kv_keepalive_s,
                                                   shm_dir=spec.kv_same_host == "shm")
        if inst.role == Role.PREFILL:
            peers = tls.kv_peers(spec, inst, self._tls_files()) if tls.uses_tls(spec) else {}
            self.sender = KVSender(self.keys.kv, tls=lambda host, port: peers.get((host, port)), seal_blocks=True,
                                   stall_timeout_s=spec.kv_stall_s, keepalive_s=spec.kv_keepalive_s,
                                   max_yield_s=PolicyConfig.from_dict(spec.policy).copy_max_yield_s,
                                   paces=copy_pace(spec),
                                   shm_line="local" if spec.kv_same_host == "shm" else None)
            if self.sender.segments is not None:
                self.sender.segments.warm(WARM_SEGMENT_BYTES)
        runner = web.AppRunner(self.app, access_log=None, handler_cancellation=True)
        await runner.setup()
        http_tls = None
        if tls.http_tls(spec, inst):
            http_tls = tls.server_context(self._tls_files(), require_client_cert=False)
        await web.TCPSite(runner, inst.host, inst.port, ssl_context=http_tls).start()
        if inst.role.decodes:
            spawn(self.arrivals.expire_forever(), self._cleanups)
        return runner

    def trim_if_quiet(self) -> None:
        """After a KV transfer ends (sent or received), with nothing else under
        way, hand the C allocator's free pages back. The engine does so when it
        goes idle, but a sender's block reads and a receiver's imports happen
        beside its steps and often end after it went idle: a paced copy on a slow
        line, a late import; their pages stayed (P's RSS grew 265 MB over
        tests/test_soak.py, RLD's 211 MB in another run)."""
        if (self.engine.has_work or (self.sender is not None and not self.sender.idle)
                or self.arrivals.importing):
            return
        trim_heap()

    def _tls_files(self) -> tls.TlsFiles:
        if self.tls_files is None:
            raise tls.TlsError(f"TLS is on (tls.mode = {self.spec.tls.mode.value}) but {self.inst.name} was given "
                               f"no certificate directory (pdd serve --tls-dir, or [tls] dir)")
        return self.tls_files

    async def close(self) -> None:
        if self.receiver:
            await self.receiver.close()
        if self.sender:
            await self.sender.close()
        if self.loop:
            self.loop.stop()

    # -- public -----------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "name": self.inst.name, "role": self.inst.role.value})

    async def metrics_endpoint(self, request: web.Request) -> web.Response:
        stats = await self.loop.call(lambda e: e.stats())
        body = self.metrics.render(stats, self.loop.busy_s, time.monotonic() - self.loop.started_s)
        return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4"})

    async def stats(self, request: web.Request) -> web.Response:
        # Read without waiting for the engine thread: a long prefill step must not
        # make a busy instance look dead to the router. Plain int reads; a value
        # one step old is fine for load balancing.
        stats = self.engine.stats()
        stats |= {"name": self.inst.name, "role": self.inst.role.value, "datacenter": self.inst.datacenter,
                  "max_num_seqs": self.engine.cfg.max_num_seqs,
                  "num_arrivals": len(self.arrivals), "num_jobs": len(self.jobs)}
        if self.sender is not None:
            stats["kv_send_backlog"] = self.sender.backlog()   # per line: bytes P still has to send
        since = request.query.get("kv_since")
        log = getattr(self.engine, "kv_events", None)
        if since is not None and log is not None:
            # The prefix cache's changes since the router's last poll (pdd.engine.kv_events).
            try:
                seq = int(since)
            except ValueError:
                raise web.HTTPBadRequest(text="kv_since must be an integer") from None
            pool = self.engine.pool
            stats["kv"] = log.read(seq, request.query.get("kv_epoch"), lambda: list(pool.hash_to_block)) | {
                "block_size": self.engine.cfg.block_size, "namespace": self.engine.model_cfg.model_id}
        return web.json_response(stats)

    async def steps(self, request: web.Request) -> web.Response:
        """The engine's step records (shape and wall time), for simulator calibration."""
        records = await self.loop.call(lambda e: [asdict(r) for r in e.step_log])
        return web.json_response({"instance": self.inst.name, "role": self.inst.role.value, "steps": records})

    async def match(self, request: web.Request) -> web.Response:
        ids = (await request.json()).get("prompt_ids", [])
        ns = self.engine.model_cfg.model_id.encode()
        hashes = hash_blocks(ids, self.engine.cfg.block_size, ns)
        # Read here, not as an engine command: that would wait for the step
        # under way (a whole prefill chunk on P) before the router can route.
        # lookup_prefix only does dict lookups, atomic under the GIL; the
        # answer is a routing hint that may be one step stale (the transfer's
        # HAVE is what counts).
        matched = len(self.engine.pool.lookup_prefix(hashes)) * self.engine.cfg.block_size
        return web.json_response({"matched_tokens": matched})

    async def abort(self, request: web.Request) -> web.Response:
        body = await request.json()
        rid = str(body.get("request_id"))
        await self.loop.abort(rid)
        if body.get("keep_kv"):
            self.arrivals.let_land(rid, "aborted")
        else:
            self.arrivals.drop(rid)
        return web.json_response({"aborted": rid})

    # -- colocated --------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        try:
            req = EngineRequest(str(body["request_id"]), list(body["prompt_ids"]),
                                sampling_from_dict(body.get("sampling", {})))
            q = await self.loop.submit(req)
        except (InvalidRequestError, KeyError, TypeError, ValueError) as e:
            return bad_request(str(e))
        async with NdjsonWriter(request) as out:
            await out.send({"event": "admitted", "ts": time.time()})
            await self._stream_tokens(req.request_id, q, out)
        return out.resp

    async def _stream_tokens(self, rid: str, q: asyncio.Queue, out: NdjsonWriter) -> None:
        """Forward engine events of one request until it finishes; abort it if the caller goes away."""
        finished = False
        try:
            while (ev := await q.get()) is not None:
                if ev.extended_upto is not None:
                    await out.send({"event": "extended", "upto": ev.extended_upto, "ts": time.time()})
                if ev.token_id is not None:
                    await out.send({"event": "token", "i": ev.index, "t": ev.token_id, "ts": time.time()})
                if ev.finished:
                    finished = True
                    req = self.engine.requests.get(rid)
                    await out.send({"event": "finished", "reason": ev.finish_reason, "error": ev.error,
                                    "cached_tokens": req.num_cached_tokens if req else 0, "ts": time.time()})
        finally:
            # Spawned, not awaited here: a second cancellation of the handler (its
            # connection lost while it closes) stopped these awaits and left the
            # request's record behind on MD (tests/test_soak.py, num_requests=1
            # at rest, twice in two sessions).
            self._spawn(self._release_request(rid, abort=not finished))

    async def _release_request(self, rid: str, abort: bool = True) -> None:
        """Abort (which also ends a request whose submit went through as its
        call was cancelled, and drops the pins of an arrival already consumed)
        and forget a request's record."""
        if abort:
            await self.loop.abort(rid)
        await self.loop.call(lambda e: e.forget(rid))

    # -- prefill ----------------------------------------------------------------
    async def prefill(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        try:
            job = PrefillJob.from_body(self, body)
            self.jobs[job.request_id] = job
            q = await self.loop.submit(job.engine_request())
        except (InvalidRequestError, KeyError, TypeError, ValueError) as e:
            self.jobs.pop(str(body.get("request_id")), None)
            return bad_request(str(e))
        except asyncio.CancelledError:
            # The router left while the submit went through: without this the
            # finished prefill would keep its prompt KV (keep_kv) forever.
            self.jobs.pop(job.request_id, None)
            self._spawn(job.close())
            raise
        try:
            async with NdjsonWriter(request) as out:
                await job.run(q, out)
        finally:
            self.jobs.pop(job.request_id, None)
            # Spawned, not awaited: the stream's end went out above, so the
            # router has taken this keep-alive connection back for its next
            # call to P, which aiohttp reads only once this handler returns;
            # awaited, the close's engine commands (abort, forget) held that
            # call until the step under way ended, up to a whole prompt chunk
            # (routing's prefix match, a load poll, the next request's own
            # prefill: 0.4-1.6 s, measured in session 37).
            self._spawn(job.close())
        return out.resp

    async def send_more(self, request: web.Request) -> web.Response:
        body = await request.json()
        job = self.jobs.get(str(body.get("request_id")))
        if job is None:
            return bad_request("no such prefill job (finished or released)", 404)
        job.start_transfer(body["target"])
        return web.json_response({"ok": True})

    async def cancel_transfer(self, request: web.Request) -> web.Response:
        body = await request.json()
        job = self.jobs.get(str(body.get("request_id")))
        if job is not None:
            job.cancel_transfer(str(body.get("target")), body.get("reason", "cancelled by router"))
        return web.json_response({"ok": job is not None})

    async def release(self, request: web.Request) -> web.Response:
        job = self.jobs.get(str((await request.json()).get("request_id")))
        if job is not None:
            job.release()
        return web.json_response({"ok": job is not None})

    # -- decode side: requests -------------------------------------------------------
    async def decode(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        try:
            rid = str(body["request_id"])
            prompt = list(body["prompt_ids"])
            sampling = sampling_from_dict(body.get("sampling", {}))
            hold = bool(body.get("hold", False))
        except (KeyError, TypeError, ValueError) as e:
            return bad_request(str(e))
        timeout_s = float(body.get("kv_timeout_s", self.spec.kv_deadline_s))
        arrival = self.arrivals.get(rid)
        arrival.claimed = True
        streamed = False
        try:
            async with NdjsonWriter(request) as out:
                try:
                    status = await asyncio.wait_for(asyncio.shield(arrival.done), timeout_s)
                except (asyncio.TimeoutError, RuntimeError) as e:
                    msg = str(e) or f"KV did not arrive within {timeout_s:.1f} s"
                    await out.send({"event": "finished", "reason": "error", "error": msg, "ts": time.time()})
                    return out.resp
                self.arrivals.consumed(rid)     # no more tokens ahead are taken from here on
                first = int(status.meta.get("first_token"))
                outputs = [first] + arrival.ahead
                if len(outputs) >= sampling.max_tokens:
                    outputs = [first]           # nothing left to make after them: held as before
                run_on = hold and len(outputs) > 1
                await out.send({"event": "kv_ready", "ts": time.time(), "payload_bytes": status.payload_bytes,
                                "blocks": status.num_blocks_sent, "skipped": status.num_blocks_skipped,
                                "elapsed_s": status.elapsed_s} | ({"have": len(outputs)} if run_on else {}))
                if not hold:
                    # P's first token is final: stream it now rather than after the
                    # engine's next step boundary (the submit below waits for one).
                    await out.send({"event": "token", "i": 0, "t": first, "ts": time.time()})
                try:
                    # The relay's tokens sent ahead are computed with the prompt's
                    # tail in one step, and the request decodes on from them.
                    q = await self.loop.submit(EngineRequest(rid, prompt, sampling, output_ids=outputs,
                                                             hold=hold and not run_on))
                except InvalidRequestError as e:
                    await out.send({"event": "finished", "reason": "error", "error": str(e), "ts": time.time()})
                    return out.resp
                streamed = True      # from here _stream_tokens aborts and forgets the request
                await self._stream_tokens(rid, q, out)
        finally:
            if not streamed:
                self._abandon_decode(rid)
        return out.resp

    def _extend_ahead(self, rid: str, start, ids: list[int]) -> web.Response:
        """The relay's tokens sent ahead of the request's KV (`ExtendAhead`):
        kept for its first step if its decode call waits for the KV here;
        answered with the output tokens held then (`have`), or null once the
        KV has landed (the request decodes on its own: nothing is taken)."""
        if not isinstance(start, int) or isinstance(start, bool) or start < 1:
            return bad_request(f"start must be a positive integer, got {start!r}")
        bad = vocab_error(ids, self.engine.model_cfg.vocab_size)
        if bad:
            return bad_request(bad)
        return web.json_response({"ok": True, "have": self.arrivals.add_ahead(rid, start, ids)})

    def _abandon_decode(self, rid: str) -> None:
        """A decode call ends before its request streams: an error, or its
        caller went away (the router closes the stream when the client
        disconnects; aiohttp cancels this handler). Nothing will consume the
        KV pinned for it, so unpin now instead of at the arrival's expiry
        (2 x kv_deadline_s; until then those blocks count as used). What
        landed stays in the prefix cache; a transfer still landing finishes
        as a warm push (unpinned at its END)."""
        self.arrivals.let_land(rid, "decode call ended")
        self._spawn(self._release_request(rid))

    def _spawn(self, coro) -> None:
        """Run a release that must outlive a cancelled handler."""
        spawn(coro, self._cleanups)

    async def extend(self, request: web.Request) -> web.Response:
        body = await request.json()
        rid, final = str(body.get("request_id")), bool(body.get("final", True))
        ids = [int(t) for t in body.get("token_ids", [])]
        if body.get("ahead"):
            return self._extend_ahead(rid, body.get("start"), ids)
        hold_at = body.get("hold_at")
        if hold_at is not None and (not isinstance(hold_at, int) or isinstance(hold_at, bool) or hold_at < 0):
            return bad_request(f"hold_at must be a non-negative integer, got {hold_at!r}")
        try:
            await self.loop.call(lambda e: e.extend(rid, ids, final=final, hold_at=hold_at))
        except InvalidRequestError as e:
            return bad_request(str(e), 409)
        return web.json_response({"ok": True})
