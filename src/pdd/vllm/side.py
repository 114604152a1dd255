"""KV kept in vLLM's prefix cache: side requests and HAVE pins.

Our engine commits landed blocks to its prefix cache as they land and
computes a held request's catch-up batches as they come. vLLM owns its
blocks, so both go through requests of ours whose output nobody reads
("side requests", max_tokens=1, ids `<pdd id>#side<n>`):
  ABSORB   a landed copy no request consumes (a warm push, a request that
           ended on RLD, a decode call that went away): prompt = the tokens
           it covers + one filler token, the staged blocks loaded by the
           connector; vLLM computes the filler (and any gap) and keeps
           every full block in its prefix cache.
  CATCH_UP a held request's catch-up batch: prompt = every token known so
           far; the staged prompt blocks load, vLLM computes the rest, and
           the final extend then finds all but the last partial block cached.
A side request's owner keeps its staged blocks and pins until it ends.

Pins: the blocks a receiver reported as HAVE are held (vLLM's own reference
count, `BlockPool.touch`) until the request relying on them has run or is
gone, so an eviction between HAVE and use cannot lose them. Should one be
lost anyway, the connector loads up to the gap and vLLM recomputes the rest.

Lifecycle of a side request: launch (add_request, RUNNING in vLLM) ->
vLLM finishes it after one sampled token -> finished(): the owner's record.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class SideKind(enum.Enum):
    ABSORB = "absorb"
    CATCH_UP = "catch_up"


# Any in-vocabulary token: the filler after an absorbed copy's full blocks,
# so vLLM computes one token instead of the copy's last block.
FILLER_TOKEN = 0


@dataclass
class SideRequest:
    owner: str            # our request id (its staging and pins)
    kind: SideKind
    upto: int             # CATCH_UP: the owner's outputs computed once it ends


class SideRequests:
    def __init__(self, llm):
        self.llm = llm
        self.live: dict[str, SideRequest] = {}       # vLLM request id -> side request
        self._num_launched = 0

    def launch(self, owner: str, token_ids: list[int], kind: SideKind, upto: int = 0) -> str:
        """Add a one-token vLLM request over `token_ids`; what the receiver
        staged for `owner` is loaded through the connector."""
        from pdd.vllm.args import one_token_sampling
        from pdd.vllm.connector import HUB, LOAD

        vid = f"{owner}#side{self._num_launched}"
        self._num_launched += 1
        kv = {"pdd_id": owner, "pdd_role": LOAD} if owner in HUB.staged else None
        self.llm.add_request(vid, {"prompt_token_ids": list(token_ids)}, one_token_sampling(kv))
        self.live[vid] = SideRequest(owner, kind, upto)
        return vid

    def finished(self, vid: str) -> SideRequest | None:
        return self.live.pop(vid, None)

    def owns(self, owner: str) -> bool:
        return any(s.owner == owner for s in self.live.values())

    def catching_up(self, owner: str) -> bool:
        return any(s.owner == owner and s.kind is SideKind.CATCH_UP for s in self.live.values())

    def abort_owner(self, owner: str, kind: SideKind) -> None:
        vids = [v for v, s in self.live.items() if s.owner == owner and s.kind is kind]
        if vids:
            self.llm.abort_request(vids)


class BlockPins:
    """vLLM prefix-cache blocks held for a request (HAVE until use)."""

    def __init__(self, scheduler_of, prefix):
        self._scheduler_of = scheduler_of        # () -> vLLM's scheduler (read when used)
        self._prefix = prefix
        self.pins: dict[str, list] = {}         # our request id -> vLLM KVCacheBlocks

    def pin_cached(self, owner: str, token_ids: list[int]) -> int:
        """Hold the longest cached prefix of `token_ids` for `owner`; the number of blocks."""
        blocks = self._prefix.cached_block_objects(token_ids)
        if blocks:
            self._scheduler_of().kv_cache_manager.block_pool.touch(blocks)
            self.pins.setdefault(owner, []).extend(blocks)
        return len(blocks)

    def release(self, owner: str) -> None:
        blocks = self.pins.pop(owner, None)
        if blocks:
            # the chain's tail first: evicted before its head, as vLLM frees
            self._scheduler_of().kv_cache_manager.block_pool.free_blocks(list(reversed(blocks)))

    @property
    def num_pinned(self) -> int:
        return sum(len(b) for b in self.pins.values())
