import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdd.policy import (
    Abandon, Complete, HandoffError, HandoffMode, HandoffSession, HandoffState, InstanceView,
    PolicyConfig, Role, SendBatch, choose_handoff_mode,
)

# The batches as the policy decides them; sending the final one with RLD's
# next token (`handoff_on_rld_token`, on by default) has its own tests below.
CFG = PolicyConfig(handoff_on_rld_token=False, handoff_pace_ratio=0)


def rld(running):
    return InstanceView("r0", Role.RELAY, "dc-a", running, 0, 16, 100, 100)


def test_mode_choice_by_tokens_and_load():
    assert choose_handoff_mode(64, rld(0), CFG) is HandoffMode.ONE_SHOT
    assert choose_handoff_mode(65, rld(0), CFG) is HandoffMode.CATCH_UP
    assert choose_handoff_mode(65, rld(11), CFG) is HandoffMode.CATCH_UP
    assert choose_handoff_mode(65, rld(12), CFG) is HandoffMode.ONE_SHOT   # 12 >= 0.75 * 16


def test_mode_override():
    assert choose_handoff_mode(1, rld(0), PolicyConfig(handoff_mode="catch_up")) is HandoffMode.CATCH_UP
    assert choose_handoff_mode(999, rld(0), PolicyConfig(handoff_mode="one_shot")) is HandoffMode.ONE_SHOT


def test_one_shot_is_one_final_batch():
    s = HandoffSession("r", HandoffMode.ONE_SHOT, CFG)
    assert s.on_md_ready(1.0, 100) == SendBatch(0, 100, True)
    assert s.rld_stop_at == 100
    assert s.on_batch_extended(1.3, 100, 100) == Complete(100)
    assert s.state is HandoffState.DONE and len(s.batches_sent) == 1


def test_catch_up_sequence():
    s = HandoffSession("r", HandoffMode.CATCH_UP, CFG)
    assert s.on_md_ready(1.0, 100) == SendBatch(0, 100, False)
    assert s.on_batch_extended(1.3, 100, 112) == SendBatch(100, 112, False)
    assert s.on_batch_extended(1.4, 112, 115) == SendBatch(112, 115, True)
    assert s.on_batch_extended(1.5, 115, 115) == Complete(115)


def test_catch_up_forces_final_after_max_batches():
    s = HandoffSession("r", HandoffMode.CATCH_UP, PolicyConfig(catchup_max_batches=2, handoff_on_rld_token=False))
    s.on_md_ready(0.0, 100)
    assert not s.on_batch_extended(1.0, 100, 200).final
    assert s.on_batch_extended(2.0, 200, 300) == SendBatch(200, 300, True)


def test_catch_up_with_few_tokens_is_immediately_final():
    s = HandoffSession("r", HandoffMode.CATCH_UP, CFG)
    assert s.on_md_ready(0.0, 3) == SendBatch(0, 3, True)


def test_illegal_calls_raise():
    s = HandoffSession("r", HandoffMode.ONE_SHOT, CFG)
    with pytest.raises(HandoffError):
        s.on_batch_extended(0.0, 0, 0)
    s.on_md_ready(0.0, 10)
    with pytest.raises(HandoffError):
        s.on_md_ready(0.0, 10)
    with pytest.raises(HandoffError, match="extended to"):
        s.on_batch_extended(0.0, 5, 10)
    with pytest.raises(HandoffError, match="stop at"):
        s.on_batch_extended(0.0, 10, 12)
    with pytest.raises(HandoffError):
        s.on_rld_finished(0.0, 10)


def test_generated_count_never_goes_back():
    s = HandoffSession("r", HandoffMode.CATCH_UP, CFG)
    s.on_md_ready(0.0, 100)
    with pytest.raises(HandoffError, match="went back"):
        s.on_batch_extended(0.0, 100, 99)


def test_rld_finishing_first_abandons():
    s = HandoffSession("r", HandoffMode.CATCH_UP, CFG)
    s.on_md_ready(0.0, 100)
    assert s.on_rld_finished(0.5, 120) == Abandon(120, "request ended on RLD")
    assert s.state is HandoffState.ENDED_ON_RLD
    with pytest.raises(HandoffError):
        s.on_failed(0.6, "late")


def test_failure_resumes_rld_where_it_stopped():
    s = HandoffSession("r", HandoffMode.ONE_SHOT, CFG)
    s.on_md_ready(0.0, 40)
    assert s.on_failed(0.1, "md died").resume_at == 40
    assert s.state is HandoffState.FAILED


