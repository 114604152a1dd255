import math

import pytest

from pdd.policy import LinkEstimate, LinkEstimator

GB = 1e9


def test_prior_from_line():
    est = LinkEstimator.from_line(10e9, 0.025).estimate(0.0)
    assert est.throughput_bytes_s == pytest.approx(1.25 * GB)
    assert est.rtt_s == pytest.approx(0.05)
    assert est.up


def test_converges_to_observed_throughput():
    le = LinkEstimator(LinkEstimate(1.25 * GB, 0.05))
    for k in range(60):
        # 100 MB in 0.05 s RTT + 0.4 s payload -> 250 MB/s
        le.observe(float(k), 100_000_000, 0.45)
    assert le.estimate(60.0).throughput_bytes_s == pytest.approx(250e6, rel=1e-3)


def test_small_transfers_feed_only_the_rtt():
    le = LinkEstimator(LinkEstimate(1.25 * GB, 0.05))
    for k in range(60):
        le.observe(float(k), 1_000, 0.2)
    est = le.estimate(60.0)
    assert est.throughput_bytes_s == pytest.approx(1.25 * GB)
    assert est.rtt_s == pytest.approx(0.2, rel=1e-3)


def test_failure_marks_down_until_next_success():
    le = LinkEstimator(LinkEstimate(1.25 * GB, 0.05))
    le.observe_failure(1.0)
    est = le.estimate(1.0)
    assert not est.usable and math.isinf(est.transfer_s(10))
    le.observe_rtt(2.0, 0.05)
    assert le.estimate(2.0).usable


def test_time_must_not_go_backwards():
    le = LinkEstimator(LinkEstimate(1.0, 0.05))
    le.observe_rtt(5.0, 0.05)
    with pytest.raises(ValueError):
        le.observe_rtt(4.0, 0.05)


def test_transfer_time_is_rtt_plus_bytes_over_rate():
    assert LinkEstimate(1e6, 0.1).transfer_s(2_000_000) == pytest.approx(2.1)


def test_fixed_overhead_is_not_mistaken_for_a_slow_line():
    # A 25 MB/s line whose receiver adds 0.3 s to every transfer (it imports
    # between engine steps). Cold prompts (50 MB) and follow-ups (4 MB) alternate.
    line, overhead, rtt = 25e6, 0.3, 0.045
    le = LinkEstimator(LinkEstimate(line, rtt))
    t = 0.0
    for k in range(20):
        size = 50_000_000 if k % 3 == 0 else 4_000_000
        t += 1.0
        le.observe(t, size, rtt + overhead + size / line)
    est = le.estimate(t)
    assert est.throughput_bytes_s == pytest.approx(line, rel=1e-6)
    assert est.overhead_s == pytest.approx(overhead, rel=1e-6)
    # A follow-up's time is predicted right, not as 4 MB at a rate dragged down by the overhead.
    assert est.transfer_s(4_000_000) == pytest.approx(rtt + overhead + 0.16, rel=1e-6)


def test_equal_sizes_keep_the_single_rate_estimate():
    le = LinkEstimator(LinkEstimate(1.25 * GB, 0.05))
    for k in range(40):
        le.observe(float(k), 10_000_000, 0.15)
    est = le.estimate(40.0)
    assert est.overhead_s == 0.0
    assert est.throughput_bytes_s == pytest.approx(1e8, rel=0.01)     # 10 MB in 0.1 s payload


MB = 1e6


def test_a_copy_paced_by_its_prefill_does_not_make_the_line_look_fast():
    """A cold prompt's 90 MB copy streamed with its 10 s prefill: the sender
    waited ~9.5 s of it for P's slices (the bytes it had written crossing
    meanwhile). The line (12.5 MB/s) is neither 150 MB/s (its time less the
    waits, as the router once counted) nor P's 9 MB/s: such a copy only
    bounds the rate from below, and the configured line stays the estimate."""
    le = LinkEstimator.from_line(100e6, 0.02)
    for k in range(10):
        le.observe_transfer(10.0 * k, 90 * MB, elapsed_s=10.0, paced_s=9.5)
    assert le.estimate(100.0).throughput_bytes_s == pytest.approx(12.5 * MB)


