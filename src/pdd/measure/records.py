"""Per-request facts, the one record shape that both `pdd bench` (measured)
and `pdd sim` (simulated) produce, so one summariser serves both."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class RequestRecord:
    request_id: str
    arrival_s: float                 # seconds from the start of the run
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int = 0           # prompt tokens served from P's prefix cache
    ttft_s: float | None = None      # None when the request failed before a token
    token_times_s: list[float] = field(default_factory=list)  # absolute, from run start
    e2e_s: float | None = None
    failed: bool = False
    error: str | None = None
    wan_bytes: int = 0               # KV bytes that crossed the WAN for this request
    uncached_kv_bytes: int = 0       # KV bytes of the prompt tokens P had to compute
    rld_tokens: int = 0              # output tokens emitted by a RelayDecode instance
    # The largest inter-token gap a handoff made: at the RLD -> MD switch, or
    # before one of RLD's tokens a paced handoff held back.
    handoff_gap_s: float | None = None
    pipeline: str | None = None      # policy decision, e.g. "direct", "relay", "relay_filtered"
    handoff_mode: str | None = None  # "one_shot" / "catch_up" when a handoff happened
    pipeline_reason: str | None = None   # why the policy chose it (the router's words)
    # The router's trace events, seconds after the router received the request:
    # {"name", "t", ...}, e.g. prefill_end, kv_transfer (link, payload_bytes,
    # elapsed_s), kv_ready. What a replay needs to see where time went.
    events: list[dict] = field(default_factory=list)
    # Prompt tokens that quote answers the model produced earlier in the run
    # (closed-loop agentic turns; `pdd.measure.workload.prompt_to_send`).
    quoted_answer_tokens: int = 0
    # The first token went out from P (PDD, `first_token_max_stall_s`): the
    # wait for MD shows as the gap before the second token.
    first_token_from_p: bool = False

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def itls_s(self) -> list[float]:
        t = self.token_times_s
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first (None for < 2 tokens)."""
        t = self.token_times_s
        if len(t) < 2:
            return None
        return (t[-1] - t[0]) / (len(t) - 1)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "RequestRecord":
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})
