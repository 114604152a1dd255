"""Tokens that arrive several at once (`DecodeTokens`, the simulator's decode
steps) and the decision log (`policy.lifecycle_log`).

A step's tokens go through the same rules as single ones: under any event
order Hypothesis finds, with and without faults, the user's stream is the
reference's prefix and every request ends; fed one by one or in bulk, a
request emits the same tokens; the live filter runs once per bulk, after
its last token."""

from hypothesis import given
from hypothesis import strategies as st

from pdd.policy import Pipeline, PipelineDecision, PolicyConfig, RelayBudgets
from pdd.policy.lifecycle import RequestLifecycle
from pdd.policy.lifecycle_io import (
    CancelTransfer, DecodeToken, DecodeTokens, Emit, KvReady, Leg, Note, Prefilled, ReleaseP, TransferEnded,
)
from pdd.policy.lifecycle_log import decision_log, entry, notes_only, trace_log
from pdd.policy.views import InstanceView, RequestFacts, Role
from lifecycle_world import ref
from test_policy_lifecycle_orders import SETTINGS, check_with_faults, check_without_faults, world


@SETTINGS
@given(st.data())
def test_bulk_tokens_stream_exactly_the_reference(data):
    check_without_faults(world(data, faults=0, bulk=True))


@SETTINGS
@given(st.data())
def test_bulk_tokens_with_faults_keep_a_prefix_and_end(data):
    check_with_faults(world(data, faults=data.draw(st.integers(1, 3), label="faults"), bulk=True))


def _relay(max_tokens: int = 20, est_wan_s: float = 5.0, filterable: bool = False):
    d = PipelineDecision(Pipeline.RELAY, "p0", "r0", "m0", True, 10_000_000, est_wan_s, "t", filterable)
    req = RequestFacts("req", 4096, max_tokens, 1000, 16)
    lc = RequestLifecycle(req, d, PolicyConfig(), RelayBudgets(PolicyConfig()))
    lc.start(0.0)
    lc.handle(Prefilled(0.5, ref(0)))
    lc.handle(TransferEnded(0.6, "r0", True))
    return lc


def rld(running: int = 0) -> InstanceView:
    return InstanceView("r0", Role.RELAY, "a", running, 0, 8, 1000, 1000, 0.05)


@given(st.lists(st.integers(1, 5), min_size=1, max_size=10))
def test_one_by_one_or_in_bulk_the_same_emits(sizes):
    """RLD's tokens in chunks of `sizes`, then MD ready: the same stream and
    the same handoff as when each token comes alone."""
    n = sum(sizes)
    single, bulk = _relay(), _relay()
    a = [c for i in range(n) for c in single.handle(DecodeToken(1.0, Leg.RLD, i, ref(i), rld()))]
    b, first = [], 0
    for k in sizes:
        b += bulk.handle(DecodeTokens(1.0, Leg.RLD, first, tuple(ref(i) for i in range(first, first + k)), rld()))
        first += k
    a += single.handle(KvReady(2.0, rld()))
    b += bulk.handle(KvReady(2.0, rld()))
    assert [c for c in a if isinstance(c, Emit)] == [c for c in b if isinstance(c, Emit)]
    assert decision_log(map(entry, a)) == decision_log(map(entry, b))


def test_the_live_filter_runs_once_after_a_bulk():
    """A short answer whose WAN copy RLD will beat: the filter cancels MD's
    copy after the bulk's last token, all of which reach the user first."""
    lc = _relay(max_tokens=6, est_wan_s=30.0, filterable=True)
    out = lc.handle(DecodeTokens(1.0, Leg.RLD, 0, tuple(ref(i) for i in range(4)), rld()))
    kinds = [type(c).__name__ for c in out]
    assert kinds[:4] == ["Emit"] * 4, kinds
    assert any(isinstance(c, CancelTransfer) for c in out[4:]), kinds
    assert Note("filter_cancel", {"tokens_left": 2, "remaining_wan_s": 29.5}) in out
    assert lc.outcome.value == "relay_cancelled"


def test_decision_log_keeps_decisions_not_repeats():
    words = ["opendecode:rld", "emit:rld", "emit:rld", "note:kv_ready", "extend", "emit:rld", "extend",
             "release_p", "extend_final", "emit:md", "emit:md", "finish:relay:length"]
    assert decision_log(words) == ("opendecode:rld", "emit:rld", "note:kv_ready", "extend", "extend_final",
                                   "emit:md", "finish:relay:length")
    assert entry(ReleaseP("p0")) == "release_p"
    assert entry(Note("md_ready", {"eager_tokens": 9, "mode": "catch_up"})) == "note:md_ready:catch_up"
    events = [{"name": "pipeline", "pipeline": "relay"}, {"name": "kv_ready", "instance": "m0"},
              {"name": "md_ready", "eager_tokens": 9, "mode": "one_shot"}, {"name": "prefill_end"}]
    assert trace_log(events) == ("note:kv_ready", "note:md_ready:one_shot")
    assert notes_only(decision_log(words)) == ("note:kv_ready",)


def test_the_live_filter_leaves_a_landed_copy_alone():
    """P reported MD's copy landed, MD's `kv_ready` is not in yet: nothing
    is left to cancel on the WAN, so MD keeps the request."""
    lc = _relay(max_tokens=6, est_wan_s=30.0, filterable=True)
    lc.handle(TransferEnded(0.9, "m0", True))
    out = lc.handle(DecodeTokens(1.0, Leg.RLD, 0, tuple(ref(i) for i in range(4)), rld()))
    # (RLD's tokens still go to MD ahead: its decode call may not have taken the KV yet)
    assert [type(c).__name__ for c in out] == ["Emit"] * 4 + ["ExtendAhead"]
    assert lc.md_live and lc.outcome.value == "relay"
