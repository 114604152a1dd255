"""The engine facade: the narrow interface every server calls.

    submit(EngineRequest)          queue a request (prompt, maybe tokens made elsewhere)
    step() -> list[StepEvent]      run one batched forward pass, report what happened
    extend(id, token_ids, final)   append given tokens; computed in one pass (handoff)
    export_kv / import_kv          KV blocks as checked bytes, to resume elsewhere
    abort(id), stats(), step_log

One thread drives it (see server/engine_loop.py). The one exception is the
block pool: `pool_lock` guards every change to it and to the KV tensor's
free blocks, and `step()` lets go of it while the model runs, so a KV
receiver can take blocks and write arriving KV into them during a forward
pass (`KVImport`, `held_block_indices`) instead of waiting for the step to end.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

from pdd.engine.block_pool import BlockPool, NoFreeBlocks
from pdd.engine.config import EngineConfig
from pdd.engine.kv_codec import KVImportError, KVLayout, KVManifest, decode_blob, encode_blob
from pdd.engine.kv_events import KvEventLog
from pdd.engine.request import EngineRequest, RequestStatus
from pdd.engine.runner import ModelRunner
from pdd.engine.scheduler import Scheduler, StepPlan
from pdd.policy.views import PREFILL_FIT_STEPS, prefill_attention, prefill_rate


class InvalidRequestError(ValueError):
    """The request can never run here (empty, too long, bad ids, duplicate id)."""


@dataclass(frozen=True)
class StepEvent:
    request_id: str
    token_id: int | None = None        # a newly sampled token
    index: int | None = None           # its position among the request's output tokens
    finished: bool = False
    finish_reason: str | None = None   # stop | length | abort | error
    extended_upto: int | None = None   # a held extend batch is computed up to this many outputs
    error: str | None = None


@dataclass(frozen=True)
class StepRecord:
    """Shape and cost of one step, for the simulator's calibration."""
    num_prefill_tokens: int
    num_decode_tokens: int
    batch_size: int
    context_lens: tuple[int, ...]
    wall_s: float
    # Wall clock (time.time()) at the step's start: comparable across the
    # processes of one machine, so calibration can tell which steps of two
    # instances pinned to one core overlapped.
    start_s: float = 0.0
    # CPU time of the engine's thread over the step (time.thread_time):
    # below wall_s when another thread or process took the core meanwhile,
    # above a quiet run's when the step itself ran slower (shared caches and
    # memory). Not part of the simulator's fit; for finding where time goes.
    cpu_s: float = 0.0
    # The attention work of its prompt chunks (`prefill_attention` summed):
    # with the prompt tokens, what a prefill step's cost is fitted on.
    prefill_attn: float = 0.0


