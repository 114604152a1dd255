"""Arithmetic of the side-by-side report: percentiles, SLA goodput, BCR.

Pure functions over RequestRecord lists; no I/O. Used by `pdd bench` and
`pdd sim` alike, so a measured and a simulated run are summarised the same way.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from pdd.measure.records import RequestRecord


# The SLA of `pdd bench` and `pdd sim` when none is given (--sla-ttft, --sla-tpot).
DEFAULT_SLA_TTFT_S = 3.0
DEFAULT_SLA_TPOT_S = 0.25


@dataclass(frozen=True)
class Sla:
    ttft_s: float
    tpot_s: float


@dataclass(frozen=True)
class Pricing:
    """What a served request earns, per million tokens (a typical API price list).

    Cached input tokens are billed at a fraction of uncached ones (10-25% in
    the report's market), so a higher hit rate is not automatically more
    revenue. Only requests within the SLA earn anything.
    """

    input_per_mtok: float = 1.0
    cached_input_fraction: float = 0.25
    output_per_mtok: float = 4.0

    def revenue(self, r: RequestRecord) -> float:
        cached = min(r.cached_tokens, r.prompt_tokens)
        tokens_in = (r.prompt_tokens - cached) + cached * self.cached_input_fraction
        return (tokens_in * self.input_per_mtok + r.output_tokens * self.output_per_mtok) / 1e6


DEFAULT_PRICING = Pricing()


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]), numpy's default method."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def distribution(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": math.nan, "p50": math.nan, "p90": math.nan, "p99": math.nan}
    return {
        "mean": statistics.fmean(values),
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
    }


def meets_sla(r: RequestRecord, sla: Sla) -> bool:
    if r.failed or r.ttft_s is None:
        return False
    tpot = r.tpot_s
    return r.ttft_s <= sla.ttft_s and (tpot is None or tpot <= sla.tpot_s)


def _over_median_itl(gaps: list[float], records: list[RequestRecord], q: float | None) -> float | None:
    """The largest of `gaps` (with q, that percentile of them) over the
    median inter-token gap of the finished requests."""
    itls = [x for r in records if not r.failed for x in r.itls_s]
    if not gaps or not itls:
        return None
    med = percentile(itls, 50)
    gap = max(gaps) if q is None else percentile(gaps, q)
    return gap / med if med > 0 else None


def rld_decoded(r: RequestRecord) -> int:
    """Tokens RLD decoded itself: its tokens less P's first when RLD passed
    that one on (a relay whose first token went out from P counts none of
    P's)."""
    return r.rld_tokens - (r.rld_tokens > 0 and not r.first_token_from_p)


def is_handoff(r: RequestRecord) -> bool:
    """MD took the stream over from RLD's own decoding: RLD made at least one
    token after P's first (`r`: a record, or the router's trace). A relayed
    request whose KV reached MD before RLD's first decode step hands over
    nothing (the user has P's token only, from P or as RLD passed it on),
    and its wait for MD's first token is the early first token's
    (`first_token_early`), as with a direct request's token from P."""
    return r.handoff_gap_s is not None and rld_decoded(r) >= 1


def first_token_early(r: RequestRecord) -> bool:
    """The user had P's first token before a decoder's: sent by P itself
    (direct, or a relay whose RLD was due within the stall bound) or by RLD,
    which MD then relieved before RLD decoded any."""
    return r.first_token_from_p or (r.handoff_gap_s is not None and r.rld_tokens == 1)


def handoff_gap_ratio(records: list[RequestRecord], q: float | None = None) -> float | None:
    """Largest inter-token gap at a handoff (`is_handoff`) divided by the median
    inter-token gap; with q, that percentile of the handoffs' gaps instead of
    the largest."""
    return _over_median_itl([r.handoff_gap_s for r in records if is_handoff(r)], records, q)


def first_gap_ratio(records: list[RequestRecord], q: float | None = None) -> float | None:
    """For requests whose first token came early (`first_token_early`): the
    gap before the second (the wait for MD the early token moved out of TTFT)
    over the median inter-token gap; the largest, or with q that percentile."""
    return _over_median_itl([r.itls_s[0] for r in records if first_token_early(r) and not r.failed and r.itls_s],
                            records, q)


def run_duration(records: list[RequestRecord]) -> float:
    """Seconds from the first arrival to the last token or completion."""
    if not records:
        return 0.0
    start = min(r.arrival_s for r in records)
    end = max([r.arrival_s + (r.e2e_s or 0.0) for r in records]
              + [t for r in records for t in r.token_times_s[-1:]])
    return max(0.0, end - start)


def summarize_mode(
    records: list[RequestRecord], sla: Sla, cost_per_hour: float, duration_s: float,
    pricing: Pricing = DEFAULT_PRICING,
) -> dict:
    """One mode's entry of summary.json (`modes.<mode>`)."""
    ok = [r for r in records if not r.failed]
    good = [r for r in records if meets_sla(r, sla)]
    goodput = len(good) / duration_s if duration_s > 0 else 0.0
    total_out = sum(r.output_tokens for r in ok)
    revenue_h = sum(pricing.revenue(r) for r in good) / duration_s * 3600.0 if duration_s > 0 else 0.0
    return {
        "num_requests": len(records),
        "num_failed": len(records) - len(ok),
        "duration_s": duration_s,
        "ttft_s": distribution([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_s": distribution([r.tpot_s for r in ok if r.tpot_s is not None]),
        "itl_s": distribution([x for r in ok for x in r.itls_s]),
        "e2e_s": distribution([r.e2e_s for r in ok if r.e2e_s is not None]),
        "sla": {"ttft_s": sla.ttft_s, "tpot_s": sla.tpot_s},
        "sla_attainment": len(good) / len(records) if records else 0.0,
        "goodput_rps": goodput,
        "throughput_tok_s": total_out / duration_s if duration_s > 0 else 0.0,
        "cost_per_hour": cost_per_hour,
        # BCR: requests/s within SLA per (cost/hour); higher is better.
        "bcr": goodput / cost_per_hour if cost_per_hour > 0 else math.nan,
        # The same with revenue as the benefit: SLA requests billed at `pricing`
        # (cached input at a fraction), per unit of hardware cost.
        "revenue_per_hour": revenue_h,
        "revenue_bcr": revenue_h / cost_per_hour if cost_per_hour > 0 else math.nan,
        "wan_bytes": sum(r.wan_bytes for r in records),
        "uncached_kv_bytes": sum(r.uncached_kv_bytes for r in records),
        "rld_token_share": (sum(r.rld_tokens for r in ok) / total_out) if total_out else 0.0,
        "handoff_gap_ratio": handoff_gap_ratio(records),
        "handoff_gap_ratio_p50": handoff_gap_ratio(records, 50),
        "num_handoffs": sum(1 for r in records if is_handoff(r)),
        "first_gap_ratio": first_gap_ratio(records),
        "first_gap_ratio_p50": first_gap_ratio(records, 50),
        "num_first_from_p": sum(1 for r in records if first_token_early(r)),
        "prefix_hit_rate": (
            sum(r.cached_tokens for r in records) / max(1, sum(r.prompt_tokens for r in records))
        ),
    }


def relative_change(new: float | None, old: float | None) -> float | None:
    """(new - old) / old; None when either is missing or old is zero."""
    if new is None or old is None or not math.isfinite(new) or not math.isfinite(old) or old == 0:
        return None
    return (new - old) / old


def cost_per_million_tokens(cost_per_hour: float, throughput_tok_s: float) -> float:
    """Hardware cost of one million output tokens at the measured throughput."""
    if throughput_tok_s <= 0:
        return math.inf
    return cost_per_hour / (throughput_tok_s * 3600.0) * 1e6
