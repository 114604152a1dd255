"""Percentiles, SLA goodput and BCR against hand-computed cases."""

import math

import pytest

from pdd.measure.metrics import (
    Pricing,
    Sla,
    cost_per_million_tokens,
    distribution,
    first_gap_ratio,
    handoff_gap_ratio,
    meets_sla,
    percentile,
    relative_change,
    summarize_mode,
)
from pdd.measure.records import RequestRecord


def rec(rid, arrival, times, prompt=100, cached=0, failed=False, **kw):
    ttft = (times[0] - arrival) if times else None
    return RequestRecord(rid, arrival, prompt, len(times), cached_tokens=cached, ttft_s=ttft,
                         token_times_s=times, e2e_s=None if failed else times[-1] - arrival,
                         failed=failed, **kw)


def test_percentile_linear_interpolation():
    xs = [4.0, 1.0, 3.0, 2.0]
    assert percentile(xs, 0) == 1.0
    assert percentile(xs, 100) == 4.0
    assert percentile(xs, 50) == 2.5            # between 2 and 3
    assert percentile(xs, 90) == pytest.approx(3.7)  # pos 2.7 -> 3 + 0.7
    assert percentile([5.0], 99) == 5.0
    assert math.isnan(percentile([], 50))
    d = distribution([1.0, 2.0, 3.0])
    assert d["mean"] == 2.0 and d["p50"] == 2.0 and d["p90"] == pytest.approx(2.8)


def test_record_derived_values():
    r = rec("a", 1.0, [1.5, 1.7, 2.1])
    assert r.ttft_s == 0.5
    assert r.itls_s == pytest.approx([0.2, 0.4])
    assert r.tpot_s == pytest.approx(0.3)
    assert rec("b", 0.0, [0.3]).tpot_s is None


def test_goodput_and_bcr_by_hand():
    sla = Sla(ttft_s=1.0, tpot_s=0.1)
    records = [
        rec("ok1", 0.0, [0.5, 0.55, 0.6], cached=50, wan_bytes=1000),   # meets SLA
        rec("ok2", 1.0, [1.9, 1.95], cached=90, rld_tokens=1),          # meets SLA
        rec("slow_ttft", 2.0, [3.5, 3.55]),                             # TTFT 1.5 > 1.0
        rec("slow_tpot", 3.0, [3.2, 3.5, 3.8]),                         # TPOT 0.3 > 0.1
        rec("failed", 4.0, [], failed=True, error="boom"),
    ]
    assert [meets_sla(r, sla) for r in records] == [True, True, False, False, False]
    s = summarize_mode(records, sla, cost_per_hour=4.0, duration_s=10.0)
    assert s["num_requests"] == 5 and s["num_failed"] == 1
    assert s["sla_attainment"] == pytest.approx(2 / 5)
    assert s["goodput_rps"] == pytest.approx(0.2)               # 2 good / 10 s
    assert s["bcr"] == pytest.approx(0.05)                      # 0.2 / 4.0 per hour
    assert s["throughput_tok_s"] == pytest.approx(1.0)          # 3+2+2+3 tokens / 10 s
    assert s["ttft_s"]["p50"] == pytest.approx(0.7)             # [0.2, 0.5, 0.9, 1.5]
    assert s["ttft_s"]["mean"] == pytest.approx(0.775)
    assert s["wan_bytes"] == 1000
    assert s["rld_token_share"] == pytest.approx(0.1)           # 1 of 10 output tokens
    assert s["prefix_hit_rate"] == pytest.approx(140 / 500)
    # Revenue of the two SLA requests at $1 / $4 per M tokens, cached input at 25%:
    # ok1: 50 + 50 * 0.25 input, 3 output; ok2: 10 + 90 * 0.25 input, 2 output.
    earned = ((62.5 + 32.5) * 1.0 + 5 * 4.0) / 1e6
    assert s["revenue_per_hour"] == pytest.approx(earned / 10.0 * 3600)
    assert s["revenue_bcr"] == pytest.approx(earned / 10.0 * 3600 / 4.0)
    cheap = summarize_mode(records, sla, 4.0, 10.0, Pricing(cached_input_fraction=0.1))
    assert cheap["revenue_per_hour"] < s["revenue_per_hour"]


