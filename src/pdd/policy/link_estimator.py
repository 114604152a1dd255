"""What the WAN delivers, folded from observed transfers.

The data plane reports facts (a transfer of N bytes took D seconds; a ping
took R seconds; a transfer failed); the estimator keeps exponentially
weighted means, starting from a prior taken from the configured line.
Time is passed in; nothing here reads a clock.

Throughput samples subtract the current RTT estimate from the duration, since
each transfer pays one handshake round trip (BEGIN -> HAVE) before the bytes
flow; transfers too small to say anything about bandwidth only feed the RTT.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdd.policy.views import LinkEstimate


@dataclass(frozen=True)
class EstimatorConfig:
    alpha: float = 0.2                     # weight of one new sample
    min_sample_bytes: int = 256 * 1024     # below: latency-dominated, no throughput sample

    def __post_init__(self) -> None:
        if not 0.0 < self.alpha <= 1.0:
            raise ValueError("alpha must be in (0, 1]")
        if self.min_sample_bytes < 0:
            raise ValueError("min_sample_bytes must be >= 0")


class LinkEstimator:
    def __init__(self, prior: LinkEstimate, cfg: EstimatorConfig | None = None) -> None:
        if not prior.usable:
            raise ValueError("the prior must describe a working link")
        self.cfg = cfg or EstimatorConfig()
        self._throughput = prior.throughput_bytes_s
        self._rtt = prior.rtt_s
        self._up = True
        self._last_s: float | None = None
        self.num_samples = 0

    @classmethod
    def from_line(cls, bandwidth_bits_s: float, latency_s: float,
                  cfg: EstimatorConfig | None = None) -> "LinkEstimator":
        """Prior from the configured line: bits/s and one-way latency."""
        return cls(LinkEstimate(bandwidth_bits_s / 8.0, 2.0 * latency_s), cfg)

    def _tick(self, now: float) -> None:
        if self._last_s is not None and now < self._last_s:
            raise ValueError(f"time went backwards: {now} < {self._last_s}")
        self._last_s = now

    def _fold(self, old: float, sample: float) -> float:
        return old + self.cfg.alpha * (sample - old)

    def observe(self, now: float, num_bytes: int, duration_s: float) -> None:
        """A completed transfer: `num_bytes` delivered in `duration_s` (handshake included)."""
        if num_bytes < 0 or duration_s <= 0:
            raise ValueError("observe needs num_bytes >= 0 and duration_s > 0")
        self._tick(now)
        self._up = True
        if num_bytes < self.cfg.min_sample_bytes:
            # A small transfer is mostly the round trip: it bounds the RTT.
            self._rtt = self._fold(self._rtt, duration_s)
            return
        payload_s = max(duration_s - self._rtt, duration_s * 0.1)
        self._throughput = self._fold(self._throughput, num_bytes / payload_s)
        self.num_samples += 1

    def observe_rtt(self, now: float, rtt_s: float) -> None:
        if rtt_s < 0:
            raise ValueError("rtt_s must be >= 0")
        self._tick(now)
        self._up = True
        self._rtt = self._fold(self._rtt, rtt_s)

    def observe_failure(self, now: float) -> None:
        """A transfer or probe failed: the link counts as down until the next success."""
        self._tick(now)
        self._up = False

    def estimate(self, now: float) -> LinkEstimate:
        # `now` is part of the contract so that a later version may age stale
        # samples toward the prior; today the estimate does not decay.
        del now
        return LinkEstimate(self._throughput, self._rtt, up=self._up)
