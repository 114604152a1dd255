"""RLD's tokens sent to MD ahead of its KV (`PolicyConfig.extend_ahead`):
what goes out while the copy crosses, MD racing RLD from what it took at the
landing (overlap, paced, a busy RLD paused, RLD ending the request itself),
RLD lost before the landing, and the switch's timing against a slow RLD. In
process, fact by fact (event orders: tests/test_policy_lifecycle_orders.py;
the decode server's side: tests/test_pdd.py)."""

import dataclasses

import pytest

from pdd.policy import InstanceView, PolicyConfig, Role
from pdd.policy.handoff import HandoffState
from pdd.policy.lifecycle_io import (
    Abort, DecodeEnded, DecodeToken, EndReason, ExtendAhead, ExtendMd, Finish, FinishReason, KvReady, Leg, Note,
    Outcome, PauseRld, PeerGone, Prefilled, TransferEnded,
)
from lifecycle_world import ref
from test_policy_lifecycle import DIRECT, RELAY, emitted, healthy, md_tokens, md_view, of, rld_view, started

AHEAD = PolicyConfig(handoff_on_rld_token=False, handoff_pace_ratio=0)


def relaying(cfg=AHEAD, max_tokens=40, made=6, t0=1.0, gap=0.05):
    """A relay whose RLD made `made` tokens (0 from P, as RLD passed it on),
    `gap` apart from `t0`, while MD's copy crossed; (lifecycle, commands)."""
    lc, _ = started(RELAY, max_tokens=max_tokens, cfg=cfg)
    lc.handle(Prefilled(0.5, ref(0)))
    lc.handle(TransferEnded(0.6, "r0", True))
    out = []
    for i in range(made):
        out += lc.handle(DecodeToken(t0 + gap * i, Leg.RLD, i, ref(i), rld_view()))
    return lc, out


def test_rlds_tokens_go_to_md_as_they_come_while_its_copy_crosses():
    lc, out = relaying()
    # From index 1 (MD has P's first with the KV), each fact's new tokens once.
    assert of(out, ExtendAhead) == [ExtendAhead("m0", i, (ref(i),)) for i in range(1, 6)]
    assert of(out, ExtendMd) == [] and lc.ahead_upto == 6
    # None once MD's kv_ready is in, nor for a direct request, nor with the option off.
    lc.handle(TransferEnded(1.5, "m0", True))
    lc.handle(KvReady(1.6, rld_view(), md=md_view(0.0125), md_have=6))
    assert of(lc.handle(DecodeToken(1.7, Leg.RLD, 6, ref(6), rld_view())), ExtendAhead) == []
    lc, _ = started(DIRECT)
    lc.handle(Prefilled(0.5, ref(0)))
    assert of(md_tokens(lc, 0, 5), ExtendAhead) == []
    for cfg in (dataclasses.replace(AHEAD, extend_ahead=False), dataclasses.replace(AHEAD, handoff_mode="one_shot")):
        _, out = relaying(cfg)
        assert of(out, ExtendAhead) == []


def test_md_decoding_on_from_what_it_took_races_rld_with_no_batch():
    """MD took tokens 1-4 of the 5 sent (token 5's call came after its
    landing): no extend after its kv_ready, RLD not paused; MD's token 5 is
    checked against the user's, its 6 waits for RLD's 6 (due within MD's
    lead), and its 7 takes the stream."""
    lc, _ = relaying()
    lc.handle(TransferEnded(1.4, "m0", True))
    out = lc.handle(KvReady(1.45, rld_view(), md=md_view(0.0125), md_have=5))
    assert of(out, ExtendMd) == [] and of(out, PauseRld) == []
    assert lc.session.mode.value == "overlap" and lc.session.state is HandoffState.FINAL_IN_FLIGHT
    assert lc.overlap_from == lc.md_upto == 5 and lc.handoff_batches == 1
    assert Note("md_ready", {"eager_tokens": 6, "mode": "overlap", "ahead": 5}) in out
    assert emitted(lc.handle(DecodeToken(1.46, Leg.MD, 5, ref(5)))) == []        # the user has it
    assert emitted(lc.handle(DecodeToken(1.47, Leg.MD, 6, ref(6)))) == []        # RLD's 6 due at 1.5
    assert emitted(lc.handle(DecodeToken(1.50, Leg.RLD, 6, ref(6), rld_view()))) == [(6, ref(6), Leg.RLD)]
    out = lc.handle(DecodeToken(1.51, Leg.MD, 7, ref(7)))
    assert emitted(out) == [(7, ref(7), Leg.MD)] and lc.owner is Leg.MD and Abort(Leg.RLD, "r0", background=True) in out
    out = md_tokens(lc, 8, 40) + lc.handle(DecodeEnded(2.0, Leg.MD, EndReason.LENGTH))
    assert lc.tokens == [ref(i) for i in range(40)] and out[-1] == Finish(Outcome.RELAY, FinishReason.LENGTH)
    assert lc.session.state is HandoffState.DONE


