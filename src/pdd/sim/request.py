"""One request's simulated life: its spec, its progress, and its record.

Token times are kept for every `stride`-th token (and the last) so that an
hour of a large cluster fits in memory; `SimRequestRecord` scales the
inter-token gaps back so that `summarize_mode` reads true TPOT / ITL means.
With stride 1 it is an ordinary RequestRecord.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdd.measure.records import RequestRecord
from pdd.policy.lifecycle_log import DecisionLog


@dataclass(frozen=True)
class RequestSpec:
    request_id: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    max_tokens: int
    block_ids: tuple[int, ...]        # chained ids of the prompt's full blocks
    session: int = -1                 # -1: open-loop (a trace), else closed-loop session
    turn: int = 0
    # Ids of the blocks the *decode side* can cache after the request: prompt
    # plus output (the next turn's prompt starts with both).
    full_block_ids: tuple[int, ...] = ()


@dataclass
class SimRequestRecord(RequestRecord):
    token_stride: int = 1
    token_indices: list[int] = field(default_factory=list)

    @property
    def tpot_s(self) -> float | None:
        t = self.token_times_s
        if self.output_tokens < 2 or len(t) < 2:
            return None
        return (t[-1] - t[0]) / (self.token_indices[-1] - self.token_indices[0])

    @property
    def itls_s(self) -> list[float]:
        t, idx = self.token_times_s, self.token_indices
        return [(t[i + 1] - t[i]) / (idx[i + 1] - idx[i]) for i in range(len(t) - 1)]


class SimRequest:
    """What the user sees of a request (tokens and their times) and what the
    simulated data plane holds for it. A PDD request's rules live in its
    `RequestLifecycle` (`lc`), driven by `pdd.sim.lifecycle_driver`."""

    __slots__ = ("spec", "stride", "num_generated", "times", "indices", "cached_tokens",
                 "rld_tokens", "last_rld_token_s", "first_md_token_s", "wan_bytes",
                 "uncached_kv_bytes", "pipeline", "pipeline_reason", "handoff_mode", "done_s", "failed",
                 "error", "p_id", "lc", "targets", "legs", "seqs", "md_context",
                 "p_blocks", "p_shared", "warm_blocks", "last_delay_s", "log", "prefill_done_s", "streamed",
                 "kv_made_by_s", "p_first", "md_made", "last_token_s", "held_gap_s", "wake_at", "md_travels",
                 "md_in_flight", "md_have")

    def __init__(self, spec: RequestSpec, stride: int = 1) -> None:
        self.spec = spec
        self.stride = stride
        self.num_generated = 0
        self.times: list[float] = []
        self.indices: list[int] = []
        self.cached_tokens = 0
        self.rld_tokens = 0
        self.last_rld_token_s: float | None = None
        self.first_md_token_s: float | None = None
        self.wan_bytes = 0
        self.uncached_kv_bytes = 0
        self.pipeline: str | None = None
        self.pipeline_reason: str | None = None     # the routing decision's, as the router's trace
        self.handoff_mode: str | None = None
        self.done_s: float | None = None
        self.failed = False
        self.error: str | None = None
        self.p_id: str | None = None
        self.lc = None                 # its RequestLifecycle (None: colocated)
        self.targets = ()              # StartPrefill's transfers, sent once P has prefilled
        self.legs: dict = {}           # Leg -> (instance id, hold) of each open decode
        self.seqs: dict = {}           # Leg -> Seq on that instance, once its KV landed
        self.md_context = 0            # output tokens MD holds the KV of (extends so far)
        self.md_have = 1               # output tokens MD takes at its KV's landing (P's first, RLD's sent ahead)
        self.p_blocks = 0
        self.p_shared: list[int] = []
        self.warm_blocks = 0          # shared prefix blocks pushed to MD's cache (filtered request)
        self.last_delay_s = 0.0
        self.log = DecisionLog()       # the lifecycle's commands, a word per decision
        self.prefill_done_s: float | None = None   # when P finished the prompt
        self.streamed = False             # its KV left P while the prefill ran (streamed transfers)
        self.kv_made_by_s: float | None = None   # streamed layer by layer: when P should have made it all
        self.p_first = False                     # the first token went out from P
        self.md_made: dict[int, float] = {}      # overlap handoff: when MD made the tokens it ran ahead with
        self.last_token_s: float | None = None   # when the user got the last token
        self.held_gap_s: float | None = None     # paced handoff: the largest gap before a held-back token
        self.wake_at: float | None = None        # the lifecycle's wake time, as scheduled
        # MD's tokens reach the lifecycle when they would reach the router
        # (from the race of an overlap or paced handoff on: in order after it)
        self.md_travels = False
        self.md_in_flight: dict[int, list[float]] = {}    # first index -> when MD made those tokens

    @property
    def finished(self) -> bool:
        return self.num_generated >= self.spec.output_tokens

    def emit(self, times: list[float], relay: bool, delay_s: float = 0.0, held: bool = False,
             from_p: bool = False) -> None:
        """The next len(times) output tokens were made at these times and
        reach the user `delay_s` later. `held`: a paced handoff held them
        back (the gap before each is the handoff's). `from_p`: P's first
        token, sent by P itself (neither RLD's nor MD's: no handoff gap
        starts or ends at it)."""
        k = len(times)
        if k == 0:
            return
        self.p_first = self.p_first or (from_p and self.num_generated == 0)
        if delay_s:
            times = [t + delay_s for t in times]
        if held and self.last_token_s is not None:
            gap = max(b - a for a, b in zip([self.last_token_s] + times, times))
            self.held_gap_s = gap if self.held_gap_s is None else max(self.held_gap_s, gap)
        self.last_token_s = times[-1]
        self.last_delay_s = delay_s
        first = self.num_generated
        last_idx = self.spec.output_tokens - 1
        s = self.stride
        if s == 1:
            self.times.extend(times)
            self.indices.extend(range(first, first + k))
        else:
            off = (-first) % s
            self.times.extend(times[off::s])
            self.indices.extend(range(first + off, first + k, s))
            end = first + k - 1
            if end == last_idx and end % s:
                self.times.append(times[-1])
                self.indices.append(end)
        self.num_generated = first + k
        if relay:
            self.rld_tokens += k
            self.last_rld_token_s = times[-1]
        elif not from_p and self.first_md_token_s is None:
            self.first_md_token_s = times[0]

    def record(self) -> SimRequestRecord:
        spec = self.spec
        t0 = self.times[0] if self.times else None
        gap = self.held_gap_s
        if self.first_md_token_s is not None and self.last_rld_token_s is not None:
            gap = max(gap or 0.0, self.first_md_token_s - self.last_rld_token_s)
        return SimRequestRecord(
            request_id=spec.request_id, arrival_s=spec.arrival_s,
            prompt_tokens=spec.prompt_tokens, output_tokens=self.num_generated,
            cached_tokens=self.cached_tokens,
            ttft_s=None if t0 is None else t0 - spec.arrival_s,
            token_times_s=self.times,
            e2e_s=None if self.done_s is None else self.done_s - spec.arrival_s,
            failed=self.failed, error=self.error, wan_bytes=self.wan_bytes,
            uncached_kv_bytes=self.uncached_kv_bytes, rld_tokens=self.rld_tokens,
            handoff_gap_s=gap, pipeline=self.pipeline, pipeline_reason=self.pipeline_reason,
            handoff_mode=self.handoff_mode, first_token_from_p=self.p_first,
            token_stride=self.stride, token_indices=self.indices,
            events=[{"name": "lifecycle", "log": list(self.log.words)}] if self.lc is not None else [],
        )
