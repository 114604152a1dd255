"""Copies the router has routed over the WAN that P does not report yet count
as queued ahead of a new transfer, until P reports them or they end; the
lifecycle notes each request's copy and its end. Pure, no clock."""

import pytest

from pdd.policy import Pipeline, PipelineDecision, PolicyConfig, RequestFacts
from pdd.policy.copies_ahead import DispatchedCopies
from pdd.policy.lifecycle import RequestLifecycle
from pdd.policy.lifecycle_io import ClientGone, Prefilled, PrefillEnded, TransferEnded
from pdd.policy.views import LinkEstimate

LINE = LinkEstimate(throughput_bytes_s=1e6, rtt_s=0.04, queued_bytes=2e6, queued_flows=1)


def test_unreported_copies_queue_ahead_by_kind():
    c = DispatchedCopies()
    assert c.ahead(LINE) is LINE
    c.sent("a", 3_000_000, background=False)
    c.sent("b", 5_000_000, background=True)
    c.sent("c", 0, background=False)            # nothing crosses: not counted
    est = c.ahead(LINE)
    assert (est.queued_bytes, est.queued_flows) == (5e6, 2)
    assert (est.queued_background_bytes, est.queued_background_flows) == (5e6, 1)
    # A direct transfer of 1 MB now waits behind both foreground ones (each
    # puts at most its own share ahead), a background copy behind everything.
    assert est.transfer_s(1_000_000) == pytest.approx(0.04 + (2e6 + 1e6) / 1e6)
    assert est.transfer_s(1_000_000, background=True) > est.transfer_s(1_000_000)
    assert LINE.transfer_s(1_000_000) < est.transfer_s(1_000_000)


def test_a_copy_leaves_the_count_when_p_reports_it_or_it_ends():
    c = DispatchedCopies()
    c.sent("a", 3_000_000, background=False)
    c.sent("b", 5_000_000, background=True)
    c.reported(["a", "zzz"])                     # P's backlog covers it now: counted there
    assert len(c) == 1 and c.ahead(LINE).queued_bytes == LINE.queued_bytes
    c.ended("b")
    c.ended("b")                                 # twice is harmless
    assert len(c) == 0 and c.ahead(LINE) is LINE


def lifecycle(pipeline, copies, missing=4_000_000):
    d = PipelineDecision(pipeline, "p0", "r0" if pipeline is Pipeline.RELAY else None, "m0", True, missing,
                         2.0, "test")
    return RequestLifecycle(RequestFacts("req", 4096, 20, 1000, 16), d, PolicyConfig(), copies=copies)


@pytest.mark.parametrize("pipeline, background", [(Pipeline.DIRECT, False), (Pipeline.RELAY, True)])
def test_the_lifecycle_counts_its_copy_from_start_until_it_ends(pipeline, background):
    copies = DispatchedCopies()
    lc = lifecycle(pipeline, copies)
    assert len(copies) == 0
    lc.start(0.0)
    est = copies.ahead(LinkEstimate(1e6, 0.04))
    assert (est.queued_background_bytes if background else est.queued_bytes) == 4_000_000
    lc.handle(Prefilled(1.0, 7))
    assert len(copies) == 1
    lc.handle(TransferEnded(2.0, "m0", True))
    assert len(copies) == 0


def test_a_request_that_ends_early_leaves_nothing_counted():
    copies = DispatchedCopies()
    lc = lifecycle(Pipeline.DIRECT, copies)
    lc.start(0.0)
    lc.handle(ClientGone(0.5))
    assert lc.done is not None and len(copies) == 0
    lc2 = lifecycle(Pipeline.RELAY, copies)
    lc2.start(0.0)
    lc2.handle(PrefillEnded(0.3, "prefill failed"))
    assert len(copies) == 0


def test_an_rld_transfer_ending_does_not_end_the_wan_copy():
    copies = DispatchedCopies()
    lc = lifecycle(Pipeline.RELAY, copies)
    lc.start(0.0)
    lc.handle(Prefilled(1.0, 7))
    lc.handle(TransferEnded(1.1, "r0", True))
    assert len(copies) == 1
