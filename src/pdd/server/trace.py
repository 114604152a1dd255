"""Per-request trace kept by the router: timestamps and facts for benchmarks.

Served at GET /v1/requests/{id}/trace and summarised as Prometheus histograms.
Bounded in memory: past `max_traces` (the deployment's `[router] max_traces`)
the least recently added or read trace is dropped.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field


@dataclass
class RequestTrace:
    request_id: str
    mode: str
    prompt_tokens: int
    arrival_s: float = field(default_factory=time.time)
    events: list[dict] = field(default_factory=list)     # {"name", "ts", ...}
    token_times_s: list[float] = field(default_factory=list)
    token_sources: list[str] = field(default_factory=list)
    pipeline: str | None = None
    pipeline_reason: str | None = None
    instances: dict[str, str] = field(default_factory=dict)   # role -> instance name
    cached_tokens: int = 0
    uncached_kv_bytes: int = 0
    wan_bytes: int = 0
    local_bytes: int = 0
    kv_landed_s: dict[str, float] = field(default_factory=dict)  # link -> seconds after arrival
    eager_tokens: int = 0
    rld_tokens: int = 0
    handoff_mode: str | None = None
    handoff_batches: int = 0
    handoff_gap_s: float | None = None
    handoff_s: float | None = None           # MD ready -> MD takes the stream
    finish_reason: str | None = None
    error: str | None = None
    finished_s: float | None = None

    def event(self, name: str, **data) -> None:
        self.events.append({"name": name, "ts": time.time(), **data})

    def token(self, source: str) -> None:
        self.token_times_s.append(time.time())
        self.token_sources.append(source)
        if source == "rld":
            self.rld_tokens += 1

    @property
    def first_token_from_p(self) -> bool:
        return self.token_sources[:1] == ["p"]

    @property
    def ttft_s(self) -> float | None:
        return self.token_times_s[0] - self.arrival_s if self.token_times_s else None

    def to_dict(self) -> dict:
        return asdict(self) | {"ttft_s": self.ttft_s}


class TraceStore:
    """LRU by count. A trace holds a float per generated token (a few KB for
    a typical request), so the count bounds the router's memory."""

    def __init__(self, max_traces: int = 10_000):
        if max_traces < 1:
            raise ValueError(f"max_traces must be >= 1, got {max_traces}")
        self.max_traces = max_traces
        self._traces: OrderedDict[str, RequestTrace] = OrderedDict()

    def add(self, t: RequestTrace) -> None:
        self._traces[t.request_id] = t
        while len(self._traces) > self.max_traces:
            self._traces.popitem(last=False)

    def get(self, request_id: str) -> RequestTrace | None:
        t = self._traces.get(request_id)
        if t is not None:
            self._traces.move_to_end(request_id)
        return t

    def __len__(self) -> int:
        return len(self._traces)
