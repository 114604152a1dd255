"""RequestLifecycle, fact by fact: every pipeline, both handoff modes, the
filter, failover, a WAN cut, each instance gone, the client gone. In
process, no model, no sockets (milliseconds each)."""

import dataclasses
import math

import pytest

from pdd.policy import InstanceView, Pipeline, PipelineDecision, PolicyConfig, RequestFacts, Role
from pdd.policy.handoff import HandoffState
from pdd.policy.lifecycle import RequestLifecycle, pick_spare, remaining_wan_s
from pdd.policy.lifecycle_io import (
    Abort, CancelTransfer, ClientGone, CloseStream, DeadlinePassed, DecodeEnded, DecodeToken, Emit,
    EndReason, Extended, ExtendMd, Finish, FinishReason, KvReady, Leg, Note, OpenDecode, Outcome,
    PauseRld, PeerGone, Prefilled, PrefillEnded, ReleaseP, ResumeRld, StartPrefill, StartTransfer,
    Transfer, TransferEnded, Wake, WanFailed,
)
from lifecycle_world import World, ref

# Final batches as soon as the session decides them; sending them with RLD's
# next token (the default) is tested on its own below and in the event-order
# properties (tests/test_policy_lifecycle_orders.py).
CFG = PolicyConfig(handoff_on_rld_token=False, first_token_max_stall_s=0.25, handoff_pace_ratio=0)
REQ = RequestFacts("req", 4096, 20, 1000, 16)


def decision(pipeline, rld="r0", md="m0", start_wan=True, est=2.0, filterable=False, reason="test"):
    return PipelineDecision(pipeline, "p0", rld if pipeline is not Pipeline.DIRECT else None, md,
                            start_wan, 1000, est, reason, filterable)


DIRECT = decision(Pipeline.DIRECT, est=0.1)
RELAY = decision(Pipeline.RELAY)
FILTERED = decision(Pipeline.RELAY_ONLY, start_wan=False, filterable=True, reason="abnormal")
WAN_DOWN = decision(Pipeline.RELAY_ONLY, md=None, start_wan=False, est=math.inf, reason="wan down")


def rld_view(iid="r0", running=0):
    return InstanceView(iid, Role.RELAY, "a", running, 0, 8, 1000, 1000, 0.05)


def healthy(*ids):
    role = {"r": Role.RELAY, "m": Role.MAIN}
    return tuple(InstanceView(i, role[i[0]], "x", 0, 0, 8, 1000, 1000, 0.05) for i in ids)


def of(cmds, kind):
    return [c for c in cmds if isinstance(c, kind)]


def emitted(cmds):
    return [(c.index, c.token, c.source) for c in of(cmds, Emit)]


def rld_tokens(lc, start, end, t=1.0):
    out = []
    for i in range(start, end):
        out += lc.handle(DecodeToken(t, Leg.RLD, i, ref(i), rld_view()))
    return out


def md_tokens(lc, start, end, t=5.0):
    out = []
    for i in range(start, end):
        out += lc.handle(DecodeToken(t, Leg.MD, i, ref(i)))
    return out


def started(d, max_tokens=20, cfg=CFG, warm_blocks=0):
    lc = RequestLifecycle(RequestFacts("req", 4096, max_tokens, 1000, 16), d, cfg, warm_blocks=warm_blocks)
    return lc, lc.start(0.0)


# --- every pipeline ------------------------------------------------------------
def test_direct_sends_p_first_token_at_once_then_md_from_the_second():
    """MD's KV is due within first_token_max_stall_s of P's first token: the
    user gets that token from P at once; MD's copy of it is skipped."""
    lc, cmds = started(DIRECT)
    assert cmds == [OpenDecode(Leg.MD, "m0", hold=False), StartPrefill("p0", (Transfer("m0"),))]
    assert emitted(lc.handle(Prefilled(0.5, ref(0)))) == [(0, ref(0), Leg.P)]
    assert lc.handle(TransferEnded(0.6, "m0", True)) == [ReleaseP("p0")]
    lc.handle(KvReady(0.7))
    out = md_tokens(lc, 0, 20) + lc.handle(DecodeEnded(2.0, Leg.MD, EndReason.LENGTH))
    assert emitted(out) == [(i, ref(i), Leg.MD) for i in range(1, 20)]
    assert lc.tokens == [ref(i) for i in range(20)]
    assert out[-1] == Finish(Outcome.DIRECT, FinishReason.LENGTH)


@pytest.mark.parametrize("est, stall", [(0.1, 0.0), (0.4, 0.25)])
def test_direct_streams_md_from_its_first_token_when_the_wait_is_long(est, stall):
    """A longer expected wait for MD (or the option off) keeps the first
    token for MD, so that TTFT shows the wait."""
    lc, _ = started(decision(Pipeline.DIRECT, est=est), cfg=PolicyConfig(first_token_max_stall_s=stall))
    assert emitted(lc.handle(Prefilled(0.5, ref(0)))) == []
    lc.handle(KvReady(0.7))
    out = md_tokens(lc, 0, 20) + lc.handle(DecodeEnded(2.0, Leg.MD, EndReason.LENGTH))
    assert emitted(out) == [(i, ref(i), Leg.MD) for i in range(20)]


def test_a_decoder_disagreeing_with_p_first_token_fails_the_request():
    lc, _ = started(DIRECT)
    lc.handle(Prefilled(0.5, ref(0)))
    out = lc.handle(DecodeToken(0.8, Leg.MD, 0, ref(0) + 1))
    assert out[-1].reason is FinishReason.ERROR and "disagrees at token 0" in out[-1].error


def test_md_failing_after_p_first_token_fails_over_to_rld_without_repeating_it():
    lc, _ = started(DIRECT)
    lc.handle(Prefilled(0.5, ref(0)))
    lc.handle(KvReady(0.7))
    md_tokens(lc, 0, 1)                               # MD's copy of P's token: nothing new
    out = lc.handle(PeerGone(0.9, Leg.MD, "silent", healthy("r0", "m0")))
    assert of(out, OpenDecode) == [OpenDecode(Leg.RLD, "r0", False)] and lc.outcome is Outcome.FAILOVER
    lc.handle(TransferEnded(1.0, "r0", True))
    out = rld_tokens(lc, 0, 20) + lc.handle(DecodeEnded(2.0, Leg.RLD, EndReason.LENGTH))
    assert emitted(out) == [(i, ref(i), Leg.RLD) for i in range(1, 20)]
    assert lc.tokens == [ref(i) for i in range(20)] and out[-1].outcome is Outcome.FAILOVER


NEAR_RLD = dataclasses.replace(RELAY, rld_wait_s=0.1)     # the local copy due 0.1 s after P's token


@pytest.mark.parametrize("rld_wait, stall, p_first", [(0.1, 0.25, True), (0.4, 0.25, False),
                                                       (0.1, 0.0, False), (math.inf, 0.25, False)])
def test_relay_sends_p_first_token_when_rlds_copy_is_due_within_the_stall(rld_wait, stall, p_first):
    """A relay's first token goes out from P when RLD should hold the KV
    within first_token_max_stall_s (the local copy); RLD's copy of it is then
    skipped and RLD's own tokens follow from index 1, as they would have."""
    cfg = dataclasses.replace(CFG, first_token_max_stall_s=stall)
    lc, _ = started(dataclasses.replace(RELAY, rld_wait_s=rld_wait), cfg=cfg)
    out = lc.handle(Prefilled(0.5, ref(0)))
    assert emitted(out) == ([(0, ref(0), Leg.P)] if p_first else [])
    lc.handle(TransferEnded(0.6, "r0", True))
    out = rld_tokens(lc, 0, 5)
    first = 1 if p_first else 0
    assert emitted(out) == [(i, ref(i), Leg.RLD) for i in range(first, 5)]
    assert lc.rld_emitted == 5 - first           # P's token is not RLD's in the budgets
    lc.handle(TransferEnded(1.5, "m0", True))
    out = lc.handle(KvReady(1.6, rld_view()))
    assert of(out, ExtendMd) == [ExtendMd("m0", tuple(ref(i) for i in range(1, 5)), True)]
    out = md_tokens(lc, 5, 20) + lc.handle(DecodeEnded(3.0, Leg.MD, EndReason.LENGTH))
    assert lc.tokens == [ref(i) for i in range(20)] and out[-1] == Finish(Outcome.RELAY, FinishReason.LENGTH)


