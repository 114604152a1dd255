"""What we hand vLLM: engine arguments from our engine table, sampling
parameters per request, and the process settings that must precede it.

Pure but for `prepare_process` (environment, torch threads); vLLM is
imported only inside `vllm_sampling`, so this module loads without it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pdd.engine.config import EngineConfig
from pdd.engine.request import SamplingParams
from pdd.model.config import ModelConfig

# vLLM's CPU attention backend refuses other block sizes (16 included).
CPU_BLOCK_MULTIPLE = 32
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def engine_kwargs(model_dir: Path, cfg: EngineConfig, model_cfg: ModelConfig) -> dict[str, Any]:
    """vLLM EngineArgs for one of our engine tables (pure: no vLLM import).

    The KV pool is sized by bytes and by block count both: on CPU vLLM
    otherwise reserves a fraction of the whole machine's memory."""
    max_len = min(cfg.max_model_len or model_cfg.max_position_embeddings,
                  model_cfg.max_position_embeddings, cfg.num_blocks * cfg.block_size)
    # One block more than asked: vLLM keeps block 0 as its null block, so
    # `num_blocks` stay usable, as in our engine (and the router's limits).
    num_blocks = cfg.num_blocks + 1
    kv_bytes = num_blocks * cfg.block_size * model_cfg.kv_bytes_per_token(_DTYPE_BYTES[cfg.dtype])
    return dict(
        model=str(model_dir), tokenizer=str(model_dir), dtype=cfg.dtype, block_size=cfg.block_size,
        # Compiling takes 60-97 s per start here (and again on every start);
        # eager mode starts in seconds at a small cost per step.
        enforce_eager=True,
        max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
        enable_chunked_prefill=True, max_model_len=max_len, enable_prefix_caching=cfg.enable_prefix_cache,
        num_gpu_blocks_override=num_blocks, kv_cache_memory_bytes=kv_bytes,
        seed=0, disable_log_stats=True,
    )


def vllm_sampling(sp: SamplingParams, max_tokens: int, kv_params: dict | None = None):
    """Our SamplingParams as vLLM's, streaming each step's new tokens (DELTA);
    kv_params: the PDD connector's per-request instructions."""
    from vllm import SamplingParams as VSP
    from vllm.sampling_params import RequestOutputKind

    return VSP(max_tokens=max_tokens, temperature=sp.temperature, top_p=sp.top_p, seed=sp.seed,
               stop=list(sp.stop) or None, stop_token_ids=list(sp.stop_token_ids) or None,
               ignore_eos=sp.ignore_eos, output_kind=RequestOutputKind.DELTA,
               extra_args={"kv_transfer_params": kv_params} if kv_params else None)


def one_token_sampling(kv_params: dict | None = None):
    """A side request's sampling: one greedy token nobody reads (the pass
    exists for the KV it computes or loads)."""
    from vllm import SamplingParams as VSP

    return VSP(max_tokens=1, temperature=0.0, ignore_eos=True,
               extra_args={"kv_transfer_params": kv_params} if kv_params else None)


def prepare_process(num_threads: int) -> None:
    """Before vLLM (and torch's thread pool) is built: one in-process engine,
    `num_threads` OpenMP threads. vLLM's CPU worker replaces
    torch.set_num_threads once it has bound its threads, so set both first;
    VLLM_CPU_OMP_THREADS_BIND does nothing for an in-process engine.

    OMP_NUM_THREADS here reaches only threads made after OpenMP loads, and
    torch (hence OpenMP) is usually loaded by now: another thread that steps
    the engine still needs `set_thread_count` (VllmEngine.step does it)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["OMP_NUM_THREADS"] = str(num_threads)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")     # vLLM's usage report: nothing leaves the machine
    os.environ.setdefault("DO_NOT_TRACK", "1")
    import torch

    torch.set_num_threads(num_threads)


def set_thread_count(num_threads: int) -> None:
    """The OpenMP thread count of the calling thread (and torch's).

    OpenMP keeps the count per thread: a thread made after OpenMP loaded
    without OMP_NUM_THREADS starts at the machine's core count, and torch
    lowers it to its own setting only at the thread's first parallel op.
    vLLM's CPU attention sizes its work plan (the scheduler metadata) by
    that count and then checks it again in the kernel; a step whose plan was
    made before torch's first parallel op on the thread fails the check
    ("thread_num (2 vs. 1)"). So the thread that steps the engine sets it
    first. torch.set_num_threads itself is replaced by vLLM's CPU worker (a
    warning that does nothing), hence torch._C.set_num_threads, the builtin it was."""
    import torch

    torch._C.set_num_threads(num_threads)
