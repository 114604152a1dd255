"""Prometheus metrics of the router: latency histograms and PDD's own facts."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pdd.measure.metrics import is_handoff
from pdd.policy.lifecycle_io import Outcome
from pdd.server.trace import RequestTrace

# Requests whose eager tokens count: relays and RLD-only ones (not a failover).
RLD_OUTCOMES = {o.value for o in (Outcome.RELAY, Outcome.RELAY_FILTERED, Outcome.RELAY_CANCELLED,
                                  Outcome.WAN_DOWN)}

_LAT = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128)
_ITL = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2)


class RouterMetrics:
    def __init__(self, mode: str):
        self.registry = r = CollectorRegistry()
        self.mode = mode
        self.requests = Counter("pdd_router_requests", "Finished requests", ["mode", "pipeline", "status"], registry=r)
        self.rejected = Counter("pdd_router_rejected_requests", "Requests refused with a 4xx", registry=r)
        self.ttft = Histogram("pdd_router_ttft_seconds", "Time to first token", ["pipeline"], buckets=_LAT, registry=r)
        self.e2e = Histogram("pdd_router_e2e_seconds", "End-to-end latency", ["pipeline"], buckets=_LAT, registry=r)
        self.itl = Histogram("pdd_router_itl_seconds", "Inter-token latency", ["pipeline"], buckets=_ITL, registry=r)
        self.tokens = Counter("pdd_router_output_tokens", "Output tokens by source", ["source"], registry=r)
        self.wan_bytes = Counter("pdd_router_wan_kv_bytes", "KV bytes over the WAN", registry=r)
        self.local_bytes = Counter("pdd_router_local_kv_bytes", "KV bytes over local links", registry=r)
        self.prompt_tokens = Counter("pdd_router_prompt_tokens", "Prompt tokens", registry=r)
        self.cached_tokens = Counter("pdd_router_cached_prompt_tokens", "Prompt tokens from P's cache", registry=r)
        self.eager = Histogram("pdd_router_eager_tokens", "Tokens streamed by RLD before the handoff",
                               buckets=(0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512), registry=r)
        self.handoffs = Counter("pdd_router_handoffs", "RLD -> MD handoffs", ["mode"], registry=r)
        self.handoff_batches = Histogram("pdd_router_handoff_batches", "Extend batches per handoff",
                                         buckets=(1, 2, 3, 4, 6, 8), registry=r)
        self.handoff_gap = Histogram("pdd_router_handoff_gap_seconds", "Token-stream gap at the RLD -> MD switch",
                                     buckets=_ITL, registry=r)
        self.dispatched = Gauge("pdd_router_dispatched_requests",
                                "Requests this router has on each instance now (on P: until P has prefilled them)",
                                ["instance"], registry=r)
        self.kv_landed = Histogram("pdd_router_kv_landed_seconds", "Arrival -> KV landed, per link",
                                   ["link"], buckets=_LAT, registry=r)

    def observe(self, t: RequestTrace) -> None:
        pipe = t.pipeline or self.mode
        self.requests.labels(self.mode, pipe, "error" if t.error else "ok").inc()
        self.prompt_tokens.inc(t.prompt_tokens)
        self.cached_tokens.inc(t.cached_tokens)
        self.wan_bytes.inc(t.wan_bytes)
        self.local_bytes.inc(t.local_bytes)
        for src in t.token_sources:
            self.tokens.labels(src).inc()
        if t.ttft_s is not None:
            self.ttft.labels(pipe).observe(t.ttft_s)
        if t.finished_s and t.token_times_s:
            self.e2e.labels(pipe).observe(t.finished_s - t.arrival_s)
        for a, b in zip(t.token_times_s, t.token_times_s[1:]):
            self.itl.labels(pipe).observe(b - a)
        if t.pipeline in RLD_OUTCOMES:
            self.eager.observe(t.rld_tokens)
        if t.handoff_mode and t.handoff_gap_s is not None:
            self.handoffs.labels(t.handoff_mode).inc()
            self.handoff_batches.observe(t.handoff_batches)
            if is_handoff(t):           # RLD decoded: a switch the user sees
                self.handoff_gap.observe(t.handoff_gap_s)
        for ev in t.events:
            if ev["name"] == "kv_transfer" and ev.get("ok") and ev.get("link"):
                self.kv_landed.labels(ev["link"]).observe(ev["ts"] - t.arrival_s)

    def render(self, dispatched: dict[str, int] | None = None) -> bytes:
        for name, n in (dispatched or {}).items():
            self.dispatched.labels(name).set(n)
        return generate_latest(self.registry)
