"""One request on a prefill instance: prefill, and its KV to every target.

Lifecycle:
    QUEUED --the engine schedules it--> PREFILLING: one transfer per target
      starts and streams each block as soon as the chunk that fills it is
      computed (what the receiver already holds is skipped, as always)
    PREFILLING --first token--> SENDING: the transfers' END carries it
    SENDING --router: release, or all done and released--> CLOSED (KV freed)
Streaming hides the transfer behind the prefill: a 2K-token prompt computes
for seconds, and its first chunks' KV can be on the line meanwhile, as
SGLang's and Mooncake's prefill servers send KV chunk by chunk. Targets added
later (failover) and warm pushes send from the finished KV.
The router holds the job's NDJSON stream open; while it does, P keeps the
prompt KV, so the router can add a target (failover: re-route through RLD)
or cancel one (the abnormal-traffic filter). Closing the stream cancels what
is still in flight and frees the KV.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

from pdd.engine.hashing import hash_blocks
from pdd.engine.kv_codec import KVManifest
from pdd.engine.request import EngineRequest, RequestStatus
from pdd.server.wire import NdjsonWriter, sampling_from_dict
from pdd.transport.kv_sender import TransferHandle


# A streamed transfer waits for the engine to move (`EngineLoop.moved`: a
# layer's KV written, a step done) and looks again at least this often.
STREAM_WAIT_S = 0.25
# What a streamed transfer reads from the KV cache ahead of its line: one
# read of every computed block at once held a whole prompt's KV (55 MB for
# 2.4K tokens in bf16) per copy while a paced or yielding copy trickled it
# out over seconds; P's RSS grew 265 MB over tests/test_soak.py.
READ_AHEAD_BYTES = 4 << 20


class PrefillJob:
    def __init__(self, server, request_id: str, prompt_ids: list[int], sampling, targets: list[dict]):
        self.server = server
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.sampling = sampling
        self.targets = targets
        self.events: asyncio.Queue = asyncio.Queue()
        self.transfers: dict[str, TransferHandle] = {}
        self.released = False
        self.manifest = None
        self.first_token: int | None = None
        self.prefilled: asyncio.Future | None = None     # P's first token (streamed transfers' END)
        self.watcher: asyncio.Task | None = None

    def _seen(self) -> int:
        """Note this before looking at the engine; `_engine_moves(seen)` then
        returns at once if it moved meanwhile."""
        return self.server.loop.moved.version

    async def _engine_moves(self, seen: int) -> None:
        await self.server.loop.moved.wait(seen, STREAM_WAIT_S)

    def _streamed_targets(self) -> list[dict]:
        """The copies that leave while P computes; the others (a warm push, a
        copy the router asked for after the prefill: `"stream": false`) go once
        it has ended."""
        return [t for t in self.targets if t.get("warm_blocks") is None and t.get("stream", True) is not False]
    @classmethod
    def from_body(cls, server, body: dict) -> "PrefillJob":
        targets = list(body.get("targets", []))
        for t in targets:
            if not {"name", "host", "kv_port"} <= set(t):
                raise ValueError("each target needs name, host and kv_port")
        return cls(server, str(body["request_id"]), [int(t) for t in body["prompt_ids"]],
                   sampling_from_dict(body.get("sampling", {})), targets)

    def engine_request(self) -> EngineRequest:
        sp = replace(self.sampling, max_tokens=1)
        return EngineRequest(self.request_id, self.prompt_ids, sp, keep_kv=True)

    async def run(self, q: asyncio.Queue, out: NdjsonWriter) -> None:
        t0 = time.time()
        self.prefilled = asyncio.get_running_loop().create_future()
        self.watcher = asyncio.ensure_future(self._stream_once_scheduled())
        ev = None
        while (item := await q.get()) is not None:
            ev = item
        if ev is None or ev.token_id is None:
            error = (ev.error if ev else None) or "prefill failed"
            self._prefill_over(RuntimeError(f"prefill failed: {error}"))
            await out.send({"event": "finished", "reason": "error", "error": error, "ts": time.time()})
            return
        self.first_token = ev.token_id
        # The request has finished and holds its blocks (keep_kv): nothing mutates it any
        # more, so read it here rather than wait for the engine thread's next step.
        engine = self.server.engine
        self.manifest = engine.kv_manifest(self.request_id)
        cached = engine.requests[self.request_id].num_cached_tokens
        user_reason = "stop" if ev.finish_reason == "stop" else None
        await out.send({"event": "prefilled", "token": ev.token_id, "cached_tokens": cached,
                        "num_blocks": len(self.manifest.block_hashes), "stop": user_reason,
                        "prefill_start": t0, "ts": time.time()})
        self.server.metrics.on_prefill(len(self.prompt_ids), cached)
        self._prefill_over(None)
        for t in self.targets:
            if str(t["name"]) not in self.transfers:
                self.start_transfer(t)
        while not (self.released and not self._in_flight()):
            item = await self.events.get()
            if item is not None:
                await out.send(item)

    def _prefill_over(self, error: Exception | None) -> None:
        if self.watcher is not None:
            self.watcher.cancel()
        f = self.prefilled
        if f is None or f.done():
            return
        if error is None:
            f.set_result(self.first_token)
        else:
            f.set_exception(error)
            f.exception()      # retrieved: each streamed transfer reports it

    async def _stream_once_scheduled(self) -> None:
        """Start the streamed transfers when the engine starts on the prompt."""
        engine = self.server.engine
        stepped = self.server.loop.stepped
        while True:
            seen = stepped.version
            req = engine.requests.get(self.request_id)
            if req is not None and req.status is not RequestStatus.WAITING:
                break
            await stepped.wait(seen, STREAM_WAIT_S)
        for t in self._streamed_targets():
            if str(t["name"]) not in self.transfers:
                self.start_stream(t)

    def start_stream(self, target: dict) -> None:
        """A transfer of the prompt's full blocks while they are computed."""
        engine = self.server.engine
        bs = engine.cfg.block_size
        nblk = len(self.prompt_ids) // bs
        hashes = hash_blocks(self.prompt_ids, bs, engine.layout.model_id.encode())
        manifest = KVManifest(engine.layout, tuple(self.prompt_ids[: nblk * bs]), tuple(hashes))
        rid, read = self.request_id, engine.runner.read_block

        async def block(i: int) -> bytes:
            need = (i + 1) * bs
            while True:
                seen = self._seen()
                req = self._streamed_request()
                gen = req.num_preemptions
                if req.num_computed_tokens >= need and len(req.block_ids) > i:
                    data = read(req.block_ids[i])
                    # Read while the engine thread runs: valid only if the request
                    # kept its blocks throughout (no preemption in between).
                    if req.num_preemptions == gen and req.num_computed_tokens >= need:
                        return data
                await self._engine_moves(seen)

        async def finish() -> dict:
            return {"first_token": await asyncio.shield(self.prefilled)}

        runner = engine.runner
        if getattr(runner, "read_block_layers", None) is None:
            self._send(target, manifest, rid, {}, block, finish)
            return
        self._send(target, manifest, rid, {}, None, finish,
                   parts=lambda held: self._layer_slices(nblk, held))

    def _streamed_request(self) -> EngineRequest:
        req = self.server.engine.requests.get(self.request_id)
        if req is None or (self.prefilled.done() and self.prefilled.exception() is not None):
            raise RuntimeError("the prefill ended before its KV was complete")
        return req

    async def _layer_slices(self, nblk: int, held: set[int]):
        """The prompt's blocks layer by layer, as the engine writes them: a
        chunk's KV for layer l is final once the step computing the chunk has
        passed layer l, so it can be on the line while the step computes the
        layers above (the whole chunk, not just earlier chunks, hides behind
        the prefill). A block's layers go in order; the blocks of a chunk
        interleave, so all of them advance together. Yields (block, byte
        offset, block bytes, slice) for the sender's PART frames, and None
        while nothing new is computed."""
        engine = self.server.engine
        runner, bs = engine.runner, engine.cfg.block_size
        num_layers = runner.num_layers
        layer_bytes = engine.layout.block_bytes // num_layers
        step = engine.layout.layers_per_part
        sent = {i: 0 for i in range(nblk) if i not in held}     # block -> layers sent
        while sent:
            seen = self._seen()
            req = self._streamed_request()
            gen = req.num_preemptions
            computed = req.num_computed_tokens
            prog = runner.progress
            span = prog.spans.get(self.request_id) if prog is not None else None
            layers_now = prog.layers_written if span is not None else 0
            out, read, capped = [], 0, False
            for i in sorted(sent):
                need = (i + 1) * bs
                if len(req.block_ids) <= i:
                    break
                if computed >= need:
                    upto = num_layers
                elif span is not None and span[0] <= computed and span[1] >= need:
                    upto = layers_now
                else:
                    break
                lo = sent[i]
                if upto == num_layers or upto - lo >= step:     # a block in `sent` has layers left
                    if read >= READ_AHEAD_BYTES:
                        capped = True        # the rest on the next turn, without waiting for P
                        break
                    out.append((i, lo, upto, runner.read_block_layers(req.block_ids[i], lo, upto)))
                    read += (upto - lo) * layer_bytes
            # Valid only if the request kept its blocks while we read them.
            if req.num_preemptions != gen or self.server.engine.requests.get(self.request_id) is not req:
                await self._engine_moves(seen)
                continue
            for i, lo, upto, data in out:
                yield i, lo * layer_bytes, num_layers * layer_bytes, data
                sent[i] = upto
                if upto == num_layers:
                    del sent[i]
            if sent and not capped:
                if not out:
                    yield None          # waiting for P: the line is free for others meanwhile
                await self._engine_moves(seen)

    def _in_flight(self) -> bool:
        return any(not h.done for h in self.transfers.values())

    def start_transfer(self, target: dict) -> None:
        if self.manifest is None:
            raise RuntimeError("prefill has not finished")
        req = self.server.engine.requests[self.request_id]
        block_ids = list(req.block_ids)
        read = self.server.engine.runner.read_block
        manifest, rid, extra = self.manifest, self.request_id, {}
        if target.get("warm_blocks") is not None:
            # Only a shared prefix, to warm the receiver's prefix cache: no
            # request there will consume it under this request's id.
            manifest = manifest.prefix(int(target["warm_blocks"]))
            rid, extra = f"{self.request_id}.warm", {"warm": True}
        meta = {"first_token": self.first_token} | extra
        into = getattr(self.server.engine.runner, "read_block_into", None)
        self._send(target, manifest, rid, meta, lambda i: read(block_ids[i]), None,
                   read_into=(lambda i, out: into(block_ids[i], out)) if into is not None else None)

    def _send(self, target: dict, manifest: KVManifest, rid: str, meta: dict, get_block, finish,
              parts=None, read_into=None) -> None:
        name = str(target["name"])
        handle = self.server.sender.send(
            str(target["host"]), int(target["kv_port"]), rid, manifest.to_meta() | meta,
            list(manifest.block_hashes), get_block,
            deadline_s=float(target.get("deadline_s", self.server.spec.kv_deadline_s)),
            line=str(target.get("link", "local")), background=bool(target.get("background", False)),
            finish=finish, block_bytes=self.server.engine.layout.block_bytes, parts=parts,
            read_into=read_into,
        )
        self.transfers[name] = handle
        asyncio.get_running_loop().create_task(self._report(name, target.get("link", "local"), handle,
                                                               bool(target.get("background", False))))

    async def _report(self, name: str, link: str, handle: TransferHandle, background: bool) -> None:
        st = await handle.wait()
        self.server.metrics.on_kv_sent(link, st)
        self.server.trim_if_quiet()
        await self.events.put({
            "event": "transfer", "target": name, "link": link, "ok": st.ok, "error": st.error or None,
            "payload_bytes": st.payload_bytes, "bytes_sent": st.bytes_sent,
            "blocks_sent": st.num_blocks_sent, "blocks_skipped": st.num_blocks_skipped,
            "elapsed_s": st.elapsed_s, "handshake_s": st.handshake_s, "yielded_s": st.yielded_s,
            "waited_s": st.waited_s, "shared_line": st.shared_line,
            "background": background, "ts": time.time(),
        })

    def cancel_transfer(self, name: str, reason: str) -> None:
        h = self.transfers.get(name)
        if h is not None:
            h.cancel(reason)

    def release(self) -> None:
        self.released = True
        self.events.put_nowait(None)

    async def close(self) -> None:
        self._prefill_over(RuntimeError("prefill job closed"))
        for h in self.transfers.values():
            h.cancel("prefill job closed")
        rid = self.request_id
        loop = self.server.loop

        async def release() -> None:
            # Abort first: it ends a prefill still running (client gone) or
            # frees the KV a finished one kept; forget then drops the record.
            await loop.abort(rid)
            await loop.call(lambda e: e.forget(rid))

        # Shielded: a second cancellation of the handler (its connection
        # lost while it closes) must not leave the KV or the record behind.
        await asyncio.shield(asyncio.ensure_future(release()))