def test_relay_p_first_token_then_rlds_copy_failing_md_takes_over_from_it():
    """P's token is out and the copy to RLD fails: RLD is lost before it made
    a token; MD continues from the user's one token (nothing to extend past
    it), without sending it twice."""
    lc, _ = started(NEAR_RLD)
    assert emitted(lc.handle(Prefilled(0.5, ref(0)))) == [(0, ref(0), Leg.P)]
    out = lc.handle(TransferEnded(0.6, "r0", False, "refused", healthy("m0")))
    assert lc.owner is Leg.MD and Abort(Leg.RLD, "r0") in out
    lc.handle(TransferEnded(1.5, "m0", True))
    out = lc.handle(KvReady(1.6))
    assert emitted(out) == [] and of(out, ExtendMd) == [ExtendMd("m0", (), True)]
    out = md_tokens(lc, 1, 20) + lc.handle(DecodeEnded(2.0, Leg.MD, EndReason.LENGTH))
    assert emitted(out) == [(i, ref(i), Leg.MD) for i in range(1, 20)]
    assert lc.tokens == [ref(i) for i in range(20)] and out[-1].reason is FinishReason.LENGTH


def test_relay_p_first_token_and_rld_disagreeing_fails_the_request():
    lc, _ = started(NEAR_RLD)
    lc.handle(Prefilled(0.5, ref(0)))
    lc.handle(TransferEnded(0.6, "r0", True))
    out = lc.handle(DecodeToken(0.8, Leg.RLD, 0, ref(0) + 1, rld_view()))
    assert out[-1].reason is FinishReason.ERROR and "disagrees at token 0" in out[-1].error


def test_relay_one_shot_handoff():
    lc, cmds = started(RELAY)
    assert of(cmds, OpenDecode) == [OpenDecode(Leg.RLD, "r0", False), OpenDecode(Leg.MD, "m0", True)]
    # RLD serves the user meanwhile: the copy to MD yields the line to direct ones.
    # The copy to RLD leaves once the prefill is over, not beside its chunks
    # (`stream_relay_copy`); MD's streams while P computes.
    assert of(cmds, StartPrefill)[0].targets == (Transfer("r0", streamed=False), Transfer("m0", background=True))
    _, streaming = started(RELAY, cfg=dataclasses.replace(CFG, stream_relay_copy=True))
    assert of(streaming, StartPrefill)[0].targets == (Transfer("r0"), Transfer("m0", background=True))
    lc.handle(Prefilled(0.5, ref(0)))
    lc.handle(TransferEnded(0.6, "r0", True))
    out = rld_tokens(lc, 0, 5)
    assert emitted(out) == [(i, ref(i), Leg.RLD) for i in range(5)]
    lc.handle(TransferEnded(1.5, "m0", True))
    out = lc.handle(KvReady(1.6, rld_view()))
    assert of(out, PauseRld) == [PauseRld("r0")]
    assert of(out, ExtendMd) == [ExtendMd("m0", tuple(ref(i) for i in range(1, 5)), True)]
    assert lc.stop_at == 5 and lc.session.mode.value == "one_shot"
    # RLD's token 5 was already on its way: held back, never shown.
    assert emitted(rld_tokens(lc, 5, 6)) == []
    out = md_tokens(lc, 5, 20)
    assert Abort(Leg.RLD, "r0", background=True) in out and CloseStream(Leg.RLD) in out
    assert emitted(out) == [(i, ref(i), Leg.MD) for i in range(5, 20)]
    assert lc.handle(DecodeEnded(3.0, Leg.MD, EndReason.LENGTH))[-1] == Finish(Outcome.RELAY, FinishReason.LENGTH)
    assert lc.handoff_s == pytest.approx(5.0 - 1.6) and lc.handoff_batches == 1


def test_the_final_batch_goes_with_rlds_next_token():
    lc, _ = started(RELAY, cfg=PolicyConfig(handoff_pace_ratio=0))
    lc.handle(Prefilled(0.5, ref(0)))
    lc.handle(TransferEnded(0.6, "r0", True))
    rld_tokens(lc, 0, 5)
    lc.handle(TransferEnded(1.5, "m0", True))
    # MD is ready mid-way through RLD's inter-token gap: no batch goes yet;
    # RLD is told to hold once it has made its next token (6 tokens) ...
    out = lc.handle(KvReady(1.6, rld_view()))
    assert of(out, PauseRld) == [PauseRld("r0", at=6)] and of(out, ExtendMd) == [] and lc.stop_at is None
    # ... RLD's token 5 is shown, and right behind it the final batch leaves
    # (no second pause: the hold went first, in RLD's lane).
    out = rld_tokens(lc, 5, 6)
    assert emitted(out) == [(5, ref(5), Leg.RLD)]
    assert of(out, PauseRld) == []
    assert of(out, ExtendMd) == [ExtendMd("m0", tuple(ref(i) for i in range(1, 6)), True)]
    assert lc.stop_at == 6
    assert emitted(rld_tokens(lc, 6, 7)) == []            # held back: MD makes token 6
    out = md_tokens(lc, 6, 20)
    assert emitted(out) == [(i, ref(i), Leg.MD) for i in range(6, 20)]
    assert lc.handle(DecodeEnded(3.0, Leg.MD, EndReason.LENGTH))[-1] == Finish(Outcome.RELAY, FinishReason.LENGTH)


def test_a_hold_ahead_that_no_final_batch_follows_resumes_rld():
    """Armed at 10 (RLD holds at 11), but RLD's token 10 leaves MD at most
    `catchup_final_max_tokens` of the bound: no final batch, RLD resumes and
    ends the request. And MD failing while armed resumes RLD too."""
    cfg = PolicyConfig(catchup_final_max_tokens=2, handoff_pace_ratio=0)
    lc, _ = started(RELAY, max_tokens=13, cfg=cfg)
    lc.handle(Prefilled(0.5, ref(0)))
    lc.handle(TransferEnded(0.6, "r0", True))
    rld_tokens(lc, 0, 10)
    out = lc.handle(KvReady(1.0, rld_view()))
    assert of(out, PauseRld) == [PauseRld("r0", at=11)] and of(out, ExtendMd) == []
    out = rld_tokens(lc, 10, 11)
    assert of(out, ResumeRld) == [ResumeRld("r0")] and of(out, ExtendMd) == [] and lc.rld_hold_at is None
    out = rld_tokens(lc, 11, 13) + lc.handle(DecodeEnded(1.6, Leg.RLD, EndReason.LENGTH))
    assert out[-1] == Finish(Outcome.RELAY, FinishReason.LENGTH) and lc.tokens == [ref(i) for i in range(13)]

    lc, _ = started(RELAY, max_tokens=40, cfg=cfg)
    lc.handle(Prefilled(0.5, ref(0)))
    lc.handle(TransferEnded(0.6, "r0", True))
    rld_tokens(lc, 0, 10)
    assert of(lc.handle(KvReady(1.0, rld_view())), PauseRld) == [PauseRld("r0", at=11)]
    out = lc.handle(DecodeEnded(1.1, Leg.MD, EndReason.ERROR, "MD died"))
    assert ResumeRld("r0") in out and Abort(Leg.MD, "m0") in out
    out = rld_tokens(lc, 10, 40) + lc.handle(DecodeEnded(2.0, Leg.RLD, EndReason.LENGTH))
    assert lc.tokens == [ref(i) for i in range(40)] and out[-1].reason is FinishReason.LENGTH