class Engine:
    def __init__(self, model, model_cfg, cfg: EngineConfig, tokenizer=None):
        self.model_cfg = model_cfg
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.max_model_len = min(cfg.max_model_len or model_cfg.max_position_embeddings,
                                 model_cfg.max_position_embeddings)
        self.layout = KVLayout(model_cfg.model_id, cfg.dtype, cfg.block_size,
                               model_cfg.num_layers, model_cfg.num_kv_heads, model_cfg.head_dim)
        self.kv_events = KvEventLog()
        self.pool = BlockPool(cfg.num_blocks, cfg.block_size, cfg.enable_prefix_cache, self.kv_events)
        self.scheduler = Scheduler(cfg, self.pool, model_cfg.model_id.encode())
        self.runner = ModelRunner(model, model_cfg, cfg)
        self.requests: dict[str, EngineRequest] = {}
        self.step_log: deque[StepRecord] = deque(maxlen=cfg.step_log_size)
        self._pins: dict[str, list[int]] = {}   # imported blocks held until their request runs
        self._eos = set(model_cfg.eos_token_ids)
        self.num_steps = 0
        # Held by whoever changes the pool; not while the model runs (see step).
        self.pool_lock = threading.RLock()

    # -- requests -------------------------------------------------------------
    def submit(self, req: EngineRequest) -> None:
        self._validate(req)
        self.requests[req.request_id] = req
        self.scheduler.add(req)

    def _validate(self, req: EngineRequest) -> None:
        if req.request_id in self.requests:
            raise InvalidRequestError(f"duplicate request id {req.request_id!r}")
        if not req.prompt_ids:
            raise InvalidRequestError("prompt is empty")
        bad = vocab_error(req.token_ids, self.model_cfg.vocab_size)
        if bad:
            raise InvalidRequestError(bad)
        if req.num_tokens >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {req.num_tokens} tokens; this model's context limit is {self.max_model_len}"
            )
        if -(-req.num_tokens // self.cfg.block_size) > self.cfg.num_blocks:
            raise InvalidRequestError(f"prompt of {req.num_tokens} tokens exceeds the KV pool")

    def reserve_decode_rows(self) -> None:
        """A decode instance at start-up: make the decode rows' storage now, so
        that no request's first decode step pays for it (`DecodeRows.reserve`)."""
        if self.runner.rows is not None:
            self.runner.rows.reserve()

    def extend(self, request_id: str, token_ids: list[int], final: bool = True,
               hold_at: int | None = None) -> None:
        """Append tokens produced elsewhere; their KV is computed in one pass.
        With final=False the request stays held (no sampling) for more batches;
        extend(id, [], final=False) pauses a running request, extend(id, []) resumes it.
        A pause with `hold_at` lets a running decode go on until it has made
        `hold_at` output tokens and holds it then (at once if it has them)."""
        req = self._get(request_id)
        if req.status.finished:
            raise InvalidRequestError(f"request {request_id!r} has finished")
        if hold_at is not None and (token_ids or final):
            raise InvalidRequestError("hold_at goes with a pause only (no token ids, final=false)")
        pause = not final and not token_ids
        if pause and req.status == RequestStatus.HELD:
            return                      # paused already: a second pause changes nothing
        if pause and hold_at is not None and req.num_output_tokens < hold_at \
                and req.status in (RequestStatus.RUNNING, RequestStatus.WAITING):
            req.hold_at_output = hold_at
            return
        req.hold_at_output = None
        if final and not token_ids and req.status == RequestStatus.RUNNING and not req.hold \
                and req.num_uncomputed <= 1:
            return                      # resuming one that had not stopped yet: it runs on
        bad = vocab_error(token_ids, self.model_cfg.vocab_size)
        if bad:
            raise InvalidRequestError(bad)
        if req.num_tokens + len(token_ids) > self.max_model_len:
            raise InvalidRequestError(f"extending to {req.num_tokens + len(token_ids)} tokens passes this model's "
                                      f"context limit of {self.max_model_len}")
        req.token_ids.extend(token_ids)
        req.hold = not final
        # The user waits on a final extend (a handoff's last batch, a
        # takeover, a resume): the scheduler runs it alone, at once.
        req.urgent = final
        if final and not token_ids and req.num_uncomputed == 0 and req.num_computed_tokens > 0:
            # resuming a paused request: recompute its last token to get logits again
            req.num_computed_tokens -= 1
        if (not final and not token_ids and req.status == RequestStatus.RUNNING
                and req.num_uncomputed <= 1 and req.num_computed_tokens > 0):
            # Pausing a decode (a handoff's final batch is on its way to MD): stop now,
            # not after one more step that computes its sampled token's KV without
            # sampling; a resume computes it then. That step ran on RLD while MD's
            # extend waited, on the core the two share (`results/wan-bound-27`).
            req.status = RequestStatus.HELD
            return
        if req.status == RequestStatus.HELD:
            req.status = RequestStatus.RUNNING

    def abort(self, request_id: str) -> bool:
        req = self.requests.get(request_id)
        self._release_pins(request_id)
        if req is None or req.status.finished:
            self.release_kv(request_id)
            return False
        self._finish(req, RequestStatus.FINISHED_ABORTED)
        return True

    def _get(self, request_id: str) -> EngineRequest:
        try:
            return self.requests[request_id]
        except KeyError:
            raise InvalidRequestError(f"unknown request id {request_id!r}") from None

    def _finish(self, req: EngineRequest, status: RequestStatus) -> None:
        keep = req.keep_kv and status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)
        self.scheduler.remove(req, keep_blocks=keep)
        # A request that ends before it ever ran (failed at scheduling) still
        # holds the pins of its imported KV: nothing else would drop them.
        self._release_pins(req.request_id)
        req.status = status

    def release_kv(self, request_id: str) -> None:
        """Free the blocks a finished keep_kv request still holds."""
        req = self.requests.get(request_id)
        if req is not None and req.status.finished and req.block_ids:
            self.pool.free(req.block_ids)
            req.block_ids = []

    def forget(self, request_id: str) -> None:
        """Drop a finished request's record (servers call this once reported)."""
        req = self.requests.get(request_id)
        if req is not None and req.status.finished:
            self.release_kv(request_id)
            self._release_pins(request_id)
            del self.requests[request_id]

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    # -- stepping ---------------------------------------------------------------
    def step(self) -> list[StepEvent]:
        with self.pool_lock:
            plan = self.scheduler.schedule()
            events = []
            for req in plan.failed:
                self._finish(req, RequestStatus.FINISHED_ERROR)
                events.append(StepEvent(req.request_id, finished=True, finish_reason="error", error=req.error))
            if plan.empty:
                return events
            for s in plan.seqs:
                if s.request.request_id in self._pins:
                    self._release_pins(s.request.request_id)
        # The model reads and writes only the blocks of the plan's sequences,
        # all allocated above: the pool may change meanwhile (KV imports).
        start = time.time()
        t0, c0 = time.perf_counter(), time.thread_time()
        plan, sampled, failed = self._execute_isolated(plan)
        wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
        with self.pool_lock:
            for req, err in failed:
                self._finish(req, RequestStatus.FINISHED_ERROR)
                req.error = err
                events.append(StepEvent(req.request_id, finished=True, finish_reason="error", error=err))
            if plan.empty:
                return events
            self.scheduler.postprocess(plan)
        self.num_steps += 1
        self.step_log.append(StepRecord(
            num_prefill_tokens=sum(s.num_tokens for s in plan.seqs if s.num_tokens > 1),
            num_decode_tokens=sum(1 for s in plan.seqs if s.num_tokens == 1),
            batch_size=len(plan.seqs),
            context_lens=tuple(s.start + s.num_tokens for s in plan.seqs),
            wall_s=wall,
            start_s=start,
            cpu_s=cpu,
            prefill_attn=sum(prefill_attention(s.start, s.num_tokens) for s in plan.seqs if s.num_tokens > 1),
        ))
        for s, tok in zip(plan.seqs, sampled):
            req = s.request
            if req.status == RequestStatus.HELD:
                events.append(StepEvent(req.request_id, extended_upto=req.num_output_tokens))
            elif s.sample:
                events.extend(self._on_sample(req, tok))
        if not self.scheduler.has_work:
            self.runner.release_idle_memory()
        return events

    def _execute_isolated(self, plan: StepPlan) -> tuple[StepPlan, list[int | None], list[tuple[EngineRequest, str]]]:
        """Run the batch; if it raises, run each of its seqs alone so that only
        the request(s) that fail on their own are failed.

        Re-running a seq is safe: it writes the same KV slots with the same
        values, and nothing (block hashes, computed counts) moved because
        postprocess runs only for the seqs that succeeded."""
        try:
            return plan, self.runner.execute(plan), []
        except Exception as e:
            if len(plan.seqs) == 1:
                return StepPlan(), [], [(plan.seqs[0].request, f"engine step failed: {e!r}")]
        good, sampled, failed = StepPlan(preempted=plan.preempted), [], []
        for s in plan.seqs:
            try:
                (tok,) = self.runner.execute(StepPlan(seqs=[s]))
            except Exception as e:
                failed.append((s.request, f"engine step failed: {e!r}"))
                continue
            good.seqs.append(s)
            sampled.append(tok)
        return good, sampled, failed

    def _on_sample(self, req: EngineRequest, tok: int) -> list[StepEvent]:
        if req.num_output_tokens >= req.sampling.max_tokens:   # given tokens already reach the limit
            self._finish(req, RequestStatus.FINISHED_LENGTH)
            return [StepEvent(req.request_id, finished=True, finish_reason="length")]
        req.token_ids.append(tok)
        index = req.num_output_tokens - 1
        status = self._stop_status(req, tok)
        if status is not None:
            self._finish(req, status)
            return [StepEvent(req.request_id, tok, index, True, status_reason(status))]
        if req.hold_at_output is not None and req.num_output_tokens >= req.hold_at_output:
            # A pause given ahead (`extend(hold_at=...)`): held as a pause at
            # once would hold it, its sampled token's KV not yet computed.
            req.hold_at_output = None
            req.hold = True
            req.status = RequestStatus.HELD
        return [StepEvent(req.request_id, tok, index)]

    def _stop_status(self, req: EngineRequest, tok: int) -> RequestStatus | None:
        sp = req.sampling
        if (tok in self._eos and not sp.ignore_eos) or tok in sp.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if sp.stop and self.tokenizer is not None:
            text = self.tokenizer.decode(req.output_token_ids)
            if any(s in text for s in sp.stop):
                return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= sp.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    # -- KV export / import -----------------------------------------------------
    def kv_manifest(self, request_id: str, num_tokens: int | None = None) -> KVManifest:
        """Identity and hashes of a request's computed full blocks (first num_tokens)."""
        req = self._get(request_id)
        n = min(num_tokens if num_tokens is not None else req.num_computed_tokens, req.num_computed_tokens)
        nblk = n // self.cfg.block_size
        return KVManifest(self.layout, tuple(req.token_ids[: nblk * self.cfg.block_size]),
                          tuple(req.block_hashes[:nblk]))

    def read_block(self, request_id: str, index: int) -> bytes:
        return self.runner.read_block(self._get(request_id).block_ids[index])

    def export_kv(self, request_id: str, skip_hashes=frozenset(), num_tokens: int | None = None) -> bytes:
        m = self.kv_manifest(request_id, num_tokens)
        idx = [i for i, h in enumerate(m.block_hashes) if h not in skip_hashes]
        return encode_blob(m, idx, [self.read_block(request_id, i) for i in idx])

    def import_kv(self, blob: bytes, pin_for: str | None = None) -> int:
        """Import a blob; returns the number of blocks written."""
        m, idx, payloads = decode_blob(blob, self.layout)
        imp = self.begin_import(m.to_meta(), list(m.block_hashes), pin_for)
        for i, p in zip(idx, payloads):
            imp.add_block(i, p)
        return imp.num_written

    def begin_import(self, meta: dict, block_hashes: list[bytes], pin_for: str | None = None) -> "KVImport":
        m = KVManifest.from_meta(meta, block_hashes)
        m.check_against(self.layout)
        return KVImport(self, m, pin_for)

    def held_block_indices(self, block_hashes: list[bytes]) -> set[int]:
        """Indices of blocks this engine's prefix cache already holds."""
        return {i for i, h in enumerate(block_hashes) if self.pool.holds(h)}

    def _pin(self, request_id: str | None, block_id: int) -> None:
        if request_id is None:
            self.pool.free([block_id])
        else:
            self._pins.setdefault(request_id, []).append(block_id)

    def _release_pins(self, request_id: str) -> None:
        blocks = self._pins.pop(request_id, None)
        if blocks:
            self.pool.free(blocks)

    # -- stats ---------------------------------------------------------------
    def stats(self) -> dict:
        sch = self.scheduler
        prefill = self._recent_prefill_steps()
        return {
            "num_running": len(sch.running),
            "num_waiting": len(sch.waiting),
            "kv_total_blocks": self.pool.num_blocks,
            "kv_free_blocks": self.pool.num_free,
            # used: referenced (ref >= 1) by a request, a pin or a finished
            # keep_kv request. The prefix cache's idle blocks (ref 0) are not
            # used: they count in free (evictable) and in cached.
            "kv_used_blocks": self.pool.num_used,
            "kv_cached_blocks": self.pool.num_cached,
            "kv_evictable_blocks": self.pool.num_evictable,
            # references held by imported KV waiting for its request to run
            "kv_pinned_blocks": sum(len(b) for b in list(self._pins.values())),
            "num_pinned_requests": len(self._pins),
            # records not yet forgotten, and finished ones still holding KV (P's keep_kv)
            "num_requests": len(self.requests),
            "kv_held_blocks": sum(len(r.block_ids) for r in list(self.requests.values()) if r.status.finished),
            "prefix_query_tokens": sch.prefix_query_tokens,
            "prefix_hit_tokens": sch.prefix_hit_tokens,
            "prefix_hit_rate": sch.prefix_hit_tokens / sch.prefix_query_tokens if sch.prefix_query_tokens else 0.0,
            "num_evictions": self.pool.num_evictions,
            "num_steps": self.num_steps,
            "decode_step_s": self.recent_decode_step_s(),
            "prefill_tokens_s": prefill_rate(prefill),
            # those steps as [prompt tokens, wall s, attention]: the router fits
            # their step, token and attention costs (`fit_prefill_cost`)
            "prefill_steps": [[n, round(w, 6), a] for n, w, a in prefill],
            # P streams a prompt's KV a few layers at a time as its steps compute it
            "kv_stream_slices": self.layout.stream_slices,
        }

    def recent_decode_step_s(self, window: int = 32) -> float | None:
        """Mean wall time of the last decode-only steps (the policy's RLD TPOT)."""
        xs = []
        try:   # may be read from another thread while the engine appends
            recent = [self.step_log[-k] for k in range(1, min(len(self.step_log), 4 * window) + 1)]
        except IndexError:
            return None
        for r in recent:
            if r.num_prefill_tokens == 0:
                xs.append(r.wall_s)
                if len(xs) == window:
                    break
        return sum(xs) / len(xs) if xs else None

    def _recent_prefill_steps(self, window: int = PREFILL_FIT_STEPS) -> list[tuple[int, float, float]]:
        """(prompt tokens, wall s, attention) of the last `window` steps that computed prompts."""
        try:
            recent = [self.step_log[-k] for k in range(1, min(len(self.step_log), 4 * window) + 1)]
        except IndexError:
            return []
        return [(r.num_prefill_tokens, r.wall_s, r.prefill_attn) for r in recent if r.num_prefill_tokens > 0][:window]


