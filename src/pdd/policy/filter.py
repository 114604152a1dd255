"""Abnormal-traffic filter: requests RLD finishes before MD could take over.

A very long input with a very short output (about 3-4% of agentic traffic)
is the worst case for the WAN: the biggest transfer, for a request RLD will
have finished before the KV lands. For those the transfer is never started
(`predict_abnormal`, at routing time, from max_tokens, an upper bound on the
output, so a wrong "abnormal" guess only errs towards less RLD work than
predicted) or cancelled while in flight (`should_cancel_wan`, from live
progress). RLD then runs the request to the end.

Warming MD's cache with a skipped prefix later: only a *hot shared* prefix
(`warm_tokens_after_cancel`). A private prefix is not pushed speculatively:
if a later turn of the same conversation needs it on MD, that request's own
pipeline moves it (and DRC keeps it from then on), while pushing it now
would spend WAN bandwidth, which is scarcest exactly when long low-hit
transfers queue, on bytes that may never be read. A prefix P has already
seen reused by several requests (system prompt, tool schemas) is different:
every future sharer would pay its transfer latency, so warming its shared,
block-aligned part in the background pays off.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

from pdd.policy.config import PolicyConfig
from pdd.policy.views import RequestFacts


def predict_abnormal(req: RequestFacts, est_wan_s: float, rld_tpot_s: float,
                     cfg: PolicyConfig) -> bool:
    """True when RLD's whole output (with margin) ends before the WAN copy would land."""
    if rld_tpot_s <= 0:
        raise ValueError("rld_tpot_s must be > 0")
    if not cfg.enable_filter:
        return False
    rld_finish_s = req.max_tokens * rld_tpot_s
    return rld_finish_s * cfg.filter_margin <= est_wan_s


def should_cancel_wan(now: float, tokens_left: int, est_remaining_wan_s: float,
                      rld_tpot_s: float, cfg: PolicyConfig | None = None) -> bool:
    """Live check while a WAN transfer is in flight and RLD is decoding.

    `tokens_left` is an upper bound (max_tokens - generated). Cancelling is
    right when RLD ends first even when stretched by the filter margin.
    `now` is part of the contract for symmetry; the rule is time-invariant.
    """
    del now
    cfg = cfg or PolicyConfig()
    if tokens_left < 0 or est_remaining_wan_s < 0 or rld_tpot_s <= 0:
        raise ValueError("should_cancel_wan: negative tokens/time or non-positive tpot")
    if not cfg.enable_filter:
        return False
    return tokens_left * rld_tpot_s * cfg.filter_margin <= est_remaining_wan_s


def warm_tokens_after_cancel(num_shared_prefix_tokens: int, num_prefix_reuses: int,
                             block_size: int, cfg: PolicyConfig) -> int:
    """Tokens of a skipped request's prefix worth warming on MD later (0 = none).

    `num_shared_prefix_tokens` is the part P already held before this request
    (its matched prefix: shared with earlier requests); `num_prefix_reuses`
    how many requests P has seen reuse it. Only whole blocks travel.
    """
    if block_size <= 0 or num_shared_prefix_tokens < 0 or num_prefix_reuses < 0:
        raise ValueError("warm_tokens_after_cancel: bad arguments")
    if not cfg.enable_drc or num_prefix_reuses < cfg.warm_min_prefix_reuses:
        return 0
    return num_shared_prefix_tokens // block_size * block_size


def warm_after_skip(p_matched_tokens: int, md_matched_tokens: int, num_prefix_reuses: int,
                    block_size: int, cfg: PolicyConfig) -> int:
    """Tokens of a request kept off the WAN (RELAY_ONLY) to push to MD anyway.

    Only the hot shared prefix (`warm_tokens_after_cancel`), and only what MD
    does not already hold; 0 means nothing to send. A transfer cancelled
    mid-flight needs no such step: blocks travel in order, so the prefix it
    carried is already in MD's cache.
    """
    warm = warm_tokens_after_cancel(p_matched_tokens, num_prefix_reuses, block_size, cfg)
    held = max(md_matched_tokens, 0) // block_size * block_size
    return warm if warm > held else 0


class PrefixReuseCounter:
    """How many requests have arrived with each shared prefix (bounded, LRU).

    Keys are whatever identifies a block-aligned prefix to the caller (a hash
    of its token ids in the router, a chained block id in the simulator).
    """

    def __init__(self, capacity: int = 4096) -> None:
        if capacity <= 0:
            raise ValueError("capacity must be > 0")
        self.capacity = capacity
        self._counts: OrderedDict[Hashable, int] = OrderedDict()

    def seen(self, key: Hashable) -> int:
        """Count one more request with this prefix; return how many came before it."""
        before = self._counts.pop(key, 0)
        self._counts[key] = before + 1
        while len(self._counts) > self.capacity:
            self._counts.popitem(last=False)
        return before