def test_paced_copies_raise_a_floor_that_fades():
    le = LinkEstimator.from_line(100e6, 0.02)
    for k in range(30):                   # 40 MB in 2 s while P paced it: the line does >= 20 MB/s
        le.observe_transfer(float(k), 40 * MB, elapsed_s=2.0, paced_s=1.0)
    assert le.estimate(30.0).throughput_bytes_s == pytest.approx(40 * MB / 2.0, rel=0.1)
    # Without news the floor halves every minute, back toward what the full samples say.
    assert le.estimate(29.0 + 60.0).throughput_bytes_s == pytest.approx(12.5 * MB, rel=0.01)


def test_time_spent_yielding_the_line_is_not_its_speed():
    le = LinkEstimator.from_line(100e6, 0.0)
    for k in range(40):                   # 25 MB, 4 s, 2 of them yielding to others: 12.5 MB/s
        le.observe_transfer(float(k), 25 * MB, elapsed_s=4.0, yielded_s=2.0)
    assert le.estimate(40.0).throughput_bytes_s == pytest.approx(12.5 * MB, rel=0.01)


def test_short_paced_copies_keep_the_estimate_near_the_line():
    """Warm turns whose one block (0.37 MB) streamed with a ~0.1 s prefill,
    and block-less transfers that waited for P: neither may inflate the RTT
    nor, through it, push the floor to several times the line (seen in the
    simulator at 22 MB/s on a 7.5 MB/s line, and a cold 40 MB prompt sent
    direct on a 0.02 s estimate)."""
    le = LinkEstimator.from_line(60e6, 0.02)
    t = 0.0
    for _ in range(40):
        t += 1.0
        le.observe_transfer(t, 0, elapsed_s=0.2, handshake_s=0.045, paced_s=0.022)
        t += 1.0
        le.observe_transfer(t, 368_640, elapsed_s=0.367, handshake_s=0.045, yielded_s=0.27, paced_s=0.096)
    est = le.estimate(t)
    assert est.rtt_s < 0.08
    assert est.throughput_bytes_s < 1.2 * 7.5 * MB


def test_a_transfer_that_shared_the_line_is_no_rate_sample():
    """Four cold copies crossing together each take 4x as long; small ones
    behind another's buffered bytes look like a fixed cost. The router counts
    the queue ahead of a new transfer itself: neither may move the rate, the
    fixed cost or the round trip. A paced one still bounds the rate."""
    le = LinkEstimator.from_line(60e6, 0.02)
    for k in range(20):
        le.observe_transfer(float(k), 45 * MB, elapsed_s=24.0, handshake_s=0.045, shared=True)
        le.observe_transfer(k + 0.5, 368_640, elapsed_s=0.6, handshake_s=0.045, shared=True)
        le.observe_transfer(k + 0.6, 0, elapsed_s=0.4, handshake_s=0.3, shared=True)
    est = le.estimate(20.0)
    assert est.throughput_bytes_s == pytest.approx(7.5 * MB) and est.overhead_s == 0.0
    assert est.rtt_s == pytest.approx(0.04)
    for k in range(10):
        le.observe_transfer(21.0 + k, 40 * MB, elapsed_s=2.0, paced_s=1.5, shared=True)
    assert le.estimate(30.0).throughput_bytes_s > 15 * MB          # at least 40 MB in 2 s


def test_a_small_copy_subtracts_its_own_round_trip_not_a_stale_estimate():
    """After a crowded spell the round-trip estimate runs high (pings queued
    behind copies). Small copies on the freed line, each timed with its own
    BEGIN -> HAVE, must not read as many times the line: with the estimate
    subtracted (0.2 s from 0.12 s) a 0.37 MB copy read 30 MB/s on a 7.5 MB/s
    line and the estimate reached 18 MB/s (results/heldout-agentic-19s1)."""
    le = LinkEstimator.from_line(60e6, 0.025)
    for k in range(10):
        le.observe_rtt(float(k), 0.22)                 # pings behind the copies
    assert le.estimate(10.0).rtt_s > 0.18
    for k in range(12):
        # 0.37 MB: 0.049 s of bytes at 7.5 MB/s + a 0.048 s handshake + the END
        le.observe_transfer(11.0 + k, 368_640, elapsed_s=0.12, handshake_s=0.048)
    rate = le.estimate(30.0).throughput_bytes_s
    assert 4 * MB < rate < 10 * MB, rate / MB
