"""What the WAN delivers, folded from observed transfers.

The data plane reports facts (a transfer of N bytes took D seconds; a ping
took R seconds; a transfer failed); the estimator keeps exponentially
weighted means, starting from a prior taken from the configured line.
Time is passed in; nothing here reads a clock.

Throughput samples subtract the current RTT estimate from the duration, since
each transfer pays one handshake round trip (BEGIN -> HAVE) before the bytes
flow; transfers too small to say anything about bandwidth only feed the RTT.

A transfer also pays a fixed cost that is not bandwidth: a busy receiver puts
the blocks into its pool between two engine steps, so the KV is usable only
after the step under way (hundreds of ms on a CPU). Folded into the rate, it
makes a small transfer look like a slow line, and a 4 MB follow-up would be
judged as slow as a cold prompt. So the estimator also fits duration =
a + bytes / rate over recent transfers of varied sizes (exponentially
weighted least squares); when the sizes vary enough, the slope gives the rate
and the intercept, less the RTT, the fixed overhead.

A copy streamed with its prefill waited for P's blocks: P, not the line,
set its pace, so it only says the line is at least that fast
(`observe_at_least`: a floor under the estimate). The router and the
simulator feed the same call with the same kinds of time.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdd.policy.views import LinkEstimate


# A copy that waited for P this long, and this share of its time on the
# line, was paced by P: it bounds the line's rate from below only.
PACED_MIN_S = 0.05
PACED_MIN_SHARE = 0.05
# A lower bound fades by half over this long without a new one.
FLOOR_HALF_LIFE_S = 60.0


@dataclass(frozen=True)
class EstimatorConfig:
    alpha: float = 0.2                     # weight of one new sample
    min_sample_bytes: int = 256 * 1024     # below: latency-dominated, no throughput sample
    fit_min_samples: int = 4               # throughput samples before the two-term fit is used
    fit_min_spread: float = 0.5            # ... and their sizes' std / mean at least this

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
        self._floor, self._floor_s = 0.0, None   # lower bounds from paced copies (`observe_at_least`)
        # Exponentially weighted moments of (MB, seconds) of throughput samples.
        self._mx = self._my = self._mxx = self._mxy = 0.0

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

    def _landed(self, now: float, num_bytes: int, duration_s: float, what: str,
                less_rtt: bool = True, rtt_s: float | None = None) -> float | None:
        """A transfer that delivered: check, note the time and that the link is
        up; its rate (bytes over the time, less one round trip if `less_rtt`:
        `rtt_s`, or the estimate), or None for one too small to say anything
        about bandwidth."""
        if num_bytes < 0 or duration_s <= 0:
            raise ValueError(f"{what} needs num_bytes >= 0 and duration_s > 0")
        self._tick(now)
        self._up = True
        if num_bytes < self.cfg.min_sample_bytes:
            return None
        if not less_rtt:
            return num_bytes / duration_s
        rtt = self._rtt if rtt_s is None else rtt_s
        return num_bytes / max(duration_s - rtt, duration_s * 0.1)

    def observe(self, now: float, num_bytes: int, duration_s: float, rtt_s: float | None = None) -> None:
        """A completed transfer: `num_bytes` delivered in `duration_s` (handshake
        included); `rtt_s`: the round trip it paid, where it measured one (else
        the estimate's)."""
        sample = self._landed(now, num_bytes, duration_s, "observe", rtt_s=rtt_s)
        if sample is None:
            # A small transfer is mostly the round trip: it bounds the RTT.
            self._rtt = self._fold(self._rtt, duration_s)
            return
        self._throughput = self._fold(self._throughput, sample)
        self.num_samples += 1
        # The first samples weigh equally, later ones exponentially.
        w = max(self.cfg.alpha, 1.0 / self.num_samples)
        x, y = num_bytes / 1e6, duration_s
        self._mx += w * (x - self._mx)
        self._my += w * (y - self._my)
        self._mxx += w * (x * x - self._mxx)
        self._mxy += w * (x * y - self._mxy)

    def observe_transfer(self, now: float, num_bytes: int, elapsed_s: float, handshake_s: float = 0.0,
                         yielded_s: float = 0.0, paced_s: float = 0.0, shared: bool = False) -> None:
        """A completed transfer as its sender timed it.

        Left out of its time on the line: what the receiver held its HAVE
        back beyond one round trip (another transfer was bringing it the
        same blocks: queueing behind a sibling) and what a background copy
        spent yielding the line to others. `paced_s`: the time it waited for
        P to compute its blocks (streamed with the prefill). Such a copy
        crossed at P's pace, with the line idle between P's slices, so its
        rate is only a *lower bound* on the line's (`observe_at_least`).
        `shared`: another transfer sent on the line during this one; its time
        then says how the line was shared, which the router counts apart
        (the backlog ahead of a new transfer), not how fast the line is: it
        is no rate sample (a paced one still bounds the rate from below),
        nor a round-trip one. Counted, the opening burst's four cold copies
        sharing the line read 2-4 MB/s on a 7.5 MB/s line, and small copies
        behind a yielding copy's buffered bytes a fixed cost of 0.35 s: the
        router judged a one-block transfer 0.4 s away (`results/wb-dbg-1`).
        Subtracting the waits instead is wrong the other way: the sender
        waits while the bytes it wrote last are still in socket buffers on
        their way, and a cold prompt's copy then looked 10x faster than the
        line (`results/wan-bound-10`: 127 MB/s estimated on a 12.5 MB/s line).
        """
        held_back = max(0.0, handshake_s - self._rtt)
        line_s = max(elapsed_s - held_back - yielded_s, 1e-6)
        paced = paced_s > max(PACED_MIN_S, PACED_MIN_SHARE * line_s)
        if shared:
            if paced:
                self.observe_at_least(now, num_bytes, line_s)
            else:
                self._landed(now, num_bytes, line_s, "observe_transfer")
            return
        if num_bytes < self.cfg.min_sample_bytes:
            # Too small for a rate: it bounds the round trip, by its time less
            # what it waited for P, or by its handshake (BEGIN -> HAVE) where
            # that is shorter. Its whole time, as counted before, includes the
            # prefill it streamed with and the END's answer: the RTT grew to
            # 0.2 s on a 45 ms line, and rate samples that subtract it read
            # 3x the line (the simulator, wan-bound preset, agents quoting
            # their answers: one-block warm turns).
            rtt = line_s - paced_s
            if handshake_s > 0:
                rtt = min(rtt, handshake_s)
            self.observe(now, num_bytes, max(rtt, 1e-6))
        elif paced:
            self.observe_at_least(now, num_bytes, line_s)
        else:
            # Less the round trip this transfer paid (its own BEGIN -> HAVE, where
            # shorter than the estimate): after a crowded spell the estimate runs
            # high for a while, and a 0.37 MB copy of 0.12 s less a 0.2 s estimate
            # read 30 MB/s on a 7.5 MB/s line; the estimate reached 18 MB/s and a
            # 35 MB copy judged 0.2 s away took 3.9 s (`results/heldout-agentic-19s1`).
            self.observe(now, num_bytes, line_s, rtt_s=min(self._rtt, handshake_s) if handshake_s > 0 else None)

    def observe_at_least(self, now: float, num_bytes: int, duration_s: float) -> None:
        """A transfer that shows only that the line is at least this fast:
        it raises a floor under the estimate (halving every FLOOR_HALF_LIFE_S
        without news), never lowers the rate. Its bytes over its whole time:
        a bound must not lean on the round-trip estimate, which subtracted
        from a short paced copy's time made it look many times the line."""
        sample = self._landed(now, num_bytes, duration_s, "observe_at_least", less_rtt=False)
        if sample is None:
            return
        floor = self._floor_at(now)
        if sample > floor:
            self._floor, self._floor_s = floor + self.cfg.alpha * (sample - floor), now

    def _floor_at(self, now: float) -> float:
        if self._floor_s is None:
            return 0.0
        return self._floor * 0.5 ** (max(now - self._floor_s, 0.0) / FLOOR_HALF_LIFE_S)

    def _fit(self) -> tuple[float, float] | None:
        """(rate in bytes/s, overhead s) from the two-term fit, when it is trustworthy."""
        if self.num_samples < self.cfg.fit_min_samples or self._mx <= 0:
            return None
        var = self._mxx - self._mx * self._mx
        if var <= (self.cfg.fit_min_spread * self._mx) ** 2:
            return None
        slope = (self._mxy - self._mx * self._my) / var       # seconds per MB
        if slope <= 0:
            return None
        intercept = self._my - slope * self._mx
        return 1e6 / slope, max(intercept - self._rtt, 0.0)

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
        # The samples do not age; only the floor from paced copies fades with `now`.
        floor = self._floor_at(now)
        fit = self._fit()
        if fit is None:
            return LinkEstimate(max(self._throughput, floor), self._rtt, up=self._up)
        rate, overhead = fit
        return LinkEstimate(max(rate, floor), self._rtt, up=self._up, overhead_s=overhead)
