"""RequestLifecycle under every order of events Hypothesis can find, with and
without faults: the user's stream never duplicates, drops or reorders a
token, and every request ends (in-memory world: tests/lifecycle_world.py)."""

import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdd.policy import Pipeline, PipelineDecision, PolicyConfig
from pdd.policy.lifecycle_io import FinishReason
from lifecycle_world import World, ref

DECISIONS = {
    "direct": PipelineDecision(Pipeline.DIRECT, "p0", None, "m0", True, 1000, 0.1, "t"),
    "relay": PipelineDecision(Pipeline.RELAY, "p0", "r0", "m0", True, 1000, 2.0, "t"),
    "relay_filterable": PipelineDecision(Pipeline.RELAY, "p0", "r0", "m0", True, 1000, 0.3, "t", True),
    "filtered": PipelineDecision(Pipeline.RELAY_ONLY, "p0", "r0", "m0", False, 1000, 9.0, "abnormal", True),
    "wan_down": PipelineDecision(Pipeline.RELAY_ONLY, "p0", "r0", None, False, 0, math.inf, "wan down"),
}

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def world(data, faults: int, bulk: bool = False, ahead: bool = False) -> World:
    """bulk: decoders emit 1-4 tokens per event (`DecodeTokens`, as the simulator's steps);
    ahead: a relay's WAN copy lands after RLD made a few tokens (sent to MD ahead of it)."""
    name = data.draw(st.sampled_from(["relay", "relay_filterable"] if ahead else sorted(DECISIONS)),
                     label="pipeline")
    modes = ["auto", "overlap", "paced"] if ahead else ["auto", "one_shot", "catch_up", "overlap", "paced"]
    mode = data.draw(st.sampled_from(modes), label="handoff")
    max_tokens = data.draw(st.integers(6 if ahead else 1, 24), label="max_tokens")
    num_out = data.draw(st.integers(6 if ahead else 1, 24), label="num_out")
    warm = data.draw(st.sampled_from([0, 2]), label="warm_blocks") if name == "filtered" else 0
    # Paced (MD as fast as RLD, the final batch leaves RLD streaming, its
    # tokens let out at `Wake`s): "paced", or "auto" / "catch_up" with the
    # ratio drawn above 0; 0 keeps the paused handoff.
    pace = 1.5 if mode == "paced" else data.draw(st.sampled_from([0, 1.5]), label="pace ratio")
    cfg = PolicyConfig(handoff_mode="auto" if mode == "overlap" else mode, catchup_threshold_tokens=2,
                       catchup_final_max_tokens=1, overlap_max_ahead=data.draw(st.integers(1, 3), label="ahead"),
                       overlap_max_lag=data.draw(st.integers(1, 6), label="lag"), handoff_pace_ratio=pace,
                       # RLD's tokens sent to MD ahead of its KV, which MD takes
                       # until the KV lands and decodes on from (auto, overlap, paced)
                       extend_ahead=ahead or data.draw(st.booleans(), label="extend ahead"))
    w = World(DECISIONS[name], num_out, max_tokens, cfg, warm_blocks=warm)
    if mode == "overlap":
        # MD decodes at a fifth of RLD's step: the final batch does not pause
        # RLD. Without faults, a relayed request's MD may make other tokens
        # from some index on (numerics of a different batch): the user must
        # still get the reference stream. (With RLD lost, MD's tokens past the
        # user's are the answer: nothing is left to check them against.)
        w.md_step_s = 0.01
    if mode in ("overlap", "paced") or pace:
        if not faults and name.startswith("relay"):
            w.md_wrong_from = data.draw(st.sampled_from([None, None, 1, 3, 6]), label="md wrong from")
    w.extra_after_pause = data.draw(st.integers(0, 3), label="tokens past a pause")
    if bulk:
        w.bulk = lambda n: data.draw(st.integers(1, n), label="bulk")
    if ahead:
        # MD's copy lands only after some of RLD's tokens: they go to MD ahead.
        w.md_lands_after = data.draw(st.integers(1, 5), label="md lands after")
    w.run(lambda n: data.draw(st.integers(0, n - 1)), faults=faults)
    return w


