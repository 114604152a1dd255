"""Which instance of a pool gets a request: cache affinity against load.

score = prefill tokens the instance's prefix cache saves
        - penalty_tokens_per_running * running
        - penalty_tokens_per_waiting * waiting
        - penalty_tokens_kv_full     * KV used fraction

Everything is in tokens, so a 50K-token cached prefix outweighs a few queued
requests while a 500-token one does not. Ties go to the smallest instance_id,
so replaying the same views always yields the same choice (router and
simulator alike). The same function routes over P (saved prefill compute),
MD (saved WAN bytes, which scale with tokens) and RLD (no cache affinity:
the matched map is empty and only load counts).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pdd.policy.config import PolicyConfig
from pdd.policy.views import InstanceView


def load_penalty_tokens(inst: InstanceView, cfg: PolicyConfig) -> float:
    return (cfg.penalty_tokens_per_running * inst.num_running
            + cfg.penalty_tokens_per_waiting * inst.num_waiting
            + cfg.penalty_tokens_kv_full * inst.kv_used_fraction)


def score_instance(inst: InstanceView, num_matched_tokens: int, num_prompt_tokens: int,
                   cfg: PolicyConfig) -> float:
    saved = min(max(num_matched_tokens, 0), num_prompt_tokens)
    return saved - load_penalty_tokens(inst, cfg)


def pick_instance(candidates: Sequence[InstanceView], matched_tokens: Mapping[str, int],
                  num_prompt_tokens: int, now: float, cfg: PolicyConfig) -> str:
    """The instance_id with the best score; raises ValueError on an empty pool.

    `now` is taken for uniformity with the other policy calls (a view older
    than some bound could be discounted); the score does not use it today.
    """
    del now
    if not candidates:
        raise ValueError("pick_instance: no candidate instances")
    best = min(
        candidates,
        key=lambda i: (-score_instance(i, matched_tokens.get(i.instance_id, 0),
                                       num_prompt_tokens, cfg),
                       i.instance_id),
    )
    return best.instance_id


def wait_for_siblings(num_lacking_blocks: int, num_arriving_blocks: int, cfg: PolicyConfig) -> bool:
    """A receiver lacks `num_lacking_blocks` of a transfer's blocks and another
    transfer in flight is bringing `num_arriving_blocks` of them: hold the
    HAVE answer until that one ends when it brings at least
    `sibling_wait_min_fraction` of them (DRC under a slow line: a follow-up
    turn sent while its predecessor's copy still crosses would otherwise send
    the whole shared context again, and the line's backlog feeds on itself)."""
    if num_lacking_blocks < 0 or num_arriving_blocks < 0:
        raise ValueError("wait_for_siblings: negative block counts")
    if cfg.sibling_wait_min_fraction <= 0 or num_lacking_blocks == 0 or num_arriving_blocks == 0:
        return False
    return num_arriving_blocks >= cfg.sibling_wait_min_fraction * num_lacking_blocks
