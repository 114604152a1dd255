"""Request state inside one engine.

Lifecycle (ordered, like vLLM v1's RequestStatus):
    WAITING -> RUNNING -> FINISHED_*          (a normal request)
    RUNNING -> WAITING                        (preempted: blocks freed, recomputed later)
    RUNNING -> HELD -> RUNNING                (extend batches that must not sample yet)
A request's tokens are `token_ids` = prompt + outputs; `num_computed_tokens`
of them have KV in the cache. Whenever every known token is computed and the
request is not held, the engine samples the next one.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pdd.engine.hashing import BlockHash


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    HELD = 2
    FINISHED_STOPPED = 10
    FINISHED_LENGTH = 11
    FINISHED_ABORTED = 12
    FINISHED_ERROR = 13

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


# Below this temperature a request samples greedily, as vLLM does
# (its _SAMPLING_EPS): logits / 1e-300 overflow to inf and the softmax of a
# row of infs is NaN, so "almost zero" has to mean "zero" somewhere.
GREEDY_BELOW_TEMPERATURE = 1e-5
MAX_TEMPERATURE = 100.0
MAX_STOP_TOKEN_IDS = 1024


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        # Every field is checked for type too: these also arrive over the
        # internal API, and one bad value must fail its own request at
        # submission, not a batch at sampling time.
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not _is_real(self.temperature) or not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(f"temperature must be a number in [0, {MAX_TEMPERATURE:g}], got {self.temperature!r}")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        if (not isinstance(self.stop_token_ids, tuple) or len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS
                or not all(_is_int(t) for t in self.stop_token_ids)):
            raise ValueError(f"stop_token_ids must be at most {MAX_STOP_TOKEN_IDS} integers")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a boolean, got {self.ignore_eos!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v) -> bool:
    # NaN fails every comparison, so the range checks after this refuse it
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass
class EngineRequest:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    # Tokens already generated elsewhere (e.g. by a relay decoder): they are
    # appended after the prompt and computed in one pass, never re-sampled.
    output_ids: list[int] = field(default_factory=list)
    # Compute the given tokens but do not sample until extend(..., final=True).
    hold: bool = False
    # Keep the KV blocks after finishing (a prefill instance exports them
    # afterwards); release_kv() frees them.
    keep_kv: bool = False
    arrival_s: float = field(default_factory=time.monotonic)

    # -- engine-owned state -------------------------------------------------
    status: RequestStatus = RequestStatus.WAITING
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0          # prompt tokens served by the prefix cache at admission
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)
    num_preemptions: int = 0
    error: str | None = None
    # A handoff's final extend (or a resume): scheduled alone, at once.
    urgent: bool = False
    # A pause given ahead: held once this many output tokens exist.
    hold_at_output: int | None = None

    def __post_init__(self):
        if not self.token_ids:
            self.token_ids = list(self.prompt_ids) + list(self.output_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_ids):]

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASON.get(self.status)
