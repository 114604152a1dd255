"""Prometheus metrics of one instance (its own registry, text format)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pdd.engine.engine import StepEvent
from pdd.transport.state import TransferStatus


class InstanceMetrics:
    def __init__(self, name: str, role: str):
        self.registry = r = CollectorRegistry()
        labels = {"instance": name, "role": role}
        self._labels = labels
        ln = list(labels)
        self.tokens = Counter("pdd_generated_tokens", "Output tokens sampled", ln, registry=r).labels(**labels)
        self.finished = Counter("pdd_finished_requests", "Requests finished", ln + ["reason"], registry=r)
        self.prefill_tokens = Counter("pdd_prefill_prompt_tokens", "Prompt tokens prefilled", ln, registry=r).labels(**labels)
        self.prefix_hits = Counter("pdd_prefill_cached_tokens", "Prompt tokens from the prefix cache", ln, registry=r).labels(**labels)
        self.kv_sent = Counter("pdd_kv_sent_bytes", "KV payload bytes sent", ln + ["link"], registry=r)
        self.kv_recv = Counter("pdd_kv_received_bytes", "KV payload bytes received", ln, registry=r).labels(**labels)
        self.kv_skipped = Counter("pdd_kv_skipped_blocks", "Blocks not sent because the receiver held them", ln, registry=r).labels(**labels)
        self.kv_failed = Counter("pdd_kv_failed_transfers", "KV transfers that failed", ln, registry=r).labels(**labels)
        self.kv_seconds = Histogram("pdd_kv_transfer_seconds", "KV transfer duration", ln + ["link"], registry=r,
                                    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64))
        # kv_used counts referenced blocks only; the prefix cache at rest is
        # kv_evictable (inside kv_free). Pinned: imported KV waiting for its
        # request; held: KV a finished prefill keeps for its transfers. At
        # idle, used, pinned and held are all 0.
        self.gauges = {k: Gauge(f"pdd_{k}", k.replace("_", " "), ln, registry=r).labels(**labels)
                       for k in ("num_running", "num_waiting", "kv_free_blocks", "kv_used_blocks",
                                 "kv_cached_blocks", "kv_evictable_blocks", "kv_pinned_blocks",
                                 "kv_held_blocks", "prefix_hit_rate", "engine_busy_fraction")}

    def on_events(self, events: list[StepEvent]) -> None:
        for ev in events:
            if ev.token_id is not None:
                self.tokens.inc()
            if ev.finished:
                self.finished.labels(**self._labels, reason=ev.finish_reason or "unknown").inc()

    def on_prefill(self, num_prompt: int, num_cached: int) -> None:
        self.prefill_tokens.inc(num_prompt)
        self.prefix_hits.inc(num_cached)

    def on_kv_sent(self, link: str, st: TransferStatus) -> None:
        self.kv_sent.labels(**self._labels, link=link).inc(st.payload_bytes)
        if st.elapsed_s is not None and st.ok:
            self.kv_seconds.labels(**self._labels, link=link).observe(st.elapsed_s)
        if not st.ok:
            self.kv_failed.inc()

    def on_kv_received(self, st: TransferStatus) -> None:
        self.kv_recv.inc(st.payload_bytes)
        self.kv_skipped.inc(st.num_blocks_skipped)

    def render(self, stats: dict, busy_s: float, up_s: float) -> bytes:
        for k, g in self.gauges.items():
            if k == "engine_busy_fraction":
                g.set(busy_s / up_s if up_s > 0 else 0.0)
            else:
                g.set(stats.get(k, 0))
        return generate_latest(self.registry)
