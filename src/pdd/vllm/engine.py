"""One in-process vLLM engine behind our Engine's interface.

EngineLoop and the instance server drive an object with our Engine's verbs
(submit, step, abort, forget, stats, step_log, has_work, pool_lock); this
class gives them those verbs over vLLM's `LLMEngine`, so the internal API,
the router and the simulator's calibration do not know which engine runs.

Lifecycle of a request here:
    submit -> add_request (RUNNING) -> step() streams its tokens as StepEvents
    -> vLLM finishes it (FINISHED_*; the record stays for cached_tokens)
    -> forget() drops the record.
    submit(hold) -> HELD (outside vLLM) -> extend(final=False)* -> extend(final)
    -> add_request of prompt + every given token (RUNNING)
    each extend(final=False) batch is computed at once by a side request
    (side.py); a HELD request aborted (it ended on RLD) leaves its landed KV
    in vLLM's prefix cache through one.
    RUNNING -> extend([], final=False): paused (vLLM drops it, HELD) -> extend([]) -> RUNNING
vLLM runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0): `step()` is one
scheduler + model pass on the engine thread, like our Engine's.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from pdd.engine.config import EngineConfig
from pdd.engine.engine import InvalidRequestError, StepEvent, StepRecord
from pdd.engine.hashing import hash_blocks
from pdd.engine.kv_codec import KVLayout, KVManifest
from pdd.engine.request import EngineRequest, RequestStatus
from pdd.model.config import ModelConfig
from pdd.vllm.args import CPU_BLOCK_MULTIPLE, engine_kwargs, prepare_process, set_thread_count, vllm_sampling
from pdd.vllm.prefix import VllmPrefixIndex
from pdd.vllm.records import FINISH_STATUS, BlockReader, VllmRequestRecord, engine_stats, recent_decode_step_s
from pdd.vllm.side import FILLER_TOKEN, BlockPins, SideKind, SideRequests

log = logging.getLogger(__name__)

class VllmEngine:
    def __init__(self, llm, cfg: EngineConfig, model_cfg: ModelConfig):
        self.llm, self.cfg, self.model_cfg = llm, cfg, model_cfg
        self.requests: dict[str, VllmRequestRecord] = {}
        self.step_log: deque[StepRecord] = deque(maxlen=cfg.step_log_size)
        self.num_steps = 0
        # Nothing of ours runs during vLLM's step; the lock keeps EngineLoop's contract.
        self.pool_lock = threading.RLock()
        self._prefix_query_tokens = 0
        self._prefix_hit_tokens = 0
        self.runner = BlockReader()
        self._thread = threading.local()        # .omp_set: this thread's OpenMP count is ours (set_thread_count)
        self._pending: list[StepEvent] = []     # events made between steps
        self.side = SideRequests(llm)            # ours, output unread: catch-up batches, absorbed copies
        self.pins = BlockPins(lambda: self.scheduler, VllmPrefixIndex(llm.engine_core.engine_core, cfg.block_size))
        # Its own model id: vLLM's block layout is not ours, so neither engine
        # may take the other's KV (the receiver checks the layout's model id,
        # and block hashes are namespaced by it).
        self.layout = KVLayout(f"{model_cfg.model_id}/vllm", cfg.dtype, cfg.block_size,
                               model_cfg.num_layers, model_cfg.num_kv_heads, model_cfg.head_dim)

    @classmethod
    def build(cls, model_dir: Path, cfg: EngineConfig, model_cfg: ModelConfig, connector: bool = False,
              **extra: Any) -> "VllmEngine":
        """connector: load the PDD KV connector (every role that moves KV);
        `extra`: more EngineArgs."""
        prepare_process(cfg.num_threads)
        if connector:
            from pdd.vllm.connector import kv_transfer_config

            extra = {"kv_transfer_config": kv_transfer_config()} | extra
        from vllm.engine.arg_utils import EngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.llm_engine import LLMEngine

        if current_platform.is_cpu() and cfg.block_size % CPU_BLOCK_MULTIPLE:
            raise ValueError(f"engine.block_size = {cfg.block_size}: vLLM's CPU attention needs a multiple of "
                             f"{CPU_BLOCK_MULTIPLE} (32 or 64 keep DRC's granularity fine)")
        llm = LLMEngine.from_engine_args(EngineArgs(**(engine_kwargs(model_dir, cfg, model_cfg) | extra)))
        return cls(llm, cfg, model_cfg)

    # -- vLLM internals (in-process engine core) -------------------------------------
    @property
    def scheduler(self):
        return self.llm.engine_core.engine_core.scheduler

    # -- requests ---------------------------------------------------------------------
    def submit(self, req: EngineRequest) -> None:
        """A request, with the tokens made elsewhere (`output_ids`: P's first
        token, RLD's eager tokens) appended to the prompt: vLLM computes them
        in the same pass as the prompt's uncached part and samples after them.
        KV staged for it by the receiver is loaded through the connector."""
        rid = req.request_id
        if rid in self.requests:
            raise InvalidRequestError(f"duplicate request id {rid!r}")
        if not req.prompt_ids:
            raise InvalidRequestError("prompt is empty")
        tokens = list(req.prompt_ids) + list(req.output_ids)
        bad = [t for t in tokens if not (isinstance(t, int) and 0 <= t < self.model_cfg.vocab_size)]
        if bad:
            raise InvalidRequestError(f"token id {bad[0]!r} is outside the vocabulary [0, {self.model_cfg.vocab_size})")
        if req.sampling.max_tokens - len(req.output_ids) < 1:
            raise InvalidRequestError(f"max_tokens {req.sampling.max_tokens} leaves nothing to generate after "
                                      f"{len(req.output_ids)} given tokens")
        rec = VllmRequestRecord(rid, len(tokens), tokens, num_output_tokens=len(req.output_ids),
                                keep_kv=req.keep_kv, sampling=req.sampling)
        if req.hold:
            # Held (MD in a relay pipeline): vLLM sees it at the final extend,
            # prompt + every token made elsewhere in one pass.
            rec.status = RequestStatus.HELD
        else:
            self._to_vllm(rec)
        self.requests[rid] = rec

    def _to_vllm(self, rec: VllmRequestRecord) -> None:
        """Hand a request to vLLM: all its known tokens as the prompt; KV staged
        for it (landed transfers) loaded through the connector."""
        from pdd.vllm.connector import HOLD, HUB, LOAD

        kv = None
        if rec.keep_kv:
            kv = {"pdd_id": rec.request_id, "pdd_role": HOLD}
        elif rec.request_id in HUB.staged:
            kv = {"pdd_id": rec.request_id, "pdd_role": LOAD}
        max_tokens = rec.sampling.max_tokens - rec.num_output_tokens
        try:
            self.llm.add_request(rec.request_id, {"prompt_token_ids": list(rec.token_ids)},
                                 vllm_sampling(rec.sampling, max_tokens, kv))
        except (ValueError, TypeError) as e:
            raise InvalidRequestError(str(e)) from None
        rec.status, rec.in_vllm, rec.started = RequestStatus.RUNNING, True, False
        rec.num_prompt_tokens = len(rec.token_ids)

    def extend(self, request_id: str, token_ids: list[int], final: bool = True,
               hold_at: int | None = None) -> None:
        """Tokens made elsewhere (RLD's eager tokens) for a held request; with
        final=False it stays held for more. extend(id, [], final=False) pauses
        a running request (vLLM drops it; its blocks stay in the prefix
        cache) and extend(id, []) resumes it: a new vLLM request over the same
        tokens, which finds them cached but the last partial block. A pause
        with `hold_at` lets it run until it has made that many output tokens."""
        rec = self.requests.get(request_id)
        if rec is None:
            raise InvalidRequestError(f"unknown request id {request_id!r}")
        if rec.status.finished:
            raise InvalidRequestError(f"request {request_id!r} has finished")
        if hold_at is not None and (token_ids or final):
            raise InvalidRequestError("hold_at goes with a pause only (no token ids, final=false)")
        if rec.in_vllm and hold_at is not None and rec.num_output_tokens < hold_at:
            rec.hold_at = hold_at
            return
        rec.hold_at = None
        bad = [t for t in token_ids if not (isinstance(t, int) and not isinstance(t, bool)
                                            and 0 <= t < self.model_cfg.vocab_size)]
        if bad:
            raise InvalidRequestError(f"token id {bad[0]!r} is outside the vocabulary [0, {self.model_cfg.vocab_size})")
        if rec.in_vllm:
            if token_ids or final:
                raise InvalidRequestError("a running request on the vLLM backend can only be paused (extend [] "
                                          "with final=false)")
            self._hold(rec)
            return
        rec.token_ids.extend(token_ids)
        rec.num_output_tokens += len(token_ids)
        if rec.num_output_tokens >= rec.sampling.max_tokens:
            raise InvalidRequestError(f"extending to {rec.num_output_tokens} outputs leaves nothing to generate "
                                      f"(max_tokens {rec.sampling.max_tokens})")
        if final:
            self._to_vllm(rec)
        elif token_ids:
            self._catch_up(rec)
        else:
            self._pending.append(StepEvent(request_id, extended_upto=rec.num_output_tokens))

    def _hold(self, rec: VllmRequestRecord) -> None:
        """Pause a running request: vLLM drops it (its blocks stay in the prefix
        cache); a resume starts it again over the same tokens."""
        self.llm.abort_request([rec.request_id])
        rec.in_vllm, rec.status, rec.hold_at = False, RequestStatus.HELD, None

    def _catch_up(self, rec: VllmRequestRecord) -> None:
        """Compute a held request's tokens so far now (one side request at a
        time; one that ends with more tokens given starts the next), so the
        final extend finds all but the last partial block in the prefix cache."""
        if not self.side.catching_up(rec.request_id):
            self.side.launch(rec.request_id, rec.token_ids, SideKind.CATCH_UP, upto=rec.num_output_tokens)

    def absorb(self, owner: str, token_ids: list[int]) -> None:
        """KV landed for `owner` (staged) that no request will consume: into
        vLLM's prefix cache, its full blocks loaded and one filler token computed."""
        from pdd.vllm.connector import HUB

        if owner in HUB.staged and not self.side.owns(owner):
            self.side.launch(owner, list(token_ids) + [FILLER_TOKEN], SideKind.ABSORB)

    def _side_done(self, vid: str) -> list[StepEvent]:
        s = self.side.finished(vid)
        rec = self.requests.get(s.owner) if s is not None else None
        events = []
        if s is not None and s.kind is SideKind.CATCH_UP and rec is not None and rec.status == RequestStatus.HELD:
            events.append(StepEvent(s.owner, extended_upto=s.upto))
            if rec.num_output_tokens > s.upto:
                self._catch_up(rec)
        if s is not None and rec is None and not self.side.owns(s.owner):
            self._drop_kv(s.owner)
        return events

    # -- KV (the prefill side's export, through the connector) -----------------------
    def kv_manifest(self, request_id: str, num_tokens: int | None = None) -> KVManifest:
        """Identity and our hashes of the full blocks a finished prefill holds."""
        rec = self.requests[request_id]
        # vLLM computed the prompt it was given, not the token it sampled last
        n = rec.num_prompt_tokens if num_tokens is None else min(num_tokens, rec.num_prompt_tokens)
        nblk = min(n // self.cfg.block_size, len(rec.block_ids))
        ids = rec.token_ids[:nblk * self.cfg.block_size]
        return KVManifest(self.layout, tuple(ids), tuple(hash_blocks(ids, self.cfg.block_size,
                                                                     self.layout.model_id.encode())))

    def abort(self, request_id: str) -> bool:
        rec = self.requests.get(request_id)
        if rec is None or rec.status.finished:
            self._release_kv(request_id)
            return False
        if rec.in_vllm:
            self.llm.abort_request([request_id])
        elif rec.status == RequestStatus.HELD:
            # It ended elsewhere (RLD finished first) or its caller left: the
            # KV that landed for it stays in vLLM's prefix cache for the next turn.
            self.absorb(request_id, rec.token_ids)
        rec.status, rec.in_vllm = RequestStatus.FINISHED_ABORTED, False
        return True

    def forget(self, request_id: str) -> None:
        rec = self.requests.get(request_id)
        if rec is not None and rec.status.finished:
            self._release_kv(request_id)
            del self.requests[request_id]

    @staticmethod
    def _frees_pending() -> bool:
        from pdd.vllm.connector import HUB

        return HUB.has_pending_frees

    def _release_kv(self, request_id: str) -> None:
        from pdd.vllm.connector import HUB

        HUB.release(request_id)      # a finished prefill's held blocks: freed at the next step
        if not self.side.owns(request_id):      # else when its side request ends
            self._drop_kv(request_id)

    def _drop_kv(self, owner: str) -> None:
        from pdd.vllm.connector import HUB

        HUB.unstage(owner)
        self.pins.release(owner)

    @property
    def has_work(self) -> bool:
        from pdd.vllm.connector import HUB

        # A release is carried out by vLLM's next step (the worker reports the
        # blocks sent), so one pending is work even with no request running.
        return self.llm.has_unfinished_requests() or HUB.has_pending_frees or bool(self._pending)

    # -- stepping ------------------------------------------------------------------------
    def step(self) -> list[StepEvent]:
        if not getattr(self._thread, "omp_set", False):
            # The first step on this thread (EngineLoop's, not the builder's):
            # vLLM's CPU attention needs the thread's OpenMP count to be ours
            # before its first pass here (see set_thread_count).
            set_thread_count(self.cfg.num_threads)
            self._thread.omp_set = True
        start, t0 = time.time(), time.perf_counter()
        events, self._pending = self._pending, []
        outputs = self.llm.step() if self.llm.has_unfinished_requests() or self._frees_pending() else []
        wall = time.perf_counter() - t0
        num_prefill = num_decode = 0
        for out in outputs:
            if out.request_id in self.side.live:
                if out.finished:
                    events += self._side_done(out.request_id)
                continue
            rec = self.requests.get(out.request_id)
            if rec is None or not rec.in_vllm:
                continue
            comp = out.outputs[0]
            if not rec.started and comp.token_ids:
                rec.started = True
                self.pins.release(rec.request_id)      # vLLM holds what it hit now
                rec.num_cached_tokens = int(out.num_cached_tokens or 0)
                self._prefix_query_tokens += rec.num_prompt_tokens
                self._prefix_hit_tokens += rec.num_cached_tokens
                num_prefill += rec.num_prompt_tokens - rec.num_cached_tokens
            else:
                num_decode += len(comp.token_ids)
            for tok in comp.token_ids:
                events.append(StepEvent(rec.request_id, token_id=int(tok), index=rec.num_output_tokens))
                rec.num_output_tokens += 1
                rec.token_ids.append(int(tok))
            if not out.finished and rec.hold_at is not None and rec.num_output_tokens >= rec.hold_at:
                self._hold(rec)                                # a pause given ahead: held now
            if out.finished:
                rec.in_vllm = False
                rec.status = FINISH_STATUS.get(comp.finish_reason, RequestStatus.FINISHED_ERROR)
                reason = comp.finish_reason if comp.finish_reason in FINISH_STATUS else "error"
                if events and events[-1].request_id == rec.request_id and events[-1].token_id is not None:
                    last = events.pop()
                    events.append(StepEvent(rec.request_id, last.token_id, last.index, True, reason))
                else:
                    events.append(StepEvent(rec.request_id, finished=True, finish_reason=reason))
        self.num_steps += 1
        if outputs:
            # vLLM reports outputs, not its step plan: a prompt's prefill is
            # counted in the step that samples its first token (a chunked
            # prompt's earlier chunks are not), which is what calibration
            # needs for the common case of prompts under one step's budget.
            self.step_log.append(StepRecord(num_prefill, num_decode, len(outputs), (), wall, start))
        return events

    # -- reads from any thread -----------------------------------------------------------
    def stats(self) -> dict:
        return engine_stats(self)

    def recent_decode_step_s(self, window: int = 32) -> float | None:
        return recent_decode_step_s(self.step_log, window)

    def _release_pins(self, request_id: str) -> None:
        """Our engine pins imported KV until its request runs; here the landed
        blocks wait in the connector's staging area and the HAVE blocks are
        pinned in vLLM's pool, both let go when no request of that id runs
        (the transfer failed, or its decode call went away) and no side
        request (an absorb) still needs them."""
        if request_id not in self.requests and not self.side.owns(request_id):
            self._drop_kv(request_id)