def test_relay_catch_up_handoff_sends_batches_until_the_gap_is_small():
    cfg = PolicyConfig(handoff_mode="catch_up", catchup_final_max_tokens=2, handoff_on_rld_token=False,
                       handoff_pace_ratio=0)
    lc, _ = started(RELAY, max_tokens=40, cfg=cfg)
    lc.handle(Prefilled(0.5, ref(0)))
    lc.handle(TransferEnded(0.6, "r0", True))
    rld_tokens(lc, 0, 10)
    out = lc.handle(KvReady(1.0, rld_view()))
    assert of(out, ExtendMd) == [ExtendMd("m0", tuple(ref(i) for i in range(1, 10)), False)]
    assert of(out, PauseRld) == []
    rld_tokens(lc, 10, 14)
    out = lc.handle(Extended(1.2, 10))
    assert of(out, ExtendMd) == [ExtendMd("m0", tuple(ref(i) for i in range(10, 14)), False)]
    rld_tokens(lc, 14, 15)
    out = lc.handle(Extended(1.3, 14))
    assert of(out, ExtendMd) == [ExtendMd("m0", (ref(14),), True)] and of(out, PauseRld) == [PauseRld("r0")]
    out = md_tokens(lc, 15, 40) + lc.handle(DecodeEnded(2.0, Leg.MD, EndReason.LENGTH))
    assert lc.tokens == [ref(i) for i in range(40)] and lc.handoff_batches == 3
    assert out[-1].outcome is Outcome.RELAY


def md_view(step_s):
    return InstanceView("m0", Role.MAIN, "b", 1, 0, 8, 1000, 1000, step_s)


def overlapping(max_tokens=40, cfg=None, eager=6):
    """A relay whose MD decodes at a quarter of RLD's step (0.0125 against
    0.05 s): MD ready after `eager` of RLD's tokens. Unpaced (RLD's tokens
    here all come at one instant; the paced overlap is tested below)."""
    cfg = dataclasses.replace(cfg or PolicyConfig(), handoff_pace_ratio=0)
    lc, _ = started(RELAY, max_tokens=max_tokens, cfg=cfg)
    lc.handle(Prefilled(0.5, ref(0)))
    lc.handle(TransferEnded(0.6, "r0", True))
    rld_tokens(lc, 0, eager)
    lc.handle(TransferEnded(1.5, "m0", True))
    return lc, lc.handle(KvReady(1.6, rld_view(), md=md_view(0.0125)))


def test_overlap_handoff_keeps_rld_streaming_until_md_overtakes_it():
    """MD decodes clearly faster than RLD: the final batch goes at once and
    does not pause RLD; MD's first token of its own waits for RLD's of the
    same index (the switch then lands right after one of RLD's tokens, not a
    round trip and an extend after one), and MD's next token takes over."""
    lc, out = overlapping()
    assert lc.session.mode.value == "overlap"
    assert of(out, ExtendMd) == [ExtendMd("m0", tuple(ref(i) for i in range(1, 6)), True)]
    assert of(out, PauseRld) == [] and lc.stop_at is None and lc.overlap_from == 6
    assert emitted(md_tokens(lc, 6, 7)) == []                 # ahead by one: waits for RLD's 6
    assert emitted(rld_tokens(lc, 6, 7)) == [(6, ref(6), Leg.RLD)]
    out = md_tokens(lc, 7, 8)                                  # MD has index 7 first: it takes over
    assert emitted(out) == [(7, ref(7), Leg.MD)]
    assert Abort(Leg.RLD, "r0", background=True) in out and lc.owner is Leg.MD and lc.stop_at == 7
    assert emitted(rld_tokens(lc, 7, 9)) == []                 # RLD's late copies go nowhere
    out = md_tokens(lc, 8, 40) + lc.handle(DecodeEnded(3.0, Leg.MD, EndReason.LENGTH))
    assert lc.tokens == [ref(i) for i in range(40)] and out[-1] == Finish(Outcome.RELAY, FinishReason.LENGTH)
    assert lc.rld_emitted == 7 and lc.session.state is HandoffState.DONE


def test_overlap_switch_right_after_rlds_token_when_md_is_ahead():
    """MD's tokens already past RLD's when RLD's next one comes: the user
    gets RLD's and, right behind it, MD's (nothing waits)."""
    lc, _ = overlapping(cfg=PolicyConfig(overlap_max_ahead=3))
    assert emitted(md_tokens(lc, 6, 8)) == []                  # two ahead: RLD's 6 is due
    out = rld_tokens(lc, 6, 7)
    assert emitted(out) == [(6, ref(6), Leg.RLD), (7, ref(7), Leg.MD)]
    # MD as far ahead as overlap_max_ahead: RLD is late; MD takes over alone.
    lc, _ = overlapping(cfg=PolicyConfig(overlap_max_ahead=3))
    assert emitted(md_tokens(lc, 6, 9)) == [(i, ref(i), Leg.MD) for i in range(6, 9)]


@pytest.mark.parametrize("p_first", [True, False])
def test_md_does_not_wait_for_an_rld_that_has_not_decoded_yet(p_first):
    """MD ready before RLD decoded anything (the user has P's first token
    only, from P or passed on by RLD): RLD's first step may be far off (its
    import, a core shared with P's prefill), so MD's first own token goes
    out at once instead of waiting for RLD's of the same index."""
    cfg = dataclasses.replace(CFG, handoff_pace_ratio=0)
    lc, _ = started(NEAR_RLD if p_first else RELAY, cfg=cfg)
    lc.handle(Prefilled(0.5, ref(0)))
    lc.handle(TransferEnded(0.6, "r0", True))
    if not p_first:
        assert emitted(rld_tokens(lc, 0, 1)) == [(0, ref(0), Leg.RLD)]
    lc.handle(TransferEnded(0.7, "m0", True))
    out = lc.handle(KvReady(0.8, rld_view(), md=md_view(0.0125)))
    assert lc.session.mode.value == "overlap" and lc.overlap_from == 1
    assert of(out, ExtendMd) == [ExtendMd("m0", (), True)]
    out = md_tokens(lc, 1, 2)
    assert emitted(out) == [(1, ref(1), Leg.MD)] and lc.owner is Leg.MD
    assert emitted(rld_tokens(lc, 1, 3)) == []                # RLD's late first tokens go nowhere


def test_overlap_handoff_left_to_rld_when_md_disagrees():
    """MD's token differs from the user's at an index both made (a decode in
    another batch): MD's continuation is not the user's. MD's request goes
    (its KV kept for its prefix cache) and RLD ends the request."""
    lc, _ = overlapping()
    rld_tokens(lc, 6, 8)
    out = lc.handle(DecodeToken(2.0, Leg.MD, 6, ref(6) + 1))
    assert Abort(Leg.MD, "m0", keep_kv=True) in out and lc.session.state is HandoffState.RLD_FINISHES
    assert any(isinstance(c, Note) and c.event == "overlap_diverged" and c.fields["index"] == 6 for c in out)
    out = rld_tokens(lc, 8, 40) + lc.handle(DecodeEnded(3.0, Leg.RLD, EndReason.LENGTH))
    assert lc.tokens == [ref(i) for i in range(40)] and out[-1].reason is FinishReason.LENGTH
    # ... also when MD's differing token came first and waited for RLD's.
    lc, _ = overlapping()
    lc.handle(DecodeToken(2.0, Leg.MD, 6, ref(6) + 1))
    out = rld_tokens(lc, 6, 7)
    assert emitted(out) == [(6, ref(6), Leg.RLD)] and Abort(Leg.MD, "m0", keep_kv=True) in out
    # A token of MD's own past the user's is MD's answer, whatever RLD would
    # have made there: MD made it from the tokens the user has.
    lc, _ = overlapping()
    md_tokens(lc, 6, 7)
    lc.handle(DecodeToken(2.0, Leg.MD, 7, ref(7) + 1))
    assert emitted(rld_tokens(lc, 6, 7)) == [(6, ref(6), Leg.RLD), (7, ref(7) + 1, Leg.MD)]


