"""Continuous-batching scheduler: pure policy over ints and lists.

Two verbs, as in nano-vllm: `schedule()` builds a StepPlan (which requests
compute how many tokens this step, under a token budget), and
`postprocess(plan)` advances their state once the runner has executed it.
An urgent request (a handoff's final extend, `Engine.extend(final=True)`:
the user's stream stalls until it samples) gets a step of its own, at once.
Otherwise decodes go first (to protect time per output token). The rest of the budget
goes to prompt work, shortest remaining first: running prefill / extend
chunks and waiting requests (admitted with their longest cached prefix)
alike, ordered by the tokens they still have to compute (ties by arrival).
So a warm follow-up that computes a few dozen tokens is not queued behind a
cold prompt's seconds of chunks. A step that completes prompts takes more
prompt work only as far as they can wait for it (`pdd.policy.step_packing`,
shared with the simulator): on a CPU a step's time grows with its tokens,
so a longer prompt's chunk, even its last, would make the short prompts
wait for it; it runs in the next step without them (it waits only while
short prompts keep arriving, which they do at far less than the budget). When blocks run out, the
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
from pdd.policy.step_packing import joins_step


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
        self._hashes: dict[str, tuple[int, list[bytes]]] = {}   # waiting request -> (tokens, block hashes)

    # -- membership ---------------------------------------------------------
    def add(self, req: EngineRequest) -> None:
        self.waiting.append(req)

    def remove(self, req: EngineRequest, keep_blocks: bool = False) -> None:
        """Take a request out (finished or aborted); release its blocks unless kept."""
        self._hashes.pop(req.request_id, None)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if req.block_ids and not keep_blocks:
            self.pool.free(req.block_ids)
            req.block_ids, req.block_hashes = [], []

    @property
    def has_work(self) -> bool:
        return bool(self.waiting) or any(r.num_uncomputed > 0 and r.status is not RequestStatus.HELD
                                         for r in self.running)

    # -- schedule -------------------------------------------------------------
    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.cfg.max_num_batched_tokens
        in_plan: set[str] = set()
        # A handoff's final extend runs alone: the user's stream is stalled
        # until it samples, while the others lose one short step (a lone
        # 1-2-token extend costs a fraction of a batched step here).
        # So does one still waiting to be admitted: MD's request is submitted
        # when its KV lands, and the final batch, sent on the router's
        # `kv_ready`, often finds it not yet admitted (the simulator, too,
        # runs it alone).
        urgent = [r for r in self.running if r.urgent and r.num_uncomputed > 0]
        urgent_waiting = [r for r in self.waiting if r.urgent]
        if urgent or urgent_waiting:
            for req in sorted(urgent, key=lambda r: r.arrival_s):
                need, before = req.num_uncomputed, budget
                budget = self._run(req, budget, in_plan, plan)
                if before - budget >= need:
                    req.urgent = False          # all of it is in this step
            for req in sorted(urgent_waiting, key=lambda r: r.arrival_s):
                if budget <= 0 or len(self.running) >= self.cfg.max_num_seqs:
                    break
                n = self._admit(req, budget)
                if n is None:
                    break                       # no blocks now: the normal path decides
                self._start(req, n, in_plan, plan)
                budget -= n
                if req.num_computed_tokens + n == req.num_tokens:
                    req.urgent = False
            if plan.seqs:
                return plan
        decodes = sorted((r for r in self.running if r.num_uncomputed == 1 and r.status is not RequestStatus.HELD),
                         key=lambda r: r.arrival_s)
        for req in decodes:
            budget = self._run(req, budget, in_plan, plan)
        # Prompt work, shortest remaining first: running chunks and waiting requests.
        work = [(r.num_uncomputed, r.arrival_s, 0, k, r) for k, r in enumerate(self.running)
                if r.num_uncomputed > 1]
        work += [(self._remaining_estimate(r), r.arrival_s, 1, k, r) for k, r in enumerate(self.waiting)]
        admitting, completing = True, 0
        full = self.cfg.max_num_batched_tokens
        for remaining, _, waiting, _, req in sorted(work, key=lambda w: w[:4]):
            # A step that ends prompts takes no more than they can wait for.
            if not joins_step(remaining, budget, full - budget, completing,
                              self.cfg.step_overhead_tokens):
                break
            if not waiting:
                before = budget
                budget = self._run(req, budget, in_plan, plan)
                completing += int(before - budget == remaining)
                continue
            if not admitting or len(self.running) >= self.cfg.max_num_seqs or req not in self.waiting:
                continue
            n = self._admit(req, budget)
            if n is None:
                if not self.running and not plan.seqs:   # alone and still does not fit
                    self.waiting.remove(req)
                    req.error = (
                        f"request needs {_blocks_for(req.num_tokens, self.pool.block_size)} KV blocks,"
                        f" the pool has {self.pool.num_blocks}"
                    )
                    plan.failed.append(req)
                    continue
                admitting = False      # no blocks now: later ones do not overtake it
                continue
            self._start(req, n, in_plan, plan)
            budget -= n
            completing += int(req.num_computed_tokens + n == req.num_tokens)
        return plan

    def _start(self, req: EngineRequest, n: int, in_plan: set[str], plan: StepPlan) -> None:
        """An admitted request joins the running ones with its first n tokens in this step."""
        self.waiting.remove(req)
        self._hashes.pop(req.request_id, None)
        self.running.append(req)
        req.status = RequestStatus.RUNNING
        plan.seqs.append(self._seq(req, n))
        in_plan.add(req.request_id)

    def _run(self, req: EngineRequest, budget: int, in_plan: set[str], plan: StepPlan) -> int:
        """Schedule up to `budget` tokens of a running request; returns the budget left."""
        if budget == 0 or req.request_id in plan.preempted or req not in self.running:
            return budget
        n = min(req.num_uncomputed, budget)
        if not self._grow(req, req.num_computed_tokens + n, in_plan, plan):
            return budget
        plan.seqs.append(self._seq(req, n))
        in_plan.add(req.request_id)
        return budget - n

    def _remaining_estimate(self, req: EngineRequest) -> int:
        """Tokens a waiting request would compute: its tokens less the cached prefix."""
        cached = len(self.pool.lookup_prefix(self._block_hashes(req))) * self.pool.block_size
        return req.num_tokens - min(cached, req.num_tokens - 1)

    def _block_hashes(self, req: EngineRequest) -> list[bytes]:
        """The full blocks' hashes of a waiting request, computed once per token count."""
        known = self._hashes.get(req.request_id)
        if known is None or known[0] != req.num_tokens:
            known = self._hashes[req.request_id] = (
                req.num_tokens, hash_blocks(req.token_ids, self.pool.block_size, self.namespace))
        return known[1]

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
        hashes = self._block_hashes(req)
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
