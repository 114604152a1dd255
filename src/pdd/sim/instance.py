"""One simulated serving instance: continuous batching, chunked prefill.

Each step carries one token for every decoding sequence plus prefill /
extend chunks, first come first served (or, `short_first`, shortest
remaining first as our engine's scheduler), up to `token_budget` tokens; a job
whose remainder is smaller than the budget left yields a small *tail chunk*,
which is where the report's bathtub valleys come from; with packing the tail
shares its step with the next job's head, with `single_chunk` it runs alone.
Steps are timed by the cost model. A run of decode-only steps with a stable batch is simulated as
one *macro step* (up to `max_macro_steps`), which a new piece of work
truncates at the next step boundary, so the result equals step-by-step
simulation while the event count drops by that factor.

KV memory is counted in blocks, like a paged-KV engine's: a request's
prompt blocks that the prefix cache holds are *shared* with it (pinned,
counted once), its other blocks are private; the cache may use whatever no
request holds privately (capacity = blocks - private), and its unpinned
blocks are free for the taking (LRU eviction).
"""

from __future__ import annotations

import bisect
import random
from collections import deque
from dataclasses import dataclass, field
from enum import Enum

from pdd.policy import InstanceView, Role
from pdd.policy.step_packing import STEP_OVERHEAD_TOKENS, joins_step
from pdd.policy.views import prefill_attention, prefill_compute_s
from pdd.sim.calibration_steps import role_group
from pdd.sim.cost_model import CostModel, chunk_pairs, row_bucket
from pdd.sim.prefill_meter import PrefillMeter
from pdd.sim.prefix_cache import PrefixCache
from pdd.sim.request import SimRequest


class JobKind(Enum):
    PREFILL = "prefill"
    EXTEND = "extend"


class Job:
    __slots__ = ("req", "kind", "num_tokens", "done", "ctx_start", "num_blocks", "started", "data",
                 "shared", "last_chunk")

    def __init__(self, req: SimRequest, kind: JobKind, num_tokens: int, ctx_start: int,
                 num_blocks: int, data=None) -> None:
        self.req, self.kind, self.num_tokens = req, kind, num_tokens
        # num_blocks: all the job needs; once started, only its private part
        # (shared prompt blocks are pinned in the cache, listed in `shared`).
        self.done, self.ctx_start, self.num_blocks = 0, ctx_start, num_blocks
        self.started = num_blocks == 0
        self.data = data
        self.shared: list[int] = []
        self.last_chunk = 0          # tokens of its latest chunk (a streamed transfer's tail)


class Seq:
    """A request's decoding presence on an instance."""

    __slots__ = ("req", "context", "stop_at", "decoding", "num_blocks", "relay", "shared", "removed",
                 "first", "next_index", "single")

    def __init__(self, req: SimRequest, context: int, num_blocks: int, relay: bool,
                 decoding: bool = True, shared: list[int] | None = None) -> None:
        # num_blocks: private blocks; `shared`: cached blocks pinned for it.
        self.req, self.context, self.num_blocks = req, context, num_blocks
        self.relay, self.decoding = relay, decoding
        self.stop_at: int | None = None
        self.shared = shared or []
        self.removed = False
        # Tokens its first step computes: 1, or the prompt's partial last
        # block + P's first token when only whole blocks crossed
        # (`DecodersMixin._first_step_tokens`).
        self.first = 1
        # The output index of the token its next step makes (RLD and MD each
        # count their own: after a handoff MD continues at stop_at).
        self.next_index = req.num_generated
        # Step by step (no macro steps) while its tokens race another
        # decoder's: an overlap or paced handoff's MD (the driver sets it).
        self.single = False

    @property
    def finished(self) -> bool:
        return self.next_index >= self.req.spec.output_tokens

    def tokens_left(self) -> int:
        limit = self.req.spec.output_tokens
        if self.stop_at is not None and self.stop_at < limit:
            limit = self.stop_at
        return limit - self.next_index