def test_overlap_pauses_rld_when_md_does_not_catch_up():
    """RLD made `overlap_max_lag` tokens past the final batch and MD has not
    overtaken it: RLD pauses and MD's own tokens catch up (the paused
    handoff's stall); RLD's tokens past the pause are held back."""
    lc, _ = overlapping(cfg=PolicyConfig(overlap_max_lag=3))
    out = rld_tokens(lc, 6, 9)
    assert of(out, PauseRld) == [PauseRld("r0")] and lc.stop_at == 9
    assert emitted(rld_tokens(lc, 9, 10)) == []
    assert emitted(md_tokens(lc, 6, 9)) == []
    assert emitted(md_tokens(lc, 9, 11)) == [(9, ref(9), Leg.MD), (10, ref(10), Leg.MD)]


def test_overlap_rld_lost_md_takes_the_stream_as_it_comes():
    lc, _ = overlapping()
    rld_tokens(lc, 6, 8)
    out = lc.handle(PeerGone(2.0, Leg.RLD, "silent", healthy("m0")))
    assert of(out, ExtendMd) == [] and lc.owner is Leg.MD and Abort(Leg.RLD, "r0") in out
    out = md_tokens(lc, 6, 40) + lc.handle(DecodeEnded(3.0, Leg.MD, EndReason.LENGTH))
    assert lc.tokens == [ref(i) for i in range(40)] and out[-1].reason is FinishReason.LENGTH


def test_overlap_md_ending_on_a_token_the_user_has_ends_the_request():
    lc, _ = overlapping(max_tokens=9, cfg=PolicyConfig(catchup_final_max_tokens=1))
    rld_tokens(lc, 6, 9)
    out = md_tokens(lc, 6, 9) + lc.handle(DecodeEnded(2.0, Leg.MD, EndReason.LENGTH))
    assert out[-1].reason is FinishReason.LENGTH and lc.tokens == [ref(i) for i in range(9)]
    assert Abort(Leg.RLD, "r0") in out


# --- the paced handoff ------------------------------------------------------------
PACED_CFG = PolicyConfig(handoff_on_rld_token=False)        # handoff_pace_ratio 1.5: the default


def paced(max_tokens=40, cfg=PACED_CFG):
    """A relay whose RLD makes a token every 40 ms (tokens 0-5 at 1.00-1.20 s)
    and whose MD reports the same step: MD ready at 1.21 s. Returns the
    lifecycle and a recorder of (time, Emit) for the facts fed through it."""
    lc, _ = started(RELAY, max_tokens=max_tokens, cfg=cfg)
    lc.handle(Prefilled(0.5, ref(0)))
    lc.handle(TransferEnded(0.6, "r0", True))
    for i in range(6):
        lc.handle(DecodeToken(1.0 + 0.04 * i, Leg.RLD, i, ref(i), rld_view()))
    lc.handle(TransferEnded(1.205, "m0", True))
    out = lc.handle(KvReady(1.21, rld_view(), md=md_view(0.04)))
    return lc, out


def feed(lc, facts):
    """Each fact, and a `Wake` whenever the lifecycle's wake time comes
    first (as the drivers do); (time, Emit) of every token that went out."""
    shown = []
    for f in sorted(facts, key=lambda f: f.now):
        while lc.wake_s() is not None and lc.wake_s() <= f.now:
            t = lc.wake_s()
            shown += [(t, c) for c in of(lc.handle(Wake(t)), Emit)]
        shown += [(f.now, c) for c in of(lc.handle(f), Emit)]
    return shown


def test_paced_handoff_stretches_rlds_gaps_until_mds_tokens_catch_up():
    """MD no faster than RLD: the final batch carries RLD's tokens and does
    not pause RLD; RLD's next tokens go out at least 1.5 x 40 ms apart (held
    back, let out at `Wake`s), so the user's stream falls behind RLD's 20 ms
    a token; MD, a round trip and an extend behind RLD, reaches it and takes
    the stream with no gap over the stretched one."""
    lc, out = paced()
    assert lc.session.mode.value == "paced" and of(out, PauseRld) == []
    assert of(out, ExtendMd) == [ExtendMd("m0", tuple(ref(i) for i in range(1, 6)), True)]
    # MD's first token due two of its steps after the batch (1.29 s), 0.05 s
    # after the user's next would go out unstretched: spread over 8 tokens.
    assert lc.pace_gap_s == pytest.approx(0.04 + 0.05 / 8)
    assert Note("paced", {"gap_s": round(lc.pace_gap_s, 4)}) in out
    rld = [DecodeToken(1.24 + 0.04 * k, Leg.RLD, 6 + k, ref(6 + k), rld_view()) for k in range(12)]
    # MD's own tokens from 6 on, 150 ms behind RLD's (round trip, extend), 40 ms apart.
    md = [DecodeToken(1.39 + 0.04 * k, Leg.MD, 6 + k, ref(6 + k)) for k in range(34)]
    shown = feed(lc, rld + md + [DecodeEnded(2.8, Leg.MD, EndReason.LENGTH)])
    assert lc.tokens == [ref(i) for i in range(40)] and lc.done.reason is FinishReason.LENGTH
    assert [c.index for _, c in shown] == list(range(6, 40))
    switch = next(i for i, (_, c) in enumerate(shown) if c.source is Leg.MD)
    assert all(c.source is Leg.RLD for _, c in shown[:switch]) and all(c.held for _, c in shown[:switch])
    times = [1.20] + [t for t, _ in shown]
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert max(gaps[:switch + 1]) <= 0.06 + 1e-9          # no stall at the switch
    # MD caught up before the lag bound (RLD never paused): its lag, 0.15 s
    # where two of its steps were expected, spread over the tokens left
    assert 6 <= shown[switch][1].index < 6 + 2 * PACED_CFG.overlap_max_lag and lc.session.state.value == "done"
    assert lc.rld_emitted == shown[switch][1].index and lc.stop_at == shown[switch][1].index


def test_paced_gap_follows_mds_own_pace_and_lag():
    """Once two of MD's own tokens came, the gap is MD's time per token on
    this request (beside RLD on one core MD is slower than its reported
    step), slower or faster than RLD's, plus its lag behind the user's
    stream spread over what is left of overlap_max_lag tokens: at least a
    quarter of the ratio's stretch, at most the ratio's."""
    rld = [DecodeToken(1.24 + 0.04 * k, Leg.RLD, 6 + k, ref(6 + k), rld_view()) for k in range(3)]
    for md_gap in (0.05, 0.03):
        lc, _ = paced()
        feed(lc, rld + [DecodeToken(1.30, Leg.MD, 6, ref(6)), DecodeToken(1.30 + md_gap, Leg.MD, 7, ref(7))])
        nxt = len(lc.tokens)
        assert lc.owner is Leg.RLD and nxt >= 8                   # the user is ahead of MD still
        assert lc.md_pace_s() == pytest.approx(md_gap)
        # MD's token `nxt` due (nxt - 7) of its gaps after its 7th; the user's
        # unstretched a gap after the last one out; 8 - (nxt - 6) tokens left.
        lag = 1.30 + md_gap + (nxt - 7) * md_gap - (lc.out_s + md_gap)
        expect = md_gap + max(0.125 * md_gap, lag / (8 - (nxt - 6)))
        assert lc.pace_gap_s == pytest.approx(min(expect, 1.5 * md_gap))
        assert 1.125 * md_gap - 1e-9 <= lc.pace_gap_s <= 1.5 * md_gap + 1e-9