def test_handoff_gap_ratio():
    a = rec("a", 0.0, [0.1, 0.2, 0.3, 0.8], handoff_gap_s=0.5, rld_tokens=3)   # gaps 0.1, 0.1, 0.5
    b = rec("b", 0.0, [0.1, 0.2, 0.3])
    assert handoff_gap_ratio([a, b]) == pytest.approx(5.0)       # 0.5 / median 0.1
    assert handoff_gap_ratio([b]) is None
    c = rec("c", 0.0, [0.1, 0.2, 0.3, 0.5], handoff_gap_s=0.2, rld_tokens=3)
    d = rec("d", 0.0, [0.1, 0.2, 0.3, 0.6], handoff_gap_s=0.3, rld_tokens=3)
    assert handoff_gap_ratio([a, c, d]) == pytest.approx(5.0)        # the largest
    assert handoff_gap_ratio([a, c, d], 50) == pytest.approx(3.0)    # the median handoff's: 0.3 / 0.1


def test_first_gap_ratio_counts_only_first_tokens_from_p():
    a = rec("a", 0.0, [0.1, 0.4, 0.5, 0.6], first_token_from_p=True)    # waited 0.3 for MD
    b = rec("b", 0.0, [0.1, 0.2, 0.3, 0.4])
    c = rec("c", 0.0, [0.1, 0.3, 0.4, 0.5], first_token_from_p=True)
    assert first_gap_ratio([b]) is None
    assert first_gap_ratio([a, b, c]) == pytest.approx(3.0)          # 0.3 / median 0.1
    assert first_gap_ratio([a, b, c], 50) == pytest.approx(2.5)      # median of 0.3 and 0.2
    m = summarize_mode([a, b, c], Sla(1.0, 1.0), 1.0, 1.0)
    assert m["num_first_from_p"] == 2 and m["first_gap_ratio"] == pytest.approx(3.0)


def test_a_relay_whose_first_token_came_from_p_counts_rlds_own_tokens_only():
    """P sent a relay's first token: every RLD token is RLD's own decoding, so
    one is enough for a handoff; none (MD relieved RLD at once) is an early
    first token only."""
    one = rec("o", 0.0, [0.1, 0.2, 0.4, 0.5], handoff_gap_s=0.2, rld_tokens=1, first_token_from_p=True)
    none = rec("n", 0.0, [0.1, 0.5, 0.6, 0.7], handoff_gap_s=0.4, rld_tokens=0, first_token_from_p=True)
    plain = rec("p", 0.0, [0.1, 0.2, 0.3, 0.4])
    assert handoff_gap_ratio([one, none, plain]) == pytest.approx(2.0)     # only `one`: 0.2 / 0.1
    assert first_gap_ratio([none, plain]) == pytest.approx(4.0)


def test_a_relay_relieved_before_rld_decoded_is_an_early_first_token_not_a_handoff():
    """RLD passed on P's first token only (rld_tokens 1) when MD took over: the
    user's wait for MD's first token is the early first token's gap; a switch
    from RLD's own decoding (rld_tokens >= 2) is a handoff."""
    early = rec("e", 0.0, [0.1, 0.5, 0.6, 0.7], handoff_gap_s=0.4, rld_tokens=1)
    switch = rec("s", 0.0, [0.1, 0.2, 0.4, 0.5], handoff_gap_s=0.2, rld_tokens=2)
    plain = rec("p", 0.0, [0.1, 0.2, 0.3, 0.4])
    assert handoff_gap_ratio([early, switch, plain]) == pytest.approx(2.0)     # 0.2 / median 0.1
    assert first_gap_ratio([early, switch, plain]) == pytest.approx(4.0)       # 0.4 / 0.1
    m = summarize_mode([early, switch, plain], Sla(1.0, 1.0), 1.0, 1.0)
    assert m["num_handoffs"] == 1 and m["num_first_from_p"] == 1


def test_relative_change_and_cost_per_token():
    assert relative_change(6.7, 4.2) == pytest.approx(0.5952, abs=1e-4)
    assert relative_change(1.0, 0.0) is None
    assert relative_change(None, 1.0) is None
    assert relative_change(float("nan"), 1.0) is None
    # $3.6/h at 1 token/s: 3600 tokens per hour -> $1000 per million tokens.
    assert cost_per_million_tokens(3.6, 1.0) == pytest.approx(1000.0)
    assert math.isinf(cost_per_million_tokens(3.6, 0.0))