@settings(max_examples=200, deadline=None)
@given(
    mode=st.sampled_from(list(HandoffMode)),
    first=st.integers(0, 500),
    increments=st.lists(st.integers(0, 80), min_size=12, max_size=12),
    final_max=st.integers(0, 16),
    max_batches=st.integers(1, 6),
    on_token=st.booleans(),
)
def test_session_always_ends_with_contiguous_batches(mode, first, increments, final_max,
                                                     max_batches, on_token):
    cfg = PolicyConfig(catchup_final_max_tokens=final_max, catchup_threshold_tokens=64,
                       catchup_max_batches=max_batches, handoff_on_rld_token=on_token)
    s = HandoffSession("r", mode, cfg)
    generated = first
    action = s.on_md_ready(0.0, generated)
    last_call_generated = generated
    steps = iter(increments)
    while True:
        if action is None:
            # Armed: the final batch goes out with RLD's next token, and holds it.
            assert on_token and s.state is HandoffState.ARMED and s.rld_stop_at is None
            generated += 1
            last_call_generated = generated
            action = s.on_rld_token(1.5, generated)
            assert action.final and action.end == generated
        if not isinstance(action, SendBatch):
            break
        batch = action
        if batch.final:
            final_generated = last_call_generated
            action = s.on_batch_extended(1.0, batch.end, generated)
            break
        generated += next(steps)   # RLD keeps decoding during the extend
        last_call_generated = generated
        action = s.on_batch_extended(1.0, batch.end, generated)
    assert action == Complete(generated)
    batches = s.batches_sent
    assert batches[-1].final and batches[-1].end == final_generated == generated
    assert all(not b.final for b in batches[:-1])
    assert batches[0].start == 0
    for a, b in zip(batches, batches[1:]):
        assert a.end == b.start and a.start <= a.end
    if mode is HandoffMode.ONE_SHOT:
        assert len(batches) == 1
    assert len(batches) <= max_batches + 1


def test_an_armed_final_batch_goes_with_rlds_next_token_and_can_still_fail_back():
    cfg = PolicyConfig(handoff_pace_ratio=0)  # handoff_on_rld_token: the default; catch-up pauses RLD
    s = HandoffSession("r", HandoffMode.ONE_SHOT, cfg)
    assert s.on_md_ready(1.0, 7) is None and s.state is HandoffState.ARMED
    assert s.in_flight is None and s.rld_stop_at is None        # RLD keeps the stream meanwhile
    assert s.on_rld_token(1.1, 8) == SendBatch(0, 8, True)      # RLD's 8th token is out: pause now
    assert s.rld_stop_at == 8 and s.on_batch_extended(1.3, 8, 8) == Complete(8)
    # Armed, then RLD ends the request: nothing to hand over.
    s = HandoffSession("r", HandoffMode.ONE_SHOT, cfg)
    s.on_md_ready(1.0, 3)
    assert s.on_rld_finished(1.2, 4) == Abandon(4, "request ended on RLD")
    # Armed, then MD fails: RLD resumes from what it had generated, MD was promised nothing.
    s = HandoffSession("r", HandoffMode.CATCH_UP, cfg)
    first = s.on_md_ready(1.0, 100)
    assert first == SendBatch(0, 100, False)
    assert s.on_batch_extended(1.4, 100, 105) is None and s.state is HandoffState.ARMED
    assert s.on_failed(1.5, "md down") == Abandon(105, "md down")


def test_with_only_ps_token_out_the_final_batch_goes_at_once():
    # RLD has not decoded yet (its first step may be far off): waiting for its
    # token would only add that step to the switch.
    s = HandoffSession("r", HandoffMode.ONE_SHOT, PolicyConfig())
    assert s.on_md_ready(1.0, 1, rld_decoding=False) == SendBatch(0, 1, True)
    assert s.rld_stop_at == 1


def test_no_final_batch_for_the_last_few_tokens():
    """A final batch that would leave MD at most `catchup_final_max_tokens` of
    the output bound is not sent: RLD ends the request (a 41-token answer was
    handed over at 40, its last token 3.4x the median gap late)."""
    cfg = PolicyConfig(catchup_final_max_tokens=2, catchup_threshold_tokens=2, catchup_max_batches=2)
    # catch-up that never converges: the forced final batch falls near the end
    s = HandoffSession("r", HandoffMode.CATCH_UP, PolicyConfig(catchup_final_max_tokens=2, catchup_threshold_tokens=2,
                                                                catchup_max_batches=2, handoff_on_rld_token=False),
                       max_tokens=41)
    assert s.on_md_ready(1.0, 10) == SendBatch(0, 10, False)
    assert s.on_batch_extended(1.5, 10, 30) == SendBatch(10, 30, False)
    assert s.on_batch_extended(2.0, 30, 39) is None            # forced final at 39: 2 left
    assert s.state is HandoffState.RLD_FINISHES and s.rld_stop_at is None
    assert s.on_rld_finished(2.2, 41) == Abandon(41, "request ended on RLD")
    # armed final (sent with RLD's next token): judged when that token comes
    s = HandoffSession("r", HandoffMode.ONE_SHOT, cfg, max_tokens=10)
    assert s.on_md_ready(1.0, 5) is None and s.state is HandoffState.ARMED
    assert s.on_rld_token(1.1, 8) is None and s.state is HandoffState.RLD_FINISHES
    # with more left, the same session sends its final batch as before
    s = HandoffSession("r", HandoffMode.ONE_SHOT, cfg, max_tokens=20)
    assert s.on_md_ready(1.0, 5) is None and s.on_rld_token(1.1, 6) == SendBatch(0, 6, True)
    # no bound known: as before
    s = HandoffSession("r", HandoffMode.ONE_SHOT, CFG)
    assert s.on_md_ready(1.0, 100) == SendBatch(0, 100, True)
