"""An instance process whose engine is vLLM (`pdd serve` of a vLLM deployment).

The HTTP side is our InstanceServer unchanged (signed internal API, NDJSON
token streams, prefill jobs and their transfers, /metrics, /internal/steps);
EngineLoop drives a VllmEngine on its thread as it drives our Engine. What
differs is answered here:
  match     vLLM's prefix cache, read by block content (prefix.py)
  receiver  BEGIN is answered HAVE from vLLM's prefix cache; blocks land in
            a staging list (not in vLLM's pool: vLLM owns its blocks), which
            the connector loads when the decode request is scheduled.

Every role runs: colocated without the connector, the others with it.
"""

from __future__ import annotations

import logging
from pathlib import Path

from aiohttp import web

from pdd.deploy.spec import DeploymentSpec, InstanceSpec, Role
from pdd.engine.kv_codec import BLOCK_DIGEST, KVImportError, KVManifest, open_payload
from pdd.server.instance import InstanceServer
from pdd.server.kv_arrivals import KVArrivals
from pdd.transport.state import TransferStatus
from pdd.vllm.engine import VllmEngine
from pdd.vllm.prefix import VllmPrefixIndex

log = logging.getLogger(__name__)


class StagedTransfer:
    """One incoming transfer's blocks, by index, until its request is submitted."""

    def __init__(self, manifest: KVManifest, block_bytes: int):
        self.manifest = manifest
        self.block_bytes = block_bytes
        self.payloads: list[bytes | None] = [None] * len(manifest.block_hashes)

    def add_block(self, index: int, payload: bytes) -> None:
        if len(payload) != self.block_bytes:
            raise KVImportError(f"KV block {index} has {len(payload)} bytes, expected {self.block_bytes}")
        self.payloads[index] = payload


class VllmKVArrivals(KVArrivals):
    """Incoming KV for a vLLM engine: HAVE from vLLM's prefix cache, blocks staged
    for the connector (vLLM owns its pool)."""

    async def on_begin(self, request_id: str, meta: dict, block_hashes: list[bytes]) -> set[int]:
        from pdd.vllm.connector import HUB

        if meta.get("block_digest") != BLOCK_DIGEST:
            raise KVImportError(f"KV blocks must be sealed with {BLOCK_DIGEST} (got {meta.get('block_digest')!r})")
        manifest = KVManifest.from_meta(meta, block_hashes)
        manifest.check_against(self.engine.layout)     # model, layout, and hashes re-derived from the token ids
        a = self.get(request_id)
        a.warm = bool(meta.get("warm"))
        a.hashes = list(block_hashes)
        a.importer = StagedTransfer(manifest, HUB.block_bytes)
        # What vLLM's prefix cache holds need not cross; it is pinned (on the
        # engine thread, between steps) until the request relying on it runs.
        # Were it lost anyway, the connector loads what landed up to the gap
        # and vLLM recomputes the rest (slower, still right).
        ids = list(manifest.token_ids)
        num_held = await self.loop.call(lambda e: e.pins.pin_cached(request_id, ids)) if self.kv_reuse else 0
        a.skipped = set(range(num_held))
        return a.skipped

    async def on_block(self, request_id: str, index: int, block_hash: bytes, payload: bytes) -> None:
        a = self.by_id.get(request_id)
        if a is None or a.importer is None:
            raise KVImportError(f"no transfer begun for {request_id}")
        a.importer.add_block(index, bytes(open_payload(payload, index)))   # staged past the segment's life
        a.landed.add(index)

    async def on_end(self, request_id: str, status: TransferStatus) -> None:
        from pdd.vllm.connector import HUB

        a = self.by_id.get(request_id)
        if a is not None and status.ok and a.importer is not None:
            # Staged before the decode call (woken by the base class) submits.
            HUB.stage(request_id, a.importer.payloads)
            if a.warm or not a.claimed:
                # No request consumes it (a warm push, a decode call gone or
                # not come): into vLLM's prefix cache, as our engine keeps it.
                ids = list(a.importer.manifest.token_ids)
                await self.loop.call(lambda e: e.absorb(request_id, ids))
        await super().on_end(request_id, status)


class VllmInstanceServer(InstanceServer):
    arrivals_class = VllmKVArrivals

    def __init__(self, spec: DeploymentSpec, inst: InstanceSpec, secret: bytes, engine: VllmEngine,
                 tls_dir: Path | None = None):
        super().__init__(spec, inst, secret, engine, tls_dir)
        self.prefix = VllmPrefixIndex(engine.llm.engine_core.engine_core, engine.cfg.block_size)

    async def match(self, request: web.Request) -> web.Response:
        ids = (await request.json()).get("prompt_ids", [])
        return web.json_response({"matched_tokens": self.prefix.matched_tokens([int(t) for t in ids])})


def build_engine(inst: InstanceSpec, model_dir: Path) -> VllmEngine:
    from pdd.model.loader import read_model_config

    return VllmEngine.build(model_dir, inst.engine, read_model_config(model_dir),
                            connector=inst.role != Role.COLOCATED)