def test_paced_md_slower_than_rld_catches_up_without_a_stall():
    """MD at 60 ms a token, RLD at 40: the user's tokens go out 1.5 x MD's
    gap apart, so MD, a round trip and an extend behind, gains 30 ms a token
    and takes the stream before the lag bound; no gap beyond the stretch
    (paced at RLD's faster gap MD never caught up: RLD paused at the lag
    bound and the user waited out MD's whole lag at once)."""
    lc, _ = paced()
    rld = [DecodeToken(1.24 + 0.04 * k, Leg.RLD, 6 + k, ref(6 + k), rld_view()) for k in range(30)]
    md = [DecodeToken(1.39 + 0.06 * k, Leg.MD, 6 + k, ref(6 + k)) for k in range(34)]
    shown = feed(lc, rld + md + [DecodeEnded(3.5, Leg.MD, EndReason.LENGTH)])
    assert lc.tokens == [ref(i) for i in range(40)] and lc.done.reason is FinishReason.LENGTH
    switch = next(i for i, (_, c) in enumerate(shown) if c.source is Leg.MD)
    times = [1.20] + [t for t, _ in shown]
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert max(gaps) <= 1.5 * 0.06 + 1e-9
    assert shown[switch][1].index < 6 + 2 * PACED_CFG.overlap_max_lag and lc.stop_at == shown[switch][1].index


def test_paced_tokens_held_back_go_out_when_rld_ends_the_request_first():
    lc, _ = paced(max_tokens=12)
    shown = feed(lc, [DecodeToken(1.24 + 0.04 * k, Leg.RLD, 6 + k, ref(6 + k), rld_view()) for k in range(6)]
                 + [DecodeEnded(1.45, Leg.RLD, EndReason.LENGTH)])
    assert lc.tokens == [ref(i) for i in range(12)] and lc.done.reason is FinishReason.LENGTH
    assert [c.index for _, c in shown] == list(range(6, 12)) and lc.ended_on_rld


def test_md_failing_while_paced_lets_rlds_held_tokens_out_and_stops_pacing():
    lc, _ = paced()
    rld_early = [DecodeToken(1.211 + 0.005 * k, Leg.RLD, 6 + k, ref(6 + k), rld_view()) for k in range(3)]
    feed(lc, rld_early)
    assert len(lc.tokens) == 6 and len(lc.queued) == 3
    out = lc.handle(DecodeEnded(1.27, Leg.MD, EndReason.ERROR, "MD died"))
    assert [c.index for c in of(out, Emit)] == [6, 7, 8] and lc.pace_gap_s is None and lc.wake_s() is None
    assert Abort(Leg.MD, "m0") in out
    out = rld_tokens(lc, 9, 40, t=1.28) + lc.handle(DecodeEnded(2.0, Leg.RLD, EndReason.LENGTH))
    assert lc.tokens == [ref(i) for i in range(40)] and out[-1].reason is FinishReason.LENGTH


def test_rld_lost_while_paced_md_takes_over_after_rlds_held_tokens():
    lc, _ = paced()
    feed(lc, [DecodeToken(1.211 + 0.005 * k, Leg.RLD, 6 + k, ref(6 + k), rld_view()) for k in range(3)])
    out = lc.handle(PeerGone(1.23, Leg.RLD, "silent", healthy("m0")))
    assert [c.index for c in of(out, Emit)] == [6, 7, 8] and lc.owner is Leg.MD
    out = md_tokens(lc, 6, 40) + lc.handle(DecodeEnded(3.0, Leg.MD, EndReason.LENGTH))
    assert lc.tokens == [ref(i) for i in range(40)] and out[-1].reason is FinishReason.LENGTH


def test_paced_mode_only_while_rld_has_room():
    """A busy RLD wants its slot back: one-shot pauses it at once."""
    lc, _ = started(RELAY, max_tokens=40, cfg=PACED_CFG)
    lc.handle(Prefilled(0.5, ref(0)))
    lc.handle(TransferEnded(0.6, "r0", True))
    rld_tokens(lc, 0, 6)
    out = lc.handle(KvReady(1.6, rld_view(running=7), md=md_view(0.05)))
    assert lc.session.mode.value == "one_shot" and of(out, PauseRld) == [PauseRld("r0")]


@pytest.mark.parametrize("md_step, overlap", [(0.0125, True), (0.033, True), (0.04, False), (None, False)])
def test_overlap_only_where_md_decodes_clearly_faster(md_step, overlap):
    """`overlap_max_step_ratio` (0.67) of RLD's 0.05 s step; unmeasured MD:
    the paced handoff (no pause either), or with pacing off the paused one."""
    for pace, other in ((1.5, "paced"), (0, "one_shot")):
        lc, _ = started(RELAY, max_tokens=40, cfg=PolicyConfig(handoff_pace_ratio=pace))
        lc.handle(Prefilled(0.5, ref(0)))
        lc.handle(TransferEnded(0.6, "r0", True))
        rld_tokens(lc, 0, 6)
        out = lc.handle(KvReady(1.6, rld_view(), md=md_view(md_step)))
        assert lc.session.mode.value == ("overlap" if overlap else other)
        assert (of(out, PauseRld) == []) is (overlap or pace > 0)
    lc, _ = started(RELAY, max_tokens=40, cfg=PolicyConfig(overlap_max_step_ratio=0.0))
    lc.handle(Prefilled(0.5, ref(0)))
    lc.handle(TransferEnded(0.6, "r0", True))
    rld_tokens(lc, 0, 6)
    lc.handle(KvReady(1.6, rld_view(), md=md_view(0.001)))
    assert lc.session.mode.value != "overlap"


@pytest.mark.parametrize("gap_s, view_s, overlap", [(0.2, 0.02, True), (0.03, 0.2, False)])
def test_overlap_judges_rld_by_this_requests_own_token_gaps(gap_s, view_s, overlap):
    """RLD's pace is the gap between this request's last tokens, not its
    instance's mean step (which lags when P's load on the shared core comes
    and goes); MD at 0.03 s a step."""
    lc, _ = started(RELAY, max_tokens=40, cfg=PolicyConfig())
    lc.handle(Prefilled(0.5, ref(0)))
    lc.handle(TransferEnded(0.6, "r0", True))
    slow = dataclasses.replace(rld_view(), step_time_s=view_s)
    for i in range(6):
        lc.handle(DecodeToken(1.0 + i * gap_s, Leg.RLD, i, ref(i), slow))
    assert lc.rld_pace_s() == pytest.approx(gap_s)
    lc.handle(KvReady(2.5, slow, md=md_view(0.03)))
    assert (lc.session.mode.value == "overlap") is overlap