def test_md_not_faster_than_rld_is_paced_from_the_landing():
    cfg = dataclasses.replace(AHEAD, handoff_pace_ratio=1.5)
    lc, _ = relaying(cfg, gap=0.04)
    lc.handle(TransferEnded(1.205, "m0", True))
    out = lc.handle(KvReady(1.21, rld_view(), md=md_view(0.04), md_have=6))
    assert lc.session.mode.value == lc.session.chosen.value == "paced"
    # MD's first token due two of its steps after the landing, 0.05 s after the
    # user's next would go out unstretched: spread over overlap_max_lag tokens.
    assert lc.pace_gap_s == pytest.approx(0.04 + 0.05 / 8) and of(out, ExtendMd) == []


def test_a_busy_rld_pauses_at_once_and_md_catches_the_user_up():
    """The choice would have been one-shot (RLD busy, MD not faster): RLD
    stops now, its token on the way is held back, MD's tokens from where
    it stands catch up and take the stream."""
    busy = InstanceView("r0", Role.RELAY, "a", 7, 0, 8, 1000, 1000, 0.05)
    lc, _ = relaying()
    lc.handle(TransferEnded(1.4, "m0", True))
    out = lc.handle(KvReady(1.45, busy, md=md_view(0.05), md_have=4))
    assert lc.session.chosen.value == "one_shot" and of(out, PauseRld) == [PauseRld("r0")] and lc.stop_at == 6
    assert emitted(lc.handle(DecodeToken(1.5, Leg.RLD, 6, ref(6), busy))) == []
    assert emitted(md_tokens(lc, 4, 6)) == []
    assert emitted(md_tokens(lc, 6, 8)) == [(6, ref(6), Leg.MD), (7, ref(7), Leg.MD)]


def test_md_stops_when_rld_ends_the_request_within_the_final_batch_bound():
    """Two tokens of the bound left (catchup_final_max_tokens): RLD ends the
    request; MD's decode is stopped, its KV kept for its prefix cache."""
    lc, _ = relaying(dataclasses.replace(AHEAD, catchup_final_max_tokens=2), max_tokens=8)
    lc.handle(TransferEnded(1.4, "m0", True))
    out = lc.handle(KvReady(1.45, rld_view(), md=md_view(0.0125), md_have=6))
    assert Abort(Leg.MD, "m0", keep_kv=True, background=True) in out and not lc.md_live
    assert lc.session.state is HandoffState.RLD_FINISHES
    out = [c for i in (6, 7) for c in lc.handle(DecodeToken(1.5, Leg.RLD, i, ref(i), rld_view()))]
    out += lc.handle(DecodeEnded(1.6, Leg.RLD, EndReason.LENGTH))
    assert lc.tokens == [ref(i) for i in range(8)] and out[-1] == Finish(Outcome.RELAY, FinishReason.LENGTH)


def test_rld_lost_before_the_landing_md_goes_on_from_what_it_took():
    lc, _ = relaying()
    out = lc.handle(PeerGone(1.4, Leg.RLD, "silent", healthy("m0")))
    assert lc.takeover_pending and lc.owner is Leg.MD and of(out, ExtendMd) == []
    lc.handle(TransferEnded(1.5, "m0", True))
    out = lc.handle(KvReady(1.6, md=md_view(0.0125), md_have=4))
    assert of(out, ExtendMd) == [] and not lc.takeover_pending
    out = md_tokens(lc, 4, 40) + lc.handle(DecodeEnded(2.0, Leg.MD, EndReason.LENGTH))
    assert emitted(out) == [(i, ref(i), Leg.MD) for i in range(6, 40)] and out[-1].reason is FinishReason.LENGTH


def test_md_taking_tokens_never_sent_fails_the_request():
    lc, _ = relaying(made=3)
    lc.handle(TransferEnded(1.4, "m0", True))
    out = lc.handle(KvReady(1.45, rld_view(), md=md_view(0.0125), md_have=7))
    assert out[-1].reason is FinishReason.ERROR and "took 7 tokens" in out[-1].error


def test_mds_first_token_past_a_slow_rld_goes_out_at_once():
    """RLD beside P's cold prefill makes a token every 0.25 s, MD every 0.05:
    MD's first token past the user's, 0.05 s after RLD's last, goes out at
    once (RLD's next is not due before MD would be overlap_max_ahead ahead),
    where waiting would hold it to RLD's next and release MD's in a burst a
    whole RLD gap after the user's last token. One due soon is waited for."""
    slow = InstanceView("r0", Role.RELAY, "a", 1, 0, 8, 1000, 1000, 0.25)
    for rld_last, shown in ((2.00, [(6, ref(6), Leg.MD)]), (1.83, [])):
        lc, _ = relaying(made=6, t0=rld_last - 1.25, gap=0.25)
        lc.handle(TransferEnded(2.0, "m0", True))
        lc.handle(KvReady(2.01, slow, md=md_view(0.05), md_have=6))
        assert emitted(lc.handle(DecodeToken(2.05, Leg.MD, 6, ref(6)))) == shown, rld_last
