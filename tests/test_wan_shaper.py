import math

import pytest

from pdd.wan.shaper import DEFAULT_RATE_BYTES_S, Shaper


def test_rate_latency_and_burst():
    sh = Shaper(rate_bytes_s=1_000_000, latency_s=0.02, jitter_s=0, burst_bytes=100_000)
    assert sh.schedule(0.0, 100_000) == pytest.approx(0.02)  # the burst leaves at once
    assert sh.schedule(0.0, 500_000) == pytest.approx(0.52)  # then the bucket's rate
    assert sh.backlog_s(0.1) == pytest.approx(0.4)
    assert sh.schedule(10.0, 50_000) == pytest.approx(10.02)  # idle: the bucket refilled


def test_long_run_rate_is_exact():
    sh = Shaper(rate_bytes_s=20e6, latency_s=0.0, jitter_s=0, burst_bytes=64 * 1024)
    t, last = 0.0, 0.0
    for _ in range(1000):  # 64 KiB offered every ms (far above the rate)
        last = sh.schedule(t, 65536)
        t += 0.001
    assert 1000 * 65536 / last == pytest.approx(20e6, rel=0.01)


def test_jitter_never_reorders_and_is_seeded():
    def run(seed):
        sh = Shaper(rate_bytes_s=None, latency_s=0.02, jitter_s=0.01, seed=seed)
        return [sh.schedule(i * 0.001, 100) for i in range(2000)]
    a = run(1)
    assert all(x <= y for x, y in zip(a, a[1:]))
    assert a == run(1) and a != run(2)
    delays = [d - i * 0.001 for i, d in enumerate(a)]
    assert 0.01 <= min(delays) and max(delays) <= 0.03 + 0.001


def test_reconfigure_cut_restore_and_unlimited():
    sh = Shaper(rate_bytes_s=1e6, latency_s=0.01, jitter_s=0, burst_bytes=1)
    sh.configure(rate_bytes_s=None, latency_s=0.05)
    assert sh.schedule(1.0, 10**9) == pytest.approx(1.05)
    sh.cut()
    assert sh.schedule(2.0, 1) == math.inf
    sh.restore()
    assert sh.schedule(3.0, 1) == pytest.approx(3.05)
    with pytest.raises(ValueError):
        sh.configure(latency_s=-1)
    assert DEFAULT_RATE_BYTES_S == 50e6  # 400 Mbit/s: a 190 MB uncached 4K prompt takes ~3.8 s


def test_priority_bytes_go_ahead_of_queued_bulk_and_take_their_share():
    """A 1 KB control message handed over behind 0.5 s of queued KV bytes
    arrives after its latency (and its own serialization), not after the
    queue; bulk bytes handed over after it wait for its share of the line."""
    sh = Shaper(rate_bytes_s=1_000_000, latency_s=0.02, jitter_s=0, burst_bytes=1)
    assert sh.schedule(0.0, 500_000) == pytest.approx(0.52, abs=1e-5)            # bulk: 0.5 s queued
    assert sh.schedule(0.1, 1_000, priority=True) == pytest.approx(0.121, abs=1e-5)
    assert sh.schedule(0.1, 1_000) == pytest.approx(0.522, abs=1e-5)             # bulk after it: 2 KB queued
    assert sh.schedule(0.2, 1_000, priority=True) == pytest.approx(0.221, abs=1e-5)
    sh.cut()
    assert sh.schedule(0.3, 10, priority=True) == math.inf
