import pytest

from pdd.policy import (
    PolicyConfig, PrefixReuseCounter, RequestFacts, predict_abnormal, should_cancel_wan,
    warm_after_skip, warm_tokens_after_cancel,
)

CFG = PolicyConfig()


def req(max_tokens):
    return RequestFacts("r", 100_000, max_tokens, 50_000, 16)


def test_short_output_long_transfer_is_abnormal():
    # 10 tokens * 30 ms * 1.25 = 0.375 s < 4 s of WAN
    assert predict_abnormal(req(10), 4.0, 0.03, CFG)


def test_long_output_is_not_abnormal():
    assert not predict_abnormal(req(1000), 4.0, 0.03, CFG)


def test_margin_is_applied():
    # 100 tokens * 30 ms = 3 s: ends before a 3.5 s transfer, but not with a 1.25 margin
    assert not predict_abnormal(req(100), 3.5, 0.03, CFG)
    assert predict_abnormal(req(100), 3.5, 0.03, PolicyConfig(filter_margin=1.0))


def test_filter_switch():
    assert not predict_abnormal(req(1), 100.0, 0.03, PolicyConfig(enable_filter=False))


def test_live_cancel():
    assert should_cancel_wan(0.0, tokens_left=5, est_remaining_wan_s=2.0, rld_tpot_s=0.03)
    assert not should_cancel_wan(0.0, tokens_left=500, est_remaining_wan_s=2.0, rld_tpot_s=0.03)
    with pytest.raises(ValueError):
        should_cancel_wan(0.0, -1, 1.0, 0.03)


def test_warming_only_hot_shared_prefixes_block_aligned():
    assert warm_tokens_after_cancel(1000, 0, 16, CFG) == 0
    assert warm_tokens_after_cancel(1000, 2, 16, CFG) == 992
    assert warm_tokens_after_cancel(1000, 5, 16, PolicyConfig(enable_drc=False)) == 0


def test_warm_after_skip_sends_only_what_md_lacks():
    # P held 520 tokens of this prompt (32 whole blocks), seen reused twice before.
    assert warm_after_skip(520, 0, 2, 16, CFG) == 512
    assert warm_after_skip(520, 300, 2, 16, CFG) == 512        # MD holds 18 blocks: send all 32
    assert warm_after_skip(520, 512, 2, 16, CFG) == 0          # MD has it already
    assert warm_after_skip(520, 0, 1, 16, CFG) == 0            # not hot yet
    assert warm_after_skip(520, 0, 5, 16, PolicyConfig(enable_drc=False)) == 0


def test_prefix_reuse_counter_counts_earlier_requests_and_forgets_lru():
    c = PrefixReuseCounter(capacity=2)
    assert [c.seen("sys"), c.seen("sys"), c.seen("sys")] == [0, 1, 2]
    c.seen("a")
    c.seen("b")                     # evicts "sys", the least recently seen
    assert c.seen("sys") == 0
    with pytest.raises(ValueError):
        PrefixReuseCounter(capacity=0)


def test_filter_class():
    from pdd.policy import in_filter_class

    long_doc = RequestFacts("r", 20_000, 4, 50_000, 16)
    assert in_filter_class(long_doc, 0, CFG)
    assert in_filter_class(long_doc, 10_000, CFG)           # half shared: still fresh
    assert not in_filter_class(long_doc, 10_016, CFG)       # mostly known to P: a continuation
    assert not in_filter_class(RequestFacts("r", 20_000, 400, 50_000, 16), 0, CFG)   # ratio 50
    assert not in_filter_class(long_doc, 0, PolicyConfig(enable_filter=False))


def test_share_budget_window_and_settle():
    from pdd.policy import ShareBudget

    b = ShareBudget(max_share=0.25, window=8)       # no loan: the share from the first decision
    assert not b.allows(1, 1)        # 1 of 1
    assert b.allows(0, 1)
    for _ in range(3):
        b.note(0, 1)
    assert b.allows(1, 1)            # 1 of 4
    b.note(1, 1)
    assert not b.allows(1, 1)        # 2 of 5
    for _ in range(3):
        b.note(0, 1)
    assert b.allows(1, 1)            # 2 of 8
    entry = b.note(0, 1)
    b.note(0, 1)
    ShareBudget.settle(entry, 1)     # a counted request became RLD-only (not the newest)
    assert b.part == 2 and not b.allows(1, 1)
    b.note(0, 1)
    for _ in range(8):
        b.note(0, 1)                 # the window forgets
    assert b.part == 0 and b.allows(2, 1) and not b.allows(3, 1)    # 3 of 9 > 25%
    ShareBudget.settle(entry, 1)     # forgotten: counts nowhere
    assert b.part == 0
    ShareBudget.settle(b.note(5, 8), 20)
    assert b.part == 8               # never more than its whole
    assert not ShareBudget(0.0, 4).allows(1, 1) and ShareBudget(0.0, 4).allows(0, 1)
    with pytest.raises(ValueError):
        ShareBudget(1.5, 4)
    with pytest.raises(ValueError):
        ShareBudget(0.1, 4, loan=-1)


def test_share_budget_lends_at_the_start_and_takes_the_loan_back():
    from pdd.policy import ShareBudget

    # 10% with a loan of 2 wholes, repaid over 20 decisions.
    b = ShareBudget(max_share=0.1, window=100, loan=2.0)
    assert b.lent(100) == 200.0      # the first decision has the whole loan
    assert b.allows(100, 100)        # 100 <= 10 + 2 * 100
    b.note(100, 100)
    assert b.allows(100, 100)        # 200 <= 20 + 2 * 100 * 0.95
    b.note(100, 100)
    assert not b.allows(100, 100)    # 300 > 30 + 2 * 100 * 0.9: the loan is spent
    assert b.allows(0, 100)
    for _ in range(18):
        b.note(0, 100)               # 20 decisions: the loan is over
    assert b.lent(100) == 0.0
    assert not b.allows(100, 100)    # 300 of 2,000 (15%)
    for _ in range(10):
        b.note(0, 100)
    assert b.allows(100, 100)        # 300 of 3,000, this one included
    # Without a loan, a run cannot open with RLD work at all.
    assert not ShareBudget(max_share=0.1, window=100).allows(100, 100)


def test_the_loans_clock_counts_in_wholes_of_the_decision_at_hand():
    from pdd.policy import ShareBudget

    # A warm-up probe of 4 tokens before the run leaves nearly all of a loan
    # of one for a 17-token answer: 17 <= 0.1 * 21 + 17 * (1 - 4 / 17 / 10).
    b = ShareBudget(max_share=0.1, window=200, loan=1.0)
    b.note(0, 4)
    assert b.lent(17) == pytest.approx(17 - 0.4)
    assert b.allows(17, 17)
    # Ten decisions of that size repay it, whatever size they came in.
    for _ in range(5):
        b.note(0, 34)
    assert b.lent(17) == 0.0
