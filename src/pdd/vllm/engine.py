"""One in-process vLLM engine behind our Engine's interface.

EngineLoop and the instance server drive an object with our Engine's verbs
(submit, step, abort, forget, stats, step_log, has_work, pool_lock); this
class gives them those verbs over vLLM's `LLMEngine`, so the internal API,
the router and the simulator's calibration do not know which engine runs.

Lifecycle of a request here:
    submit -> add_request (RUNNING) -> step() streams its tokens as StepEvents
    -> vLLM finishes it (FINISHED_*; the record stays for cached_tokens)
    -> forget() drops the record.
vLLM runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0): `step()` is one
scheduler + model pass on the engine thread, like our Engine's.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdd.engine.config import EngineConfig
from pdd.engine.engine import InvalidRequestError, StepEvent, StepRecord
from pdd.engine.request import EngineRequest, RequestStatus, SamplingParams
from pdd.model.config import ModelConfig

log = logging.getLogger(__name__)

# vLLM's CPU attention backend refuses other block sizes (16 included).
CPU_BLOCK_MULTIPLE = 32
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_FINISH_STATUS = {"stop": RequestStatus.FINISHED_STOPPED, "length": RequestStatus.FINISHED_LENGTH,
                  "abort": RequestStatus.FINISHED_ABORTED}


@dataclass
class VllmRequestRecord:
    """What the instance reads of a request after vLLM has it."""
    request_id: str
    num_prompt_tokens: int
    status: RequestStatus = RequestStatus.RUNNING
    num_cached_tokens: int = 0
    num_output_tokens: int = 0


def engine_kwargs(model_dir: Path, cfg: EngineConfig, model_cfg: ModelConfig) -> dict[str, Any]:
    """vLLM EngineArgs for one of our engine tables (pure: no vLLM import).

    The KV pool is sized by bytes and by block count both: on CPU vLLM
    otherwise reserves a fraction of the whole machine's memory."""
    max_len = min(cfg.max_model_len or model_cfg.max_position_embeddings,
                  model_cfg.max_position_embeddings, cfg.num_blocks * cfg.block_size)
    kv_bytes = cfg.num_blocks * cfg.block_size * model_cfg.kv_bytes_per_token(_DTYPE_BYTES[cfg.dtype])
    return dict(
        model=str(model_dir), tokenizer=str(model_dir), dtype=cfg.dtype, block_size=cfg.block_size,
        # Compiling takes 60-97 s per start here (and again on every start);
        # eager mode starts in seconds at a small cost per step.
        enforce_eager=True,
        max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
        enable_chunked_prefill=True, max_model_len=max_len, enable_prefix_caching=cfg.enable_prefix_cache,
        num_gpu_blocks_override=cfg.num_blocks, kv_cache_memory_bytes=kv_bytes,
        seed=0, disable_log_stats=True,
    )


def vllm_sampling(sp: SamplingParams):
    """Our SamplingParams as vLLM's, streaming each step's new tokens (DELTA)."""
    from vllm import SamplingParams as VSP
    from vllm.sampling_params import RequestOutputKind

    return VSP(max_tokens=sp.max_tokens, temperature=sp.temperature, top_p=sp.top_p, seed=sp.seed,
               stop=list(sp.stop) or None, stop_token_ids=list(sp.stop_token_ids) or None,
               ignore_eos=sp.ignore_eos, output_kind=RequestOutputKind.DELTA)