def vocab_error(token_ids, vocab_size: int) -> str | None:
    """Why these token ids cannot go into the model (the first that is not an
    int in [0, vocab_size)), or None."""
    for t in token_ids:
        if not (isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size):
            return f"token id {t!r} is outside the vocabulary [0, {vocab_size})"
    return None


def status_reason(status: RequestStatus) -> str:
    return {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length"}.get(status, "error")


class KVImport:
    """Blocks of one incoming transfer, written as they land."""

    def __init__(self, engine: Engine, manifest: KVManifest, pin_for: str | None):
        self.engine, self.manifest, self.pin_for = engine, manifest, pin_for
        self.num_written = 0
        self.reserved: dict[int, int] = {}      # block index -> pool block taken for it at BEGIN

    def reserve(self, indices) -> None:
        """Take pool blocks for every block still to come, in one allocation.

        A transfer's blocks then sit in consecutive pool blocks wherever the
        pool has them, and decode attends them in place. Taken one at a time
        as they land, a transfer on a slow line interleaves its blocks with
        every other allocation (other transfers, decode's new blocks), and
        decode has to gather the whole context at every step (measured: 35%
        longer decode steps at 60 Mbit/s than at 1 Gbit/s). Owned by this
        import until written; `close` gives back what was never written.
        Without room now, blocks are taken as they land, as before."""
        idx = sorted(indices)
        pool = self.engine.pool
        if not idx or not pool.enable_prefix_cache or len(idx) > pool.num_free:
            return
        self.reserved = dict(zip(idx, sorted(pool.allocate(len(idx)))))

    def add_block(self, index: int, payload: bytes) -> None:
        eng, h = self.engine, self.manifest.block_hashes[index]
        if len(payload) != eng.layout.block_bytes:
            raise KVImportError(f"KV block {index} has {len(payload)} bytes, expected {eng.layout.block_bytes}")
        if not eng.pool.enable_prefix_cache:
            raise KVImportError("this engine runs without a prefix cache: imported KV could not be found")
        b = self.reserved.pop(index, None)
        existing = eng.pool.hash_to_block.get(h)
        if existing is not None:
            if b is not None:
                eng.pool.free([b])           # another transfer landed it first
            eng.pool.acquire([existing])
            eng._pin(self.pin_for, existing)
            return
        if b is None:
            try:
                (b,) = eng.pool.allocate(1)
            except NoFreeBlocks as e:
                raise KVImportError(f"no room for imported KV: {e}") from None
        eng.runner.write_block(b, payload)
        eng.pool.commit(b, h)
        self.num_written += 1
        eng._pin(self.pin_for, b)

    def close(self) -> None:
        """The transfer ended (or was dropped): give back blocks reserved and never written."""
        reserved, self.reserved = self.reserved, {}
        if reserved:
            self.engine.pool.free(list(reserved.values()))