@SETTINGS
@given(st.data())
def test_any_order_without_faults_streams_exactly_the_reference(data):
    check_without_faults(world(data, faults=0))


def check_without_faults(w: World) -> None:
    assert w.finish.reason in (FinishReason.STOP, FinishReason.LENGTH), w.finish
    assert w.user == expected_stream(w)
    assert not w.used_deadline


def expected_stream(w: World) -> list[int]:
    """The reference, or where MD makes other tokens (`md_wrong_from`): the
    reference up to MD's first token shown, MD's own tokens from there. MD's
    tokens are a valid answer only if MD never ran past a token the user saw
    otherwise: everything it made (from the final batch's end) before its
    first one shown agrees."""
    from pdd.policy.lifecycle_io import Emit, Leg
    md_first = next((c.index for c in w.log if isinstance(c, Emit) and c.source is Leg.MD), None)
    if w.md_wrong_from is None or md_first is None:
        return [ref(i) for i in range(w.num_out)]
    made_from = w.lc.overlap_from if w.lc.overlap_from is not None else md_first
    assert md_first <= max(w.md_wrong_from, made_from), "the user was shown MD's tokens after MD had diverged"
    return [ref(i) for i in range(md_first)] + [w.tok(Leg.MD, i) for i in range(md_first, w.num_out)]


@SETTINGS
@given(st.data())
def test_tokens_sent_ahead_of_mds_kv_in_any_order_stream_exactly_the_reference(data):
    """RLD's tokens go to MD while its copy crosses and reach it before or
    after the landing; MD decodes on from what it took (possibly other tokens
    from some index on): the user's stream is the reference, with or without
    faults."""
    faults = data.draw(st.integers(0, 2), label="faults")
    w = world(data, faults=faults, ahead=True)
    check_with_faults(w) if faults else check_without_faults(w)


@SETTINGS
@given(st.data())
def test_any_order_with_faults_never_corrupts_the_stream_and_always_ends(data):
    check_with_faults(world(data, faults=data.draw(st.integers(1, 3), label="faults")))


def check_with_faults(w: World) -> None:
    assert w.finish is not None
    assert w.user == [ref(i) for i in range(len(w.user))]       # a prefix: nothing duplicated or skipped
    if w.finish.reason in (FinishReason.STOP, FinishReason.LENGTH):
        assert len(w.user) == w.num_out
    else:
        assert w.finish.reason is FinishReason.CLIENT_GONE or w.finish.error


def _run_killing(name: str, victim: str, at_step: int) -> World:
    """Run in a fixed order (the first enabled action), killing `victim` before step `at_step`."""
    cfg = PolicyConfig(catchup_threshold_tokens=2, catchup_final_max_tokens=1)
    w = World(DECISIONS[name], 10, 16, cfg)
    for step in range(500):
        if w.finish is not None:
            w.num_steps = step
            return w
        if step == at_step and w.alive[victim]:
            w.step(("kill", victim))
            continue
        acts = w.actions(faults=False)
        w.step(acts[0]) if acts else w.idle()
    raise AssertionError("request did not end")


def test_each_instance_gone_at_each_step_ends_cleanly():
    """P, RLD or MD lost before every step of every pipeline: the request
    ends, its stream a prefix of the reference, complete when it says so."""
    num_runs = 0
    for name in sorted(DECISIONS):
        clean = _run_killing(name, "p0", 10_000)
        for victim in ("p0", "r0", "m0"):
            for at in range(clean.num_steps):
                w = _run_killing(name, victim, at)
                num_runs += 1
                assert w.user == [ref(i) for i in range(len(w.user))], (name, victim, at)
                if w.finish.reason in (FinishReason.STOP, FinishReason.LENGTH):
                    assert len(w.user) == w.num_out, (name, victim, at)
                else:
                    assert w.finish.error, (name, victim, at)
                assert not w.used_deadline, (name, victim, at, w.finish)
    assert num_runs > 100
