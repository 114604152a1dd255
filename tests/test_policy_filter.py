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
