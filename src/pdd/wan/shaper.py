"""Pure model of one direction of a WAN line: token bucket + latency + jitter.

`schedule(now, nbytes) -> delivery_time`: when bytes handed to the line at
`now` come out of the far end. The bucket (rate, burst) decides when they
depart; a one-way latency plus seeded jitter is added; deliveries never go
backwards (delivery = max(previous delivery, departure + latency + jitter)),
because TCP delivers in order and a relay must never reorder a byte stream.
No clock, no I/O: the relay passes its loop time in.

Why these defaults. The report's regime: a ~1T model has ~50 KB of KV per
token, and a low-hit request's KV takes 1-20 s over a 10-100 Gbps line, while
high-hit requests (90%+ hit) move little and land within ~1 s. Our model
(SmolLM2) has 46 KB of KV per token, so scaling the line down keeps the same
ratios on one machine: at 400 Mbit/s (50 MB/s) a 4K-token uncached prompt
(~190 MB) takes ~3.8 s, a high-hit request (a few hundred new tokens, ~10 MB)
~0.2 s. 20 ms one-way latency is a typical inter-city RTT of 40 ms.
"""

from __future__ import annotations

import math
import random

MBIT_BYTES_S = 125_000  # 1 Mbit/s in bytes/s
DEFAULT_RATE_MBPS = 400.0
DEFAULT_RATE_BYTES_S = DEFAULT_RATE_MBPS * MBIT_BYTES_S  # 50 MB/s
DEFAULT_LATENCY_S = 0.020
DEFAULT_JITTER_S = 0.005
DEFAULT_BURST_BYTES = 256 * 1024

KEEP = object()  # configure(): leave this setting as it is


class Shaper:
    """rate_bytes_s None or 0: no bandwidth limit (latency and jitter still apply)."""

    def __init__(self, rate_bytes_s: float | None = DEFAULT_RATE_BYTES_S, latency_s: float = DEFAULT_LATENCY_S,
                 jitter_s: float = DEFAULT_JITTER_S, burst_bytes: int = DEFAULT_BURST_BYTES, seed: int = 0):
        self._rng = random.Random(seed)
        self.rate_bytes_s: float | None = None
        self.latency_s = 0.0
        self.jitter_s = 0.0
        self.burst_bytes = burst_bytes
        self.configure(rate_bytes_s=rate_bytes_s, latency_s=latency_s, jitter_s=jitter_s, burst_bytes=burst_bytes)
        self._tokens = float(burst_bytes)  # may go negative: bytes queued behind the bucket
        self._last_s: float | None = None
        self._last_delivery_s = -math.inf
        self.is_cut = False
        self.num_bytes_scheduled = 0

    def configure(self, *, rate_bytes_s=KEEP, latency_s=KEEP, jitter_s=KEEP, burst_bytes=KEEP) -> None:
        """Change the line at run time; bytes already scheduled keep their times."""
        if rate_bytes_s is not KEEP:
            if rate_bytes_s is not None and rate_bytes_s < 0:
                raise ValueError("rate_bytes_s must be >= 0 (0 or None: unlimited)")
            self.rate_bytes_s = float(rate_bytes_s) if rate_bytes_s else None
        if latency_s is not KEEP:
            if latency_s < 0:
                raise ValueError("latency_s must be >= 0")
            self.latency_s = float(latency_s)
        if jitter_s is not KEEP:
            if jitter_s < 0:
                raise ValueError("jitter_s must be >= 0")
            self.jitter_s = float(jitter_s)
        if burst_bytes is not KEEP:
            if burst_bytes <= 0:
                raise ValueError("burst_bytes must be > 0")
            self.burst_bytes = int(burst_bytes)

    def cut(self) -> None:
        """Nothing gets through until restore(): schedule() returns math.inf."""
        self.is_cut = True

    def restore(self) -> None:
        """The line comes back empty: what was queued on it when it was cut is gone
        (reset connections dropped it), so new bytes do not wait behind it."""
        self.is_cut = False
        self._tokens = float(self.burst_bytes)
        self._last_s = None
        self._last_delivery_s = -math.inf

    def _refill(self, now: float) -> float:
        if self._last_s is not None:
            now = max(now, self._last_s)  # a clock never runs backwards here
            if self.rate_bytes_s is not None:
                self._tokens = min(float(self.burst_bytes), self._tokens + (now - self._last_s) * self.rate_bytes_s)
        self._last_s = now
        return now

    def departure(self, now: float, nbytes: int) -> float:
        """When nbytes handed over at `now` have been serialized onto the line."""
        now = self._refill(now)
        if self.rate_bytes_s is None:
            return now
        self._tokens -= nbytes
        return now if self._tokens >= 0 else now + -self._tokens / self.rate_bytes_s

    def schedule(self, now: float, nbytes: int, priority: bool = False) -> float:
        """Bulk bytes queue behind everything handed to the line before them
        (one FIFO). `priority` bytes (a managed WAN's control class: small
        HTTP calls and token streams) go ahead of queued bulk bytes: they
        depart after their own serialization time and take their share of the
        bucket, so bulk bytes handed over after them wait that much longer
        (bulk bytes already scheduled keep their times: a control message
        overshoots the rate by its own size). Order within one connection is
        the relay pipe's (FIFO per pipe)."""
        if self.is_cut:
            return math.inf
        if priority:
            now = self._refill(now)
            serialize_s = 0.0
            if self.rate_bytes_s is not None:
                self._tokens -= nbytes
                serialize_s = nbytes / self.rate_bytes_s
            self.num_bytes_scheduled += nbytes
            return now + serialize_s + self._delay()
        depart_s = self.departure(now, nbytes)
        self._last_delivery_s = max(self._last_delivery_s, depart_s + self._delay())
        self.num_bytes_scheduled += nbytes
        return self._last_delivery_s

    def _delay(self) -> float:
        if self.jitter_s > 0:
            return max(0.0, self.latency_s + self._rng.uniform(-self.jitter_s, self.jitter_s))
        return self.latency_s

    def backlog_s(self, now: float) -> float:
        """How long bytes handed over now wait for the bucket (0 when idle)."""
        if self.rate_bytes_s is None or self._last_s is None:
            return 0.0
        tokens = min(float(self.burst_bytes), self._tokens + (max(now, self._last_s) - self._last_s) * self.rate_bytes_s)
        return max(0.0, -tokens / self.rate_bytes_s)

    def config(self) -> dict:
        return {"rate_bytes_s": self.rate_bytes_s, "latency_s": self.latency_s, "jitter_s": self.jitter_s,
                "burst_bytes": self.burst_bytes, "is_cut": self.is_cut}
