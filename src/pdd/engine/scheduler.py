"""Continuous-batching scheduler: pure policy over ints and lists.

Two verbs, as in nano-vllm: `schedule()` builds a StepPlan (which requests
compute how many tokens this step, under a token budget), and
`postprocess(plan)` advances their state once the runner has executed it.
Running requests go first (decodes before prefill chunks, to protect time per
output token); waiting requests are admitted with their longest cached prefix
while budget, sequence slots and KV blocks allow. When blocks run out, the
most recently admitted request not yet in this step is preempted and later
recomputed (its tokens are kept, so the output does not change).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pdd.engine.block_pool import BlockPool
from pdd.engine.config import EngineConfig
from pdd.engine.hashing import hash_block, hash_blocks
from pdd.engine.request import EngineRequest, RequestStatus


@dataclass
class ScheduledSeq:
    request: EngineRequest
    start: int          # first position computed this step
    num_tokens: int     # tokens computed this step
    sample: bool        # sample the next token after this step


@dataclass
class StepPlan:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    failed: list[EngineRequest] = field(default_factory=list)   # cannot fit, ever

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)

    @property
    def empty(self) -> bool:
        return not self.seqs


def _blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class Scheduler:
    def __init__(self, cfg: EngineConfig, pool: BlockPool, namespace: bytes):
        self.cfg = cfg
        self.pool = pool
        self.namespace = namespace
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0

    # -- membership ---------------------------------------------------------
    def add(self, req: EngineRequest) -> None:
        self.waiting.append(req)

    def remove(self, req: EngineRequest, keep_blocks: bool = False) -> None:
        """Take a request out (finished or aborted); release its blocks unless kept."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if req.block_ids and not keep_blocks:
            self.pool.free(req.block_ids)
            req.block_ids, req.block_hashes = [], []

    @property
    def has_work(self) -> bool:
        return bool(self.waiting) or any(r.num_uncomputed > 0 for r in self.running)

    # -- schedule -------------------------------------------------------------
    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.cfg.max_num_batched_tokens
        in_plan: set[str] = set()
        order = sorted(
            (r for r in self.running if r.num_uncomputed > 0),
            key=lambda r: (r.num_uncomputed > 1, r.arrival_s),
        )
        for req in order:
            if budget == 0:
                break
            if req.request_id in plan.preempted:
                continue
            n = min(req.num_uncomputed, budget)
            if not self._grow(req, req.num_computed_tokens + n, in_plan, plan):
                continue
            plan.seqs.append(self._seq(req, n))
            in_plan.add(req.request_id)
            budget -= n
        while budget > 0 and self.waiting and len(self.running) < self.cfg.max_num_seqs:
            req = self.waiting[0]
            n = self._admit(req, budget)
            if n is None:
                if not self.running and not plan.seqs:   # alone and still does not fit
                    self.waiting.popleft()
                    req.error = (
                        f"request needs {_blocks_for(req.num_tokens, self.pool.block_size)} KV blocks,"
                        f" the pool has {self.pool.num_blocks}"
                    )
                    plan.failed.append(req)
                    continue
                break
            self.waiting.popleft()
            self.running.append(req)
            req.status = RequestStatus.RUNNING
            plan.seqs.append(self._seq(req, n))
            in_plan.add(req.request_id)
            budget -= n
        return plan

    def _seq(self, req: EngineRequest, n: int) -> ScheduledSeq:
        done = req.num_computed_tokens + n == req.num_tokens
        return ScheduledSeq(req, req.num_computed_tokens, n, sample=done and not req.hold)

    def _grow(self, req: EngineRequest, upto: int, in_plan: set[str], plan: StepPlan) -> bool:
        """Make sure req has blocks for `upto` tokens, preempting others if needed."""
        need = _blocks_for(upto, self.pool.block_size) - len(req.block_ids)
        while need > 0 and not self.pool.can_allocate(need):
            victim = next(
                (r for r in reversed(self.running) if r is not req and r.request_id not in in_plan),
                None,
            )
            if victim is None:
                self._preempt(req, plan)
                return False
            self._preempt(victim, plan)
        if need > 0:
            req.block_ids += self.pool.allocate(need)
        return True

    def _preempt(self, req: EngineRequest, plan: StepPlan) -> None:
        self.running.remove(req)
        if req.block_ids:
            self.pool.free(req.block_ids)
        req.block_ids, req.block_hashes = [], []
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        plan.preempted.append(req.request_id)

    def _admit(self, req: EngineRequest, budget: int) -> int | None:
        """Attach the longest cached prefix and blocks for the first chunk.
        Returns the number of tokens to compute now, or None if it cannot fit yet."""
        bs = self.pool.block_size
        hashes = hash_blocks(req.token_ids, bs, self.namespace)
        cached = self.pool.lookup_prefix(hashes)
        if len(cached) * bs >= req.num_tokens:   # keep >= 1 token to compute for logits
            cached = cached[:-1]
        num_cached = len(cached) * bs
        n = min(req.num_tokens - num_cached, budget)
        need = _blocks_for(num_cached + n, bs) - len(cached)
        reclaimed = sum(1 for b in cached if self.pool.ref_counts[b] == 0)
        if not self.pool.can_allocate(need + reclaimed):
            return None
        self.pool.acquire(cached)
        req.block_ids = cached + self.pool.allocate(need)
        req.block_hashes = hashes[: len(cached)]
        req.num_computed_tokens = num_cached
        if req.num_preemptions == 0:
            req.num_cached_tokens = min(num_cached, req.num_prompt_tokens)
            self.prefix_query_tokens += req.num_prompt_tokens
            self.prefix_hit_tokens += req.num_cached_tokens
        return n

    # -- postprocess ----------------------------------------------------------
    def postprocess(self, plan: StepPlan) -> None:
        bs = self.pool.block_size
        for s in plan.seqs:
            req = s.request
            req.num_computed_tokens += s.num_tokens
            parent = req.block_hashes[-1] if req.block_hashes else None
            for i in range(len(req.block_hashes), req.num_computed_tokens // bs):
                parent = hash_block(parent, req.token_ids[i * bs : (i + 1) * bs], self.namespace)
                self.pool.commit(req.block_ids[i], parent)
                req.block_hashes.append(parent)
            if req.num_uncomputed == 0 and req.hold:
                req.status = RequestStatus.HELD
