"""What the instance reads of a vLLM engine: request records, the prefill
side's block reader, and stats (read from any thread, off vLLM's scheduler)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdd.engine.request import RequestStatus, SamplingParams

FINISH_STATUS = {"stop": RequestStatus.FINISHED_STOPPED, "length": RequestStatus.FINISHED_LENGTH,
                  "abort": RequestStatus.FINISHED_ABORTED}


@dataclass
class VllmRequestRecord:
    """What the instance reads of a request after vLLM has it."""
    request_id: str
    num_prompt_tokens: int
    token_ids: list[int] = field(default_factory=list)   # what vLLM was given: prompt + tokens made elsewhere
    status: RequestStatus = RequestStatus.RUNNING
    num_cached_tokens: int = 0
    num_output_tokens: int = 0                            # counts the tokens made elsewhere too
    keep_kv: bool = False
    started: bool = False                                 # its first step with output has been seen
    sampling: SamplingParams | None = None
    in_vllm: bool = False                                 # vLLM runs it now (not held, not finished)
    hold_at: int | None = None                            # a pause given ahead: held at this many outputs

    num_preemptions: int = 0                              # vLLM's preemptions are not seen from here

    @property
    def num_computed_tokens(self) -> int:
        """For P's streamed transfers: vLLM's blocks are readable once the
        finished prompt holds them (the connector's record), all at once."""
        return self.num_prompt_tokens if self.block_ids else 0

    @property
    def block_ids(self) -> list[int]:
        """vLLM blocks a finished prefill holds (the connector's record)."""
        from pdd.vllm.connector import HUB

        return HUB.held.get(self.request_id, [])


class BlockReader:
    """engine.runner.read_block for PrefillJob: whole vLLM blocks via the connector hub."""

    @staticmethod
    def read_block(block_id: int) -> bytes:
        from pdd.vllm.connector import HUB

        return HUB.read_block(block_id)



def engine_stats(engine) -> dict:
    """VllmEngine.stats: our engine's keys, read off vLLM's scheduler (from any thread)."""
    sch = engine.scheduler
    pool = sch.kv_cache_manager.block_pool
    total = pool.num_gpu_blocks - 1          # block 0 is vLLM's null block
    free = pool.get_num_free_blocks()
    q, h = engine._prefix_query_tokens, engine._prefix_hit_tokens
    return {
        "num_running": len(sch.running), "num_waiting": len(sch.waiting),
        "kv_total_blocks": total, "kv_free_blocks": free, "kv_used_blocks": total - free,
        "num_requests": len(engine.requests),
        "prefix_query_tokens": q, "prefix_hit_tokens": h, "prefix_hit_rate": h / q if q else 0.0,
        "num_steps": engine.num_steps, "decode_step_s": engine.recent_decode_step_s(),
        "backend": "vllm",
        # blocks the PDD connector loaded into vLLM from landed transfers
        # (not computed here: what a receiver's KV saved it)
        "kv_loaded_blocks": _hub_loaded_blocks(),
        "kv_pinned_blocks": engine.pins.num_pinned,      # HAVE blocks held for a request to come
    }


def recent_decode_step_s(step_log, window: int = 32) -> float | None:
    try:    # read from the HTTP thread while the engine thread appends
        recent = [step_log[-k] for k in range(1, min(len(step_log), 4 * window) + 1)]
    except IndexError:
        return None
    xs = [r.wall_s for r in recent if r.num_prefill_tokens == 0][:window]
    return sum(xs) / len(xs) if xs else None


def _hub_loaded_blocks() -> int:
    from pdd.vllm.connector import HUB

    return sum(list(HUB.loaded_blocks.values()))