def test_one_slow_gap_does_not_make_a_fast_rld_slow():
    """RLD's pace is the median of its last gaps: one slow gap (P's chunk beside
    RLD's step) among fast ones keeps the paused handoff for an MD that would
    not overtake RLD; a run of slow gaps chooses the overlap."""
    for gaps, overlap in (([0.04, 0.04, 0.04, 0.12, 0.04], False), ([0.04, 0.12, 0.13, 0.12, 0.04], True)):
        lc, _ = started(RELAY, max_tokens=40, cfg=PolicyConfig())
        lc.handle(Prefilled(0.5, ref(0)))
        lc.handle(TransferEnded(0.6, "r0", True))
        t = 1.0
        for i, gap in enumerate([0.04] + gaps):
            t += gap
            lc.handle(DecodeToken(t, Leg.RLD, i, ref(i), rld_view()))
        lc.handle(KvReady(t + 0.01, rld_view(), md=md_view(0.04)))
        assert (lc.session.mode.value == "overlap") is overlap, gaps


def test_tokens_that_arrive_in_bursts_read_at_their_mean_pace():
    """RLD's facts alternate one token after 60 ms with one right behind it
    (30 ms a token): that pace, not the 60 ms of every other fact, against
    MD's 0.03 s step."""
    lc, _ = started(RELAY, max_tokens=40, cfg=PolicyConfig())
    lc.handle(Prefilled(0.5, ref(0)))
    lc.handle(TransferEnded(0.6, "r0", True))
    t = 1.0
    for i, gap in enumerate([0.0, 0.06, 0.0005, 0.06, 0.0005, 0.06]):
        t += gap
        lc.handle(DecodeToken(t, Leg.RLD, i, ref(i), rld_view()))
    assert lc.rld_pace_s() == pytest.approx((0.06 + 0.0005 + 0.06 + 0.0005) / 4)
    lc.handle(KvReady(t + 0.01, rld_view(), md=md_view(0.03)))
    assert lc.session.mode.value != "overlap"


def test_filtered_request_is_rld_only_and_warms_md_with_its_shared_prefix():
    lc, cmds = started(FILTERED, warm_blocks=4)
    assert of(cmds, OpenDecode) == [OpenDecode(Leg.RLD, "r0", False)]
    assert cmds[-1] == StartPrefill("p0", (Transfer("r0", streamed=False), Transfer("m0", 4, background=True)))
    lc.handle(Prefilled(0.5, ref(0)))
    lc.handle(TransferEnded(0.6, "r0", True))
    out = rld_tokens(lc, 0, 20) + lc.handle(DecodeEnded(1.0, Leg.RLD, EndReason.LENGTH))
    assert out[-1] == Finish(Outcome.RELAY_FILTERED, FinishReason.LENGTH)
    assert lc.warming                                   # P stays open until the warm copy lands
    assert lc.handle(TransferEnded(1.5, "m0", True)) == [ReleaseP("p0")] and not lc.warming


def test_wan_down_is_rld_only():
    lc, cmds = started(WAN_DOWN)
    assert cmds[-1] == StartPrefill("p0", (Transfer("r0", streamed=False),))
    lc.handle(Prefilled(0.5, ref(0)))
    lc.handle(TransferEnded(0.6, "r0", True))
    out = rld_tokens(lc, 0, 3) + lc.handle(DecodeEnded(1.0, Leg.RLD, EndReason.STOP))
    assert out[-1] == Finish(Outcome.WAN_DOWN, FinishReason.STOP)


def test_prefill_stop_token_and_single_token_end_at_p():
    lc, _ = started(RELAY)
    out = lc.handle(Prefilled(0.5, ref(0), stop=True))
    assert emitted(out) == [(0, ref(0), Leg.P)] and out[-1] == Finish(Outcome.RELAY, FinishReason.STOP)
    lc, _ = started(DIRECT, max_tokens=1)
    assert lc.handle(Prefilled(0.5, ref(0)))[-1].reason is FinishReason.LENGTH


# --- the filter -------------------------------------------------------------------
def test_live_filter_cancels_the_wan_copy_when_rld_ends_first():
    d = decision(Pipeline.RELAY, est=10.0, filterable=True)
    lc, _ = started(d, max_tokens=4)
    lc.handle(Prefilled(0.5, ref(0)))
    lc.handle(TransferEnded(0.6, "r0", True))
    out = rld_tokens(lc, 0, 1)
    assert CancelTransfer("m0", "abnormal traffic: RLD finishes first") in out
    assert Abort(Leg.MD, "m0") in out and lc.outcome is Outcome.RELAY_CANCELLED
    (note,) = [c for c in out if isinstance(c, Note) and c.event == "filter_cancel"]
    assert note.fields["remaining_wan_s"] == pytest.approx(remaining_wan_s(d, 1.0 - 0.5))
    # P reports the cancelled copy as failed: not a WAN failure; the request goes on on RLD.
    assert lc.handle(TransferEnded(1.1, "m0", False, "cancelled")) == [ReleaseP("p0")]
    out = rld_tokens(lc, 1, 4) + lc.handle(DecodeEnded(2.0, Leg.RLD, EndReason.LENGTH))
    assert out[-1] == Finish(Outcome.RELAY_CANCELLED, FinishReason.LENGTH)


def test_the_relay_budgets_count_what_rld_really_emitted_once_a_request_ends():
    from dataclasses import replace

    from pdd.policy import RelayBudgets
    budgets = RelayBudgets(CFG)
    facts = RequestFacts("req", 4096, 30, 1000, 16)
    # A relay predicted to leave 2 of its 30 tokens on RLD; the copy takes
    # longer and RLD emits 12 before MD takes over.
    lc = RequestLifecycle(facts, replace(RELAY, rld_tokens=2), CFG, budgets)
    lc.start(0.0)
    assert (budgets.tokens.part, budgets.tokens.whole, budgets.requests.part) == (2, 30, 0)
    lc.handle(Prefilled(0.5, ref(0)))
    lc.handle(TransferEnded(0.6, "r0", True))
    rld_tokens(lc, 0, 12)
    assert budgets.tokens.part == 2                  # still the prediction while it runs
    lc.handle(TransferEnded(3.0, "m0", True))
    assert of(lc.handle(KvReady(3.1, rld_view())), PauseRld) == [PauseRld("r0")]   # one-shot at 12
    md_tokens(lc, 12, 30)
    lc.handle(DecodeEnded(5.0, Leg.MD, EndReason.LENGTH))
    assert lc.done is not None and lc.rld_emitted == 12
    assert budgets.tokens.part == 12                 # what RLD really did
    # The live filter turns a relay into RLD-only: all of it while it runs,
    # then what RLD emitted (the answer may end before its bound).
    d = decision(Pipeline.RELAY, est=10.0, filterable=True)
    lc = RequestLifecycle(RequestFacts("req2", 4096, 4, 1000, 16), replace(d, rld_tokens=1), CFG, budgets)
    lc.start(0.0)
    lc.handle(Prefilled(0.5, ref(0)))
    lc.handle(TransferEnded(0.6, "r0", True))
    rld_tokens(lc, 0, 1)
    assert lc.outcome is Outcome.RELAY_CANCELLED
    assert (budgets.requests.part, budgets.tokens.part) == (1, 12 + 4)
    rld_tokens(lc, 1, 3)
    lc.handle(DecodeEnded(2.0, Leg.RLD, EndReason.STOP))
    assert (budgets.requests.part, budgets.tokens.part) == (1, 12 + 3)


def test_live_filter_leaves_other_relays_alone():
    lc, _ = started(decision(Pipeline.RELAY, est=10.0, filterable=False), max_tokens=4)
    lc.handle(Prefilled(0.5, ref(0)))
    lc.handle(TransferEnded(0.6, "r0", True))
    assert of(rld_tokens(lc, 0, 2), CancelTransfer) == []


