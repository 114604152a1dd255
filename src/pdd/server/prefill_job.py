"""One request on a prefill instance: prefill, then KV to every target.

Lifecycle:
    PREFILLING --first token--> SENDING (one transfer per target, in parallel)
    SENDING --router: release, or all done and released--> CLOSED (KV freed)
The router holds the job's NDJSON stream open; while it does, P keeps the
prompt KV, so the router can add a target (failover: re-route through RLD)
or cancel one (the abnormal-traffic filter). Closing the stream cancels what
is still in flight and frees the KV.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

from pdd.engine.request import EngineRequest
from pdd.server.wire import NdjsonWriter, sampling_from_dict
from pdd.transport.kv_sender import TransferHandle


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
        ev = None
        while (item := await q.get()) is not None:
            ev = item
        if ev is None or ev.token_id is None:
            await out.send({"event": "finished", "reason": "error",
                            "error": (ev.error if ev else None) or "prefill failed", "ts": time.time()})
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
        for t in self.targets:
            self.start_transfer(t)
        while not (self.released and not self._in_flight()):
            item = await self.events.get()
            if item is not None:
                await out.send(item)

    def _in_flight(self) -> bool:
        return any(not h.done for h in self.transfers.values())

    def start_transfer(self, target: dict) -> None:
        if self.manifest is None:
            raise RuntimeError("prefill has not finished")
        name = str(target["name"])
        req = self.server.engine.requests[self.request_id]
        block_ids = list(req.block_ids)
        read = self.server.engine.runner.read_block
        manifest, rid, extra = self.manifest, self.request_id, {}
        if target.get("warm_blocks") is not None:
            # Only a shared prefix, to warm the receiver's prefix cache: no
            # request there will consume it under this request's id.
            manifest = manifest.prefix(int(target["warm_blocks"]))
            rid, extra = f"{self.request_id}.warm", {"warm": True}
        meta = manifest.to_meta() | {"first_token": self.first_token} | extra
        handle = self.server.sender.send(
            str(target["host"]), int(target["kv_port"]), rid, meta,
            list(manifest.block_hashes), lambda i: read(block_ids[i]),
            deadline_s=float(target.get("deadline_s", self.server.spec.kv_deadline_s)),
            line=str(target.get("link", "local")), background=bool(target.get("background", False)),
        )
        self.transfers[name] = handle
        asyncio.get_running_loop().create_task(self._report(name, target.get("link", "local"), handle,
                                                               bool(target.get("background", False))))

    async def _report(self, name: str, link: str, handle: TransferHandle, background: bool) -> None:
        st = await handle.wait()
        self.server.metrics.on_kv_sent(link, st)
        await self.events.put({
            "event": "transfer", "target": name, "link": link, "ok": st.ok, "error": st.error or None,
            "payload_bytes": st.payload_bytes, "bytes_sent": st.bytes_sent,
            "blocks_sent": st.num_blocks_sent, "blocks_skipped": st.num_blocks_skipped,
            "elapsed_s": st.elapsed_s, "handshake_s": st.handshake_s, "yielded_s": st.yielded_s,
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
