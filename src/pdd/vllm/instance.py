"""An instance process whose engine is vLLM (`pdd serve` of a vLLM deployment).

The HTTP side is our InstanceServer unchanged (signed internal API, NDJSON
token streams, /metrics, /internal/steps); EngineLoop drives a VllmEngine on
its thread as it drives our Engine. What differs is answered here:
`match` asks vLLM's prefix cache.

Roles: colocated runs. prefill / decode / relay / main need the PDD KV
connector (pdd.vllm.connector, in progress) and are refused at start with a
clear error until it moves KV.
"""

from __future__ import annotations

import logging
from pathlib import Path

from aiohttp import web

from pdd.deploy.spec import DeploymentSpec, InstanceSpec, Role
from pdd.server.instance import InstanceServer
from pdd.vllm.engine import VllmEngine
from pdd.vllm.prefix import VllmPrefixIndex

log = logging.getLogger(__name__)

SUPPORTED_ROLES = frozenset({Role.COLOCATED})


class VllmInstanceServer(InstanceServer):
    def __init__(self, spec: DeploymentSpec, inst: InstanceSpec, secret: bytes, engine: VllmEngine,
                 tls_dir: Path | None = None):
        super().__init__(spec, inst, secret, engine, tls_dir)
        self.prefix = VllmPrefixIndex(engine.llm.engine_core.engine_core, engine.cfg.block_size)

    async def match(self, request: web.Request) -> web.Response:
        ids = (await request.json()).get("prompt_ids", [])
        return web.json_response({"matched_tokens": self.prefix.matched_tokens([int(t) for t in ids])})


def build_engine(inst: InstanceSpec, model_dir: Path) -> VllmEngine:
    from pdd.model.loader import read_model_config

    if inst.role not in SUPPORTED_ROLES:
        raise SystemExit(f"{inst.name}: role {inst.role.value} on the vLLM backend needs the PDD KV connector, "
                         f"which is not finished; the vLLM backend serves "
                         f"{sorted(r.value for r in SUPPORTED_ROLES)} for now")
    return VllmEngine.build(model_dir, inst.engine, read_model_config(model_dir))