def test_relay_ending_on_rld_keeps_the_wan_copy_landing_for_mds_cache():
    lc, _ = started(RELAY, max_tokens=3)
    lc.handle(Prefilled(0.5, ref(0)))
    lc.handle(TransferEnded(0.6, "r0", True))
    out = rld_tokens(lc, 0, 3) + lc.handle(DecodeEnded(1.0, Leg.RLD, EndReason.LENGTH))
    assert Abort(Leg.MD, "m0", keep_kv=True, background=False) in out and of(out, CancelTransfer) == []
    assert out[-1] == Finish(Outcome.RELAY, FinishReason.LENGTH) and lc.ended_on_rld and lc.warming


def test_filter_class_relay_ending_on_rld_drops_the_copy():
    lc, _ = started(decision(Pipeline.RELAY, filterable=True, est=0.6), max_tokens=3,
                    cfg=PolicyConfig(enable_filter=False))
    lc.handle(Prefilled(0.5, ref(0)))
    lc.handle(TransferEnded(0.6, "r0", True))
    out = rld_tokens(lc, 0, 3) + lc.handle(DecodeEnded(1.0, Leg.RLD, EndReason.LENGTH))
    assert of(out, CancelTransfer) == [CancelTransfer("m0", "request finished on RLD first")]


# --- failures -----------------------------------------------------------------------
def test_direct_failover_to_rld_when_md_fails_before_a_token():
    lc, _ = started(DIRECT)
    lc.handle(Prefilled(0.5, ref(0)))
    out = lc.handle(DecodeEnded(0.7, Leg.MD, EndReason.ERROR, "boom", healthy("r0", "r1", "m0")))
    assert of(out, OpenDecode) == [OpenDecode(Leg.RLD, "r0", False)]
    assert of(out, StartTransfer) == [StartTransfer("r0")] and lc.outcome is Outcome.FAILOVER
    lc.handle(TransferEnded(0.8, "m0", False, "reset"))
    lc.handle(TransferEnded(0.9, "r0", True))
    out = rld_tokens(lc, 0, 20) + lc.handle(DecodeEnded(2.0, Leg.RLD, EndReason.LENGTH))
    assert lc.tokens == [ref(i) for i in range(20)]
    assert out[-1] == Finish(Outcome.FAILOVER, FinishReason.LENGTH)


def test_direct_copy_failing_before_p_prefilled_fails_over_once_p_has():
    """P streams the KV with its prefill: the WAN copy may fail before P's
    first token. RLD takes the request; P keeps the KV and sends it there
    once it has computed it."""
    lc, _ = started(DIRECT)
    out = lc.handle(TransferEnded(0.3, "m0", False, "reset", healthy("r0", "m0")))
    assert of(out, OpenDecode) == [OpenDecode(Leg.RLD, "r0", False)] and lc.outcome is Outcome.FAILOVER
    assert not of(out, StartTransfer) and not of(out, ReleaseP)
    assert of(lc.handle(Prefilled(0.5, ref(0))), StartTransfer) == [StartTransfer("r0")]
    assert lc.handle(TransferEnded(0.9, "r0", True)) == [ReleaseP("p0")]
    out = rld_tokens(lc, 0, 20) + lc.handle(DecodeEnded(2.0, Leg.RLD, EndReason.LENGTH))
    assert lc.tokens == [ref(i) for i in range(20)]
    assert out[-1] == Finish(Outcome.FAILOVER, FinishReason.LENGTH)


def test_direct_md_failure_with_no_rld_is_a_clear_error():
    lc, _ = started(DIRECT)
    lc.handle(Prefilled(0.5, ref(0)))
    out = lc.handle(PeerGone(0.7, Leg.MD, "silent", healthy("m0")))
    assert out[-1].reason is FinishReason.ERROR and "main decode failed: silent" in out[-1].error


def test_wan_cut_during_a_relay_leaves_the_stream_to_rld():
    lc, _ = started(RELAY)
    lc.handle(Prefilled(0.5, ref(0)))
    lc.handle(TransferEnded(0.6, "r0", True))
    rld_tokens(lc, 0, 4)
    out = lc.handle(TransferEnded(1.0, "m0", False, "connection reset"))
    assert WanFailed() in out and Abort(Leg.MD, "m0") in out and ReleaseP("p0") in out
    out = rld_tokens(lc, 4, 20) + lc.handle(DecodeEnded(2.0, Leg.RLD, EndReason.LENGTH))
    assert lc.tokens == [ref(i) for i in range(20)] and out[-1].outcome is Outcome.RELAY


def test_md_lost_after_the_final_batch_resumes_rld_with_its_held_tokens():
    lc, _ = started(RELAY)
    lc.handle(Prefilled(0.5, ref(0)))
    lc.handle(TransferEnded(0.6, "r0", True))
    rld_tokens(lc, 0, 5)
    lc.handle(KvReady(1.0, rld_view()))
    rld_tokens(lc, 5, 7)                          # held: RLD was already past stop_at
    out = lc.handle(DecodeEnded(1.5, Leg.MD, EndReason.ERROR, "MD died"))
    assert ResumeRld("r0") in out
    assert emitted(out) == [(5, ref(5), Leg.RLD), (6, ref(6), Leg.RLD)]
    out = rld_tokens(lc, 7, 20) + lc.handle(DecodeEnded(2.0, Leg.RLD, EndReason.LENGTH))
    assert lc.tokens == [ref(i) for i in range(20)] and out[-1].reason is FinishReason.LENGTH


def test_output_ending_at_the_final_batch_ends_the_request():
    """RLD stopped at the final batch and then made the answer's last token
    (EOS) while paused: MD's normal end at the handoff point finishes the
    request (it used to wait for the deadline)."""
    lc, _ = started(RELAY, max_tokens=20)
    lc.handle(Prefilled(0.5, ref(0)))
    lc.handle(TransferEnded(0.6, "r0", True))
    rld_tokens(lc, 0, 4)
    assert of(lc.handle(KvReady(1.0, rld_view())), PauseRld) == [PauseRld("r0")]   # one-shot at 4
    assert lc.handle(DecodeEnded(1.1, Leg.RLD, EndReason.STOP)) == []    # paused: MD decides
    out = lc.handle(DecodeEnded(1.2, Leg.MD, EndReason.STOP))
    assert out[-1] == Finish(Outcome.RELAY, FinishReason.STOP) and lc.tokens == [ref(i) for i in range(4)]


def test_no_handoff_for_the_last_few_tokens():
    """MD is ready when at most `catchup_final_max_tokens` of the answer's bound
    are left (here all of it is out): handing over would stall the user for MD's
    extend to gain nothing, so RLD ends the request; MD gets no extend and RLD
    no pause."""
    lc, _ = started(RELAY, max_tokens=12)
    lc.handle(Prefilled(0.5, ref(0)))
    lc.handle(TransferEnded(0.6, "r0", True))
    rld_tokens(lc, 0, 6)
    out = lc.handle(KvReady(1.0, rld_view()))          # 6 left, catchup_final_max_tokens 8
    out += rld_tokens(lc, 6, 12) + lc.handle(DecodeEnded(1.6, Leg.RLD, EndReason.LENGTH))
    assert not of(out, PauseRld) and not of(out, ExtendMd)
    assert out[-1] == Finish(Outcome.RELAY, FinishReason.LENGTH) and lc.tokens == [ref(i) for i in range(12)]
    assert lc.rld_emitted == 12 and lc.session.state is HandoffState.ENDED_ON_RLD


def test_md_lost_after_rld_finished_while_paused_ends_on_rld():
    lc, _ = started(RELAY, max_tokens=20)
    lc.handle(Prefilled(0.5, ref(0)))
    lc.handle(TransferEnded(0.6, "r0", True))
    rld_tokens(lc, 0, 4)
    lc.handle(KvReady(1.0, rld_view()))
    rld_tokens(lc, 4, 6)
    lc.handle(DecodeEnded(1.1, Leg.RLD, EndReason.STOP))
    out = lc.handle(DecodeEnded(1.2, Leg.MD, EndReason.ERROR, "MD died"))
    assert out[-1] == Finish(Outcome.RELAY, FinishReason.STOP) and lc.tokens == [ref(i) for i in range(6)]


