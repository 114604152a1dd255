"""The PDD KV connector: vLLM's KV blocks in and out through our transport.

vLLM runs in the instance's own process (VLLM_ENABLE_V1_MULTIPROCESSING=0,
one worker), so both halves of the connector (the scheduler's and the
worker's) and our instance server share one `ConnectorHub`: the connector
decides *which* vLLM blocks are held or loaded, the server moves their bytes
with our KV sender and receiver (BEGIN / HAVE / BLOCK / END). Registered
through `kv_connector_module_path`; no fork or patch of vLLM.

A request takes part through its `kv_transfer_params` (vLLM's per-request
channel for connectors): {"pdd_id": our request id, "pdd_role": "hold" |
"load"}. vLLM renames requests internally; `pdd_id` is how we find them.

Prefill side ("hold"), lifecycle of a prompt's blocks:
    finished (max_tokens=1) -> request_finished: delay the free, record the
    block ids under pdd_id (HELD) -> the server reads whole blocks for each
    target -> release(pdd_id) -> the worker reports it finished_sending on
    its next step -> vLLM frees the blocks (they stay in its prefix cache).
Decode side ("load"): the server stages the blocks that landed, in prompt
order, before it submits the request (prompt + tokens made elsewhere);
get_num_new_matched_tokens reports the staged full blocks past vLLM's own
prefix hit as external, loaded synchronously at the start of the step that
computes the rest (the partial block, the first token, an extend's eager
tokens) in one pass. Whole blocks only: the CPU cache's block interior is
per head, K rows then V rows, so bytes are copied block for block.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole,
)

HOLD, LOAD = "hold", "load"


class ConnectorHub:
    """Per-process state shared by the two connector halves and the server."""

    def __init__(self):
        self.lock = threading.Lock()
        self.kv_caches: list[torch.Tensor] = []     # per layer, in registration order
        self.block_dim = 1                          # which dim of a layer's tensor counts blocks
        self.held: dict[str, list[int]] = {}        # pdd_id -> block ids kept after the request finished
        self.vllm_ids: dict[str, str] = {}          # pdd_id -> vLLM's internal request id
        self.to_free: set[str] = set()              # vLLM ids whose held blocks may go now
        self.staged: dict[str, list[bytes | None]] = {}   # pdd_id -> payload per leading full block
        self.loaded_blocks: dict[str, int] = {}     # pdd_id -> blocks loaded from staging (for tests, traces)

    # -- worker side: bytes of whole blocks ------------------------------------------
    def register(self, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        self.kv_caches = list(kv_caches.values())
        shape = self.kv_caches[0].shape
        # The CPU backend's layout is [2, blocks, heads, block_size, head_dim]
        # (K/V outermost); other backends put blocks first. Find the dim.
        self.block_dim = next(d for d, n in enumerate(shape) if n == num_blocks)

    def read_block(self, block_id: int) -> bytes:
        # every layer's slab of this block, K and V, in layer order
        parts = [kv.select(self.block_dim, block_id).contiguous().view(torch.uint8).reshape(-1)
                 for kv in self.kv_caches]
        return torch.cat(parts).numpy().tobytes()

    def write_block(self, block_id: int, payload: bytes) -> None:
        src = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        off = 0
        for kv in self.kv_caches:
            dst = kv.select(self.block_dim, block_id)
            n = dst.numel() * dst.element_size()
            if off + n > src.numel():
                raise ValueError(f"KV block payload of {src.numel()} bytes is shorter than this cache's blocks")
            dst.copy_(src[off:off + n].view(kv.dtype).view(dst.shape))
            off += n
        if off != src.numel():
            raise ValueError(f"KV block payload of {src.numel()} bytes does not fit this cache's blocks ({off})")

    @property
    def block_bytes(self) -> int:
        return sum(kv.select(self.block_dim, 0).numel() * kv.element_size() for kv in self.kv_caches)

    # -- server side ---------------------------------------------------------------------
    def release(self, pdd_id: str) -> bool:
        """The held blocks of a finished prompt may be freed (at vLLM's next step)."""
        with self.lock:
            if self.held.pop(pdd_id, None) is None:
                return False
            self.to_free.add(self.vllm_ids.pop(pdd_id))
            return True

    def stage(self, pdd_id: str, payloads: list[bytes | None]) -> None:
        with self.lock:
            self.staged[pdd_id] = payloads

    def unstage(self, pdd_id: str) -> None:
        with self.lock:
            self.staged.pop(pdd_id, None)

    @property
    def has_pending_frees(self) -> bool:
        return bool(self.to_free)


HUB = ConnectorHub()


def kv_transfer_config():
    """vLLM's KVTransferConfig that loads this connector."""
    from vllm.config import KVTransferConfig

    return KVTransferConfig(kv_connector="PddConnector", kv_connector_module_path=__name__, kv_role="kv_both",
                            kv_load_failure_policy="recompute")


@dataclass
class PddConnectorMetadata(KVConnectorMetadata):
    loads: list[tuple[int, bytes]] = field(default_factory=list)   # (vLLM block id, payload)


def _params(request) -> dict[str, Any]:
    return request.kv_transfer_params or {}


class PddConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self.block_size = vllm_config.cache_config.block_size
        self.hub = HUB
        self._num_blocks = kv_cache_config.num_blocks if kv_cache_config is not None else None
        self._plans: dict[str, list[tuple[int, bytes]]] = {}   # vLLM id -> (block index, payload) to load
        self._loads: list[tuple[int, bytes]] = []

    # -- scheduler side ------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        p = _params(request)
        if p.get("pdd_role") != LOAD:
            return 0, False
        with self.hub.lock:
            staged = self.hub.staged.get(p["pdd_id"], [])
        first = num_computed_tokens // self.block_size
        plan = []
        for i in range(first, len(staged)):
            if staged[i] is None:
                break          # a gap: vLLM computes from here on
            plan.append((i, staged[i]))
        # Never the whole request: vLLM must compute at least one token
        # (a full external hit trips its scheduler on the synchronous path).
        while plan and (first + len(plan)) * self.block_size >= request.num_tokens:
            plan.pop()
        self._plans[request.request_id] = plan
        return len(plan) * self.block_size, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        plan = self._plans.pop(request.request_id, [])
        if num_external_tokens == 0 or not plan:
            return
        block_ids = blocks.get_block_ids()[0]
        self._loads += [(block_ids[i], payload) for i, payload in plan]
        pid = _params(request)["pdd_id"]
        with self.hub.lock:
            self.hub.loaded_blocks[pid] = self.hub.loaded_blocks.get(pid, 0) + len(plan)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta, self._loads = PddConnectorMetadata(self._loads), []
        return meta

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        p = _params(request)
        self._plans.pop(request.request_id, None)
        if p.get("pdd_role") != HOLD or not block_ids:
            return False, None
        with self.hub.lock:
            self.hub.held[p["pdd_id"]] = list(block_ids)
            self.hub.vllm_ids[p["pdd_id"]] = request.request_id
        return True, None

    def has_pending_block_frees(self) -> bool:
        return self.hub.has_pending_frees

    # -- worker side ---------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        num_blocks = self._vllm_config.cache_config.num_gpu_blocks or self._num_blocks
        self.hub.register(kv_caches, num_blocks)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        if not self.has_connector_metadata():
            return
        for block_id, payload in self._get_connector_metadata().loads:
            self.hub.write_block(block_id, payload)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return      # P's blocks stay where they are until released; nothing is saved per layer

    def wait_for_save(self) -> None:
        return

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        with self.hub.lock:
            done, self.hub.to_free = self.hub.to_free, set()
        return (done or None), None
