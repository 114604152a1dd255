"""Which leading blocks of a token list vLLM's prefix cache holds.

vLLM keys its prefix cache by its own chained block hashes (its configured
hash function over (parent hash, block token ids, extra keys)); our wire
protocol names blocks by our hashes (pdd.engine.hashing). Both chain over
the same token ids at the same block size, so block i of a prompt is the
same content under either name: we ask vLLM with its hash, and speak ours on
the wire. Plain text requests have no extra keys (no LoRA, multimodal input
or cache salt, none of which the instance API passes).
"""

from __future__ import annotations

from typing import Sequence


class VllmPrefixIndex:
    def __init__(self, engine_core, block_size: int):
        from vllm.utils.hashing import get_hash_fn_by_name

        self._core = engine_core
        self.block_size = block_size
        self._hash_fn = get_hash_fn_by_name(engine_core.vllm_config.cache_config.prefix_caching_hash_algo)

    def vllm_hashes(self, token_ids: Sequence[int]) -> list[bytes]:
        """vLLM's hashes of the full blocks of `token_ids` (after the engine set its NONE_HASH)."""
        from vllm.v1.core.kv_cache_utils import hash_block_tokens

        out, parent, bs = [], None, self.block_size
        for i in range(len(token_ids) // bs):
            parent = hash_block_tokens(self._hash_fn, parent, tuple(token_ids[i * bs:(i + 1) * bs]), None)
            out.append(parent)
        return out

    def cached_blocks(self, token_ids: Sequence[int]) -> list[int]:
        """vLLM block ids of the longest cached prefix of `token_ids`, in order.

        A dict lookup per block; read without the engine thread, so it may be
        one step stale (a routing hint, as our engine's match)."""
        return [b.block_id for b in self.cached_block_objects(token_ids)]

    def cached_block_objects(self, token_ids: Sequence[int]) -> list:
        """vLLM's KVCacheBlocks of that prefix (on the engine thread: to pin them)."""
        pool = self._core.scheduler.kv_cache_manager.block_pool
        out = []
        for h in self.vllm_hashes(token_ids):
            blocks = pool.get_cached_block(h, [0])
            if not blocks:
                break
            out.append(blocks[0])
        return out

    def matched_tokens(self, token_ids: Sequence[int]) -> int:
        return len(self.cached_blocks(token_ids)) * self.block_size