def test_rld_lost_before_the_handoff_md_takes_over_at_the_users_token():
    lc, _ = started(RELAY)
    lc.handle(Prefilled(0.5, ref(0)))
    lc.handle(TransferEnded(0.6, "r0", True))
    rld_tokens(lc, 0, 6)
    out = lc.handle(PeerGone(1.0, Leg.RLD, "silent", healthy("m0")))
    assert Abort(Leg.RLD, "r0") in out and of(out, ExtendMd) == []      # MD's KV not there yet
    lc.handle(TransferEnded(1.5, "m0", True))
    out = lc.handle(KvReady(1.6))
    assert of(out, ExtendMd) == [ExtendMd("m0", tuple(ref(i) for i in range(1, 6)), True)]
    out = md_tokens(lc, 6, 20) + lc.handle(DecodeEnded(2.0, Leg.MD, EndReason.LENGTH))
    assert lc.tokens == [ref(i) for i in range(20)] and out[-1].reason is FinishReason.LENGTH


def test_rld_lost_on_a_filtered_request_p_resends_to_md():
    lc, _ = started(FILTERED, warm_blocks=2)          # P holds the KV while the warm copy crosses
    lc.handle(Prefilled(0.5, ref(0)))
    lc.handle(TransferEnded(0.6, "r0", True))
    rld_tokens(lc, 0, 3)
    out = lc.handle(DecodeEnded(1.0, Leg.RLD, EndReason.CLOSED, healthy=healthy("m1", "m0")))
    assert of(out, OpenDecode) == [OpenDecode(Leg.MD, "m0", True)] and StartTransfer("m0") in out
    lc.handle(TransferEnded(1.5, "m0", True))
    out = lc.handle(KvReady(1.6))
    assert of(out, ExtendMd) == [ExtendMd("m0", (ref(1), ref(2)), True)]
    md_tokens(lc, 3, 20)
    assert lc.handle(DecodeEnded(2.0, Leg.MD, EndReason.LENGTH))[-1].reason is FinishReason.LENGTH


def test_rld_lost_with_no_md_to_take_over_fails_naming_rld():
    lc, _ = started(WAN_DOWN)
    lc.handle(Prefilled(0.5, ref(0)))
    lc.handle(TransferEnded(0.6, "r0", True))          # P released: nobody holds the KV
    rld_tokens(lc, 0, 3)
    out = lc.handle(DecodeEnded(1.0, Leg.RLD, EndReason.ERROR, "reset", healthy("m0")))
    assert out[-1].reason is FinishReason.ERROR and "relay decode instance r0 was lost (reset)" in out[-1].error


def test_rld_kv_transfer_failure_counts_as_rld_lost():
    lc, _ = started(RELAY)
    lc.handle(Prefilled(0.5, ref(0)))
    out = lc.handle(TransferEnded(0.6, "r0", False, "refused", healthy("m0")))
    assert any(isinstance(c, Note) and c.event == "rld_lost" for c in out) and lc.owner is Leg.MD
    lc.handle(TransferEnded(1.5, "m0", True))
    out = lc.handle(KvReady(1.6))
    # Nothing streamed yet: P's first token goes out, MD extends nothing past it.
    assert emitted(out) == [(0, ref(0), Leg.P)] and of(out, ExtendMd) == [ExtendMd("m0", (), True)]


def test_both_decoders_lost_is_an_error():
    lc, _ = started(RELAY)
    lc.handle(Prefilled(0.5, ref(0)))
    lc.handle(TransferEnded(0.6, "r0", True))
    rld_tokens(lc, 0, 3)
    lc.handle(PeerGone(1.0, Leg.RLD, "silent", healthy("m0")))
    out = lc.handle(DecodeEnded(1.2, Leg.MD, EndReason.ERROR, "MD died"))
    assert out[-1].reason is FinishReason.ERROR and "after relay decode r0 was lost" in out[-1].error


def test_prefill_failure_client_gone_and_deadline_end_the_request():
    lc, _ = started(RELAY)
    assert "prefill failed: oom" in lc.handle(PrefillEnded(0.1, "oom"))[-1].error
    lc, _ = started(RELAY)
    lc.handle(Prefilled(0.5, ref(0)))
    # every open decode is aborted (a paused one would never see its stream close)
    assert lc.handle(ClientGone(0.6)) == [
        CloseStream(Leg.RLD), Abort(Leg.RLD, "r0"), CloseStream(Leg.MD), Abort(Leg.MD, "m0", keep_kv=True),
        Finish(Outcome.RELAY, FinishReason.CLIENT_GONE)]
    assert lc.handle(DecodeToken(0.7, Leg.RLD, 0, ref(0))) == []       # nothing after the end
    lc, _ = started(DIRECT)
    assert lc.handle(DeadlinePassed(9.0))[-1].error == "request deadline exceeded"


def test_out_of_order_tokens_are_an_error_not_a_wrong_stream():
    lc, _ = started(RELAY)
    lc.handle(Prefilled(0.5, ref(0)))
    lc.handle(TransferEnded(0.6, "r0", True))
    out = lc.handle(DecodeToken(1.0, Leg.RLD, 1, ref(1)))
    assert emitted(out) == [] and "out of order" in out[-1].error


def test_watched_streams_follow_the_lifecycle():
    lc, _ = started(RELAY)
    lc.handle(Prefilled(0.5, ref(0)))
    assert lc.watched() == []                           # RLD waits for its KV legitimately
    lc.handle(TransferEnded(0.6, "r0", True))
    assert lc.watched() == [(Leg.RLD, 0.6)]
    rld_tokens(lc, 0, 2, t=0.9)
    lc.handle(KvReady(1.0, rld_view()))                 # one-shot: RLD paused, MD extends
    assert lc.watched() == [(Leg.MD, 1.0)]


# --- the shared rules -----------------------------------------------------------------
def test_pick_spare_is_routings_rule_without_affinity():
    views = (InstanceView("r1", Role.RELAY, "a", 3, 0, 8, 1000, 1000),
             InstanceView("r0", Role.RELAY, "a", 1, 0, 8, 1000, 1000),
             InstanceView("r2", Role.RELAY, "a", 0, 0, 8, 0, 1000),       # no room for the KV
             InstanceView("m0", Role.MAIN, "b", 0, 0, 8, 1000, 1000))
    assert pick_spare(views, Role.RELAY, set(), REQ, 0.0, CFG) == "r0"
    assert pick_spare(views, Role.RELAY, {"r0"}, REQ, 0.0, CFG) == "r1"
    assert pick_spare(views, Role.RELAY, {"r0", "r1"}, REQ, 0.0, CFG) == "r2"   # full beats none
    assert pick_spare(views, Role.MAIN, {"m0"}, REQ, 0.0, CFG) is None


def test_one_outcome_label_per_decision():
    assert [Outcome.of(d) for d in (DIRECT, RELAY, FILTERED, WAN_DOWN)] == [
        Outcome.DIRECT, Outcome.RELAY, Outcome.RELAY_FILTERED, Outcome.WAN_DOWN]


def test_world_runs_a_relay_to_the_end_in_order():
    w = World(RELAY, num_out=12, max_tokens=30)
    w.run(lambda n: n - 1)                               # always the last enabled action
    assert w.user == [ref(i) for i in range(12)] and w.finish.reason is FinishReason.STOP