def prepare_process(num_threads: int) -> None:
    """Before vLLM (and torch's thread pool) is built: one in-process engine,
    `num_threads` OpenMP threads. vLLM's CPU worker replaces
    torch.set_num_threads once it has bound its threads, so set both first;
    VLLM_CPU_OMP_THREADS_BIND does nothing for an in-process engine."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["OMP_NUM_THREADS"] = str(num_threads)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch.set_num_threads(num_threads)


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

    @classmethod
    def build(cls, model_dir: Path, cfg: EngineConfig, model_cfg: ModelConfig, **extra: Any) -> "VllmEngine":
        """`extra`: more EngineArgs (kv_transfer_config for the PDD connector)."""
        prepare_process(cfg.num_threads)
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
        rid = req.request_id
        if rid in self.requests:
            raise InvalidRequestError(f"duplicate request id {rid!r}")
        if not req.prompt_ids:
            raise InvalidRequestError("prompt is empty")
        bad = [t for t in req.prompt_ids if not (isinstance(t, int) and 0 <= t < self.model_cfg.vocab_size)]
        if bad:
            raise InvalidRequestError(f"token id {bad[0]!r} is outside the vocabulary [0, {self.model_cfg.vocab_size})")
        try:
            self.llm.add_request(rid, {"prompt_token_ids": list(req.prompt_ids)}, vllm_sampling(req.sampling))
        except (ValueError, TypeError) as e:
            raise InvalidRequestError(str(e)) from None
        self.requests[rid] = VllmRequestRecord(rid, len(req.prompt_ids))

    def abort(self, request_id: str) -> bool:
        rec = self.requests.get(request_id)
        if rec is None or rec.status.finished:
            return False
        self.llm.abort_request([request_id])
        rec.status = RequestStatus.FINISHED_ABORTED
        return True

    def forget(self, request_id: str) -> None:
        rec = self.requests.get(request_id)
        if rec is not None and rec.status.finished:
            del self.requests[request_id]

    @property
    def has_work(self) -> bool:
        return self.llm.has_unfinished_requests()

    # -- stepping ------------------------------------------------------------------------
    def step(self) -> list[StepEvent]:
        start, t0 = time.time(), time.perf_counter()
        outputs = self.llm.step()
        wall = time.perf_counter() - t0
        events: list[StepEvent] = []
        num_prefill = num_decode = 0
        for out in outputs:
            rec = self.requests.get(out.request_id)
            if rec is None or rec.status.finished:
                continue
            comp = out.outputs[0]
            if rec.num_output_tokens == 0 and comp.token_ids:
                rec.num_cached_tokens = int(out.num_cached_tokens or 0)
                self._prefix_query_tokens += rec.num_prompt_tokens
                self._prefix_hit_tokens += rec.num_cached_tokens
                num_prefill += rec.num_prompt_tokens - rec.num_cached_tokens
            else:
                num_decode += len(comp.token_ids)
            for tok in comp.token_ids:
                events.append(StepEvent(rec.request_id, token_id=int(tok), index=rec.num_output_tokens))
                rec.num_output_tokens += 1
            if out.finished:
                rec.status = _FINISH_STATUS.get(comp.finish_reason, RequestStatus.FINISHED_ERROR)
                reason = comp.finish_reason if comp.finish_reason in _FINISH_STATUS else "error"
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
        sch = self.scheduler
        pool = sch.kv_cache_manager.block_pool
        total = pool.num_gpu_blocks - 1          # block 0 is vLLM's null block
        free = pool.get_num_free_blocks()
        q, h = self._prefix_query_tokens, self._prefix_hit_tokens
        return {
            "num_running": len(sch.running), "num_waiting": len(sch.waiting),
            "kv_total_blocks": total, "kv_free_blocks": free, "kv_used_blocks": total - free,
            "num_requests": len(self.requests),
            "prefix_query_tokens": q, "prefix_hit_tokens": h, "prefix_hit_rate": h / q if q else 0.0,
            "num_steps": self.num_steps, "decode_step_s": self.recent_decode_step_s(),
            "backend": "vllm",
        }

    def recent_decode_step_s(self, window: int = 32) -> float | None:
        xs = [r.wall_s for r in list(self.step_log)[-4 * window:] if r.num_prefill_tokens == 0][-window:]
        return sum(xs) / len(xs) if xs else None

    def _release_pins(self, request_id: str) -> None:
        """Our engine pins imported KV until its request runs; vLLM's blocks
        are held by the connector instead, so there is nothing to unpin here."""