@dataclass
class StepOutcome:
    jobs_done: list[Job] = field(default_factory=list)
    # Each decoding sequence of the step and its tokens' times (a macro step:
    # several), for the cluster to hand to the request's driver.
    tokens: list[tuple[Seq, list[float]]] = field(default_factory=list)
    # Finished (removed, KV freed) or reached stop_at (parked, KV kept).
    seqs_ended: list[Seq] = field(default_factory=list)


class SimInstance:
    def __init__(self, instance_id: str, role: Role, datacenter: str, cost: CostModel,
                 max_batch: int, token_budget: int, block_size: int, kv_blocks: int,
                 cache: bool, max_macro_steps: int = 32, packing: str = "packed",
                 deliver_s: float = 0.0, jitter: float = 0.0, seed: int = 0,
                 row_factors: tuple[float, ...] = (), lone_chunk_factor: float = 1.0,
                 step_overhead_tokens: int = STEP_OVERHEAD_TOKENS) -> None:
        if kv_blocks <= 0:
            raise ValueError(f"{instance_id}: no KV memory left after the weights")
        self.instance_id, self.role, self.datacenter = instance_id, role, datacenter
        self.cost = cost
        self._time = cost.fast()
        self.max_batch, self.token_budget = max_batch, token_budget
        self.block_size, self.kv_blocks = block_size, kv_blocks
        self.used_blocks = 0
        self.cache = PrefixCache(kv_blocks) if cache else None
        self.max_macro_steps = max_macro_steps
        self.single_chunk = packing == "single"     # one prefill chunk per step: tail chunks run alone
        self.short_first = packing == "short_first"   # our engine's order (pdd.engine.scheduler)
        self.step_overhead_tokens = step_overhead_tokens
        self.deliver_s = deliver_s           # instance -> user latency of a streamed token
        self.jobs: deque[Job] = deque()
        self.waiting: deque[Seq] = deque()
        self.decoding: list[Seq] = []
        self.parked: list[Seq] = []          # resident, not decoding (awaiting a final extend)
        self.admitted: list[Seq] = []        # admitted since the cluster last looked
        # [step boundaries left, callback]: work the real server does as an
        # engine command, which runs between two steps (runtime modes only).
        self.waiters: list[list] = []
        self.version = 0
        self.busy = False
        self.at_boundary = False             # between two steps, running what waited for it
        self.step_time_s: float | None = None
        self.prefill = PrefillMeter()          # its prompt steps, as the engine and the router read them
        self.streams_kv = False      # P sends blocks while it computes (set by the cluster)
        self.kv_layer_slices = 1     # ... and a chunk's KV layer by layer (the model's layers; set by the cluster)
        self.busy_s = 0.0
        self.num_steps = 0
        self._start = 0.0
        self._times: list[float] = []
        self._chunks: list[tuple[Job, int]] = []
        self._batch: list[Seq] = []
        # Measured steps scatter about the fitted model; a lognormal factor
        # of mean 1 per step reproduces that scatter (seeded: runs repeat).
        self._jitter = jitter
        self._rng = random.Random(seed) if jitter > 0 else None
        self._row_factors = row_factors
        # a decoder's step that decodes nothing (`PoolSpec.lone_chunk_factor`)
        self._lone_chunk = lone_chunk_factor if role_group(role) == "decode" else 1.0

    # --- memory -------------------------------------------------------------
    @property
    def free_blocks(self) -> int:
        """Blocks a new allocation may take: neither private nor pinned."""
        pinned = self.cache.num_pinned if self.cache is not None else 0
        return self.kv_blocks - self.used_blocks - pinned

    def allocate(self, n: int) -> bool:
        if n > self.free_blocks:
            return False
        self.used_blocks += n
        if self.cache is not None:
            self.cache.set_capacity(self.kv_blocks - self.used_blocks)
        return True

    def release(self, n: int) -> None:
        self.used_blocks -= n
        assert self.used_blocks >= 0, self.instance_id
        if self.cache is not None:
            self.cache.set_capacity(self.kv_blocks - self.used_blocks)

    def share(self, block_ids, num_private: int) -> list[int] | None:
        """Pin the cached leading run of `block_ids` and allocate `num_private`
        minus that run privately; None (nothing taken) when memory is short."""
        if self.cache is None:
            return [] if self.allocate(num_private) else None
        ids = block_ids[: self.cache.match(block_ids)]
        private = max(num_private - len(ids), 0)
        if private + self.cache.num_unpinned(ids) > self.free_blocks:
            return None
        shared = self.pin_prefix(ids)      # first, so the allocation cannot evict them
        self.allocate(private)
        return shared

    def pin_prefix(self, block_ids) -> list[int]:
        """Pin the leading run of `block_ids` the cache holds, for KV already in
        memory (imported); [] without a cache."""
        if self.cache is None:
            return []
        ids = list(block_ids[: self.cache.match(block_ids)])
        self.cache.pin(ids)
        return ids

    def unshare(self, ids: list[int]) -> None:
        if ids and self.cache is not None:
            self.cache.unpin(ids)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # --- work in ----------------------------------------------------------
    def add_job(self, job: Job) -> None:
        self.jobs.append(job)

    def add_seq(self, seq: Seq) -> None:
        self.waiting.append(seq)

    def prefill_time_s(self, num_tokens: int, start_tokens: int = 0) -> float | None:
        """How long this P takes for `num_tokens` more prompt tokens past
        `start_tokens`, by what it has measured (as the router judges it from
        the view, `prefill_compute_s`)."""
        step_s, token_s, attn_s = self.prefill.cost or (None, None, 0.0)
        return prefill_compute_s(num_tokens, self.token_budget if self.streams_kv else 0, step_s, token_s,
                                 self.prefill.tokens_s, attn_s=attn_s, start_tokens=start_tokens)

    def view(self) -> InstanceView:
        started = sum(1 for j in self.jobs if j.started)
        return InstanceView(
            self.instance_id, self.role, self.datacenter,
            num_running=len(self.decoding) + len(self.parked) + started,
            num_waiting=len(self.waiting) + len(self.jobs) - started,
            max_batch=self.max_batch, kv_free_blocks=self.free_blocks,
            kv_total_blocks=self.kv_blocks, step_time_s=self.step_time_s,
            prefill_tokens_s=self.prefill.tokens_s, chunk_tokens=self.token_budget if self.streams_kv else 0,
            prefill_step_s=self.prefill.cost[0] if self.prefill.cost else None,
            prefill_token_s=self.prefill.cost[1] if self.prefill.cost else None,
            prefill_attn_s=self.prefill.cost[2] if self.prefill.cost else 0.0,
            prefill_largest_step=self.prefill.largest_step,
            kv_layer_slices=self.kv_layer_slices)

    # --- stepping ---------------------------------------------------------
    def _admit(self) -> None:
        while self.waiting and len(self.decoding) + len(self.parked) < self.max_batch:
            seq = self.waiting[0]
            if not self.allocate(seq.num_blocks):
                break
            self.waiting.popleft()
            (self.decoding if seq.decoding else self.parked).append(seq)
            self.admitted.append(seq)

    def start_step(self, now: float) -> float | None:
        """Plan and time the next step; returns its end time, or None when idle."""
        assert not self.busy
        self._admit()
        batch = self.decoding
        # Our engine runs a handoff's final extend alone (the user's stream
        # is stalled on it; `pdd.engine.scheduler`, "urgent").
        urgent = [j for j in self.jobs if self.short_first and j.started and j.kind is JobKind.EXTEND
                  and getattr(j.data, "final", False)]
        if urgent:
            batch = []
        budget = self.token_budget - len(batch)
        chunks: list[tuple[Job, int]] = []
        pairs = 0.0
        ctx = 0.0
        admitting, completing = True, 0
        # FCFS; or shortest remaining first, as our engine's scheduler (ties:
        # arrival), where a step that completes prompts takes only what they
        # can wait for (`pdd.policy.step_packing`).
        if self.short_first and self.cache is not None:
            # The engine ranks waiting prompts by what they would compute now
            # (its cache may have grown since they arrived: an earlier
            # prompt's chunks, a shared system prompt), not at arrival.
            for job in self.jobs:
                if not job.started and job.kind is JobKind.PREFILL:
                    self._rematch(job)
        jobs = sorted(self.jobs, key=lambda j: j.num_tokens - j.done) if self.short_first else self.jobs
        if urgent:
            jobs = urgent
        for job in jobs:
            if budget <= 0:
                break
            if self.short_first and not joins_step(job.num_tokens - job.done, budget, self.token_budget - budget,
                                                   completing, self.step_overhead_tokens):
                break
            if not job.started and (not admitting or not self._start_job(job)):
                if not self.short_first:
                    break   # head-of-line: FCFS, no overtaking
                admitting = False   # no room: later arrivals do not overtake it
                continue
            c = min(job.num_tokens - job.done, budget)
            completing += int(c == job.num_tokens - job.done)
            start = job.ctx_start + job.done
            chunks.append((job, c))
            pairs += chunk_pairs(start, c)
            ctx += start
            budget -= c
            if self.single_chunk:
                break
        if not chunks and not batch:
            return None
        n_dec = len(batch)
        dec_ctx = float(sum(s.context for s in batch))
        n_pre = sum(c for _, c in chunks)
        # A fresh sequence whose last partial block did not cross recomputes
        # it with its first token: a small chunk in place of one decode token.
        fresh = [s for s in batch if s.first > 1]
        for s in fresh:
            n_pre += s.first - 1
            pairs += chunk_pairs(s.context - s.first, s.first) - (s.context + 1)
        if chunks or fresh or not batch or self.waiters or any(s.single for s in batch):
            k = 1
        else:
            k = min(self.max_macro_steps, min(s.tokens_left() for s in batch))
        t = now
        times = []
        size = n_dec + len(chunks)
        rf, k_rows = self._row_factors, row_bucket(n_pre + n_dec)
        scale = rf[k_rows - 1] if k_rows <= len(rf) else 1.0
        if len(fresh) == n_dec and n_pre:
            # nothing here decodes yet (a fresh sequence's first step computes
            # its partial block as a prompt chunk, as the engine counts it)
            scale *= self._lone_chunk
        for i in range(k):
            c_sum = dec_ctx + i * n_dec
            dt = scale * self._time(n_pre + n_dec, size, ctx + c_sum, pairs + c_sum + n_dec)
            if self._rng is not None:
                dt *= self._rng.lognormvariate(-0.5 * self._jitter ** 2, self._jitter)
            t += dt
            times.append(t)
        self._start, self._times, self._chunks, self._batch = now, times, chunks, list(batch)
        self.busy = True
        self.version += 1
        return times[-1]

    @property
    def last_chunks(self) -> list[tuple[Job, int]]:
        """(job, tokens) of the step under way (`end_step` starts a new list)."""
        return self._chunks

    def first_chunks(self) -> list[Job]:
        """Prefill jobs whose first chunk the step under way computes."""
        return [job for job, _ in self._chunks if job.kind is JobKind.PREFILL and job.done == 0]

    def _start_job(self, job: Job) -> bool:
        if job.kind is JobKind.PREFILL and self.cache is not None:
            self._rematch(job)
            ids = job.req.spec.block_ids[: job.ctx_start // self.block_size]
            shared = self.share(ids, job.num_blocks)
            if shared is None:
                return False
            job.num_blocks -= len(shared)
            job.shared = shared
        elif not self.allocate(job.num_blocks):
            return False
        job.started = True
        return True

    def _rematch(self, job: Job) -> None:
        """At admission the cache may hold more of the prompt than at routing
        (an earlier request's chunks landed meanwhile): skip what it holds."""
        spec = job.req.spec
        hit = min(self.cache.match(spec.block_ids) * self.block_size, spec.prompt_tokens - 1)
        if hit > job.ctx_start:
            job.num_tokens -= hit - job.ctx_start
            job.ctx_start = hit
            job.req.cached_tokens = hit
            job.req.uncached_kv_bytes = job.num_tokens * self.cost.model.kv_bytes_per_token

    @property
    def current_chunks(self) -> tuple[tuple[str, int], ...]:
        """(request id, tokens) of the prefill/extend chunks in the step under way."""
        return tuple((job.req.spec.request_id, c) for job, c in self._chunks)

    @property
    def current_num_steps(self) -> int:
        return len(self._times) if self.busy else 0

    def interrupt(self, now: float) -> float | None:
        """New work arrived mid macro step: end it at the next boundary.

        Returns the new end time (the caller schedules it under the new
        version), or None when the current end stands.
        """
        if not self.busy or len(self._times) <= 1:
            return None
        j = bisect.bisect_left(self._times, now)
        if j >= len(self._times) - 1:
            return None
        del self._times[j + 1:]
        self.version += 1
        return self._times[-1]

    def end_step(self, now: float) -> StepOutcome:
        out = StepOutcome()
        times = self._times
        k = len(times)
        if k == 1:
            times = [now]     # a time-sliced core may have stretched the step
        self.busy = False
        self.num_steps += k
        self.busy_s += now - self._start
        attn = sum(prefill_attention(job.ctx_start + job.done, c) for job, c in self._chunks)
        for job, c in self._chunks:
            before = (job.ctx_start + job.done) // self.block_size
            job.done += c
            job.last_chunk = c
            if job.done >= job.num_tokens:
                out.jobs_done.append(job)
            if job.kind is JobKind.PREFILL and self.cache is not None:
                # Blocks count as cached once computed, as in a paged engine:
                # the job's private blocks become shared ones.
                full = (job.ctx_start + job.done) // self.block_size
                ids = job.req.spec.block_ids
                new = list(ids[before:full][: job.num_blocks])
                self.release(len(new))           # make room in the cache for them first
                job.num_blocks -= len(new)
                self.cache.insert(ids[:full])
                kept = [b for b in new if b in self.cache]
                self.cache.pin(kept)
                job.shared += kept
                if len(kept) < len(new):         # no room even so: they stay private
                    self.used_blocks += len(new) - len(kept)
                    job.num_blocks += len(new) - len(kept)
                    self.cache.set_capacity(self.kv_blocks - self.used_blocks)
        if out.jobs_done:
            done = set(map(id, out.jobs_done))
            self.jobs = deque(j for j in self.jobs if id(j) not in done)
        n_pre = sum(c for _, c in self._chunks)
        if n_pre and now > self._start:
            self.prefill.record(n_pre, now - self._start, attn)
        if self._batch:
            if not self._chunks:
                per = (now - self._start) / k
                self.step_time_s = per if self.step_time_s is None else (
                    self.step_time_s + 0.2 * (per - self.step_time_s))
            for seq in self._batch:
                out.tokens.append((seq, times))
                seq.next_index += k
                seq.context += k
                seq.first = 1
                if seq.tokens_left() <= 0:
                    out.seqs_ended.append(seq)
            for seq in out.seqs_ended:
                if seq.finished:
                    self.remove_seq(seq)       # the request is over: free its KV
                else:
                    self.stop_decoding(seq)    # reached stop_at: resident until released
        self._chunks, self._batch = [], []
        return out

    def wait_boundaries(self, n: int, fn) -> None:
        """Run `fn(now)` after `n` more step boundaries (at once if idle)."""
        self.waiters.append([n, fn])

    def tick_waiters(self, k: int) -> list:
        """`k` boundaries passed: the callbacks now due, removed."""
        due = []
        for w in self.waiters:
            w[0] -= k
            if w[0] <= 0:
                due.append(w[1])
        if due:
            self.waiters = [w for w in self.waiters if w[0] > 0]
        return due

    def pop_waiters(self) -> list:
        due, self.waiters = [w[1] for w in self.waiters], []
        return due

    def remove_seq(self, seq: Seq) -> None:
        """Drop a seq wherever it is and free its blocks (abort / handoff done)."""
        seq.removed = True
        for pool in (self.decoding, self.parked):
            if seq in pool:
                pool.remove(seq)
                self.release(seq.num_blocks)
                break
        else:
            if seq in self.waiting:
                self.waiting.remove(seq)
        self.unshare(seq.shared)
        seq.shared = []

    def stop_decoding(self, seq: Seq) -> None:
        """Keep `seq` resident but out of the batch (RLD after its final handoff batch)."""
        if seq in self.decoding:
            self.decoding.remove(seq)
            self.parked.append(seq)
        seq.decoding = False

    def start_decoding(self, seq: Seq) -> None:
        if seq in self.parked:
            self.parked.remove(seq)
            self.decoding.append(seq)
        seq.decoding = True
