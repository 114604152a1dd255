"""The engine against the unpaged reference: batching, chunking, prefix reuse,
extend, preemption and bad input, on the tiny random Llama (fp32)."""

from __future__ import annotations

import random

import pytest

from pdd.engine.config import EngineConfig
from pdd.engine.engine import Engine, InvalidRequestError
from pdd.engine.request import EngineRequest, SamplingParams
from pdd.model.reference import generate_greedy


def make_engine(tiny_model, **kw) -> Engine:
    model, cfg = tiny_model
    return Engine(model, cfg, EngineConfig(**({"num_blocks": 256, "block_size": 16} | kw)))


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 5000) for _ in range(n)]


def run(engine: Engine, reqs: list[EngineRequest], max_steps: int = 2000) -> dict[str, list[int]]:
    out = {r.request_id: [] for r in reqs}
    for r in reqs:
        engine.submit(r)
    done = set()
    for _ in range(max_steps):
        for ev in engine.step():
            if ev.token_id is not None:
                out[ev.request_id].append(ev.token_id)
            if ev.finished:
                done.add(ev.request_id)
        if len(done) == len(reqs):
            return out
    raise AssertionError("engine did not finish within the step bound")


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def test_single_request_matches_reference(tiny_model):
    model, _ = tiny_model
    p = prompt(1, 37)
    ref = generate_greedy(model, p, 24)
    got = run(make_engine(tiny_model), [EngineRequest("a", p, greedy(24))])["a"]
    assert got == ref


def test_concurrent_requests_chunked_prefill_equal_each_alone(tiny_model):
    model, _ = tiny_model
    prompts = {f"r{i}": prompt(10 + i, n) for i, n in enumerate([5, 17, 64, 130, 33, 250])}
    refs = {k: generate_greedy(model, p, 20) for k, p in prompts.items()}
    eng = make_engine(tiny_model, max_num_batched_tokens=48)   # forces chunks and mixed steps
    got = run(eng, [EngineRequest(k, p, greedy(20)) for k, p in prompts.items()])
    assert got == refs
    assert any(r.num_prefill_tokens and r.num_decode_tokens for r in eng.step_log), "no mixed step"
    assert eng.pool.num_used == 0
    # the stats carry the last steps that computed prompts, newest first, with
    # their attention work (the router fits P's step, token and attention costs)
    from pdd.policy.views import PREFILL_FIT_STEPS, prefill_attention
    pre = [r for r in eng.step_log if r.num_prefill_tokens][::-1][:PREFILL_FIT_STEPS]
    assert eng.stats()["prefill_steps"] == [[r.num_prefill_tokens, round(r.wall_s, 6), r.prefill_attn] for r in pre]
    # one prompt alone in 48-token chunks: each step's attention is its chunk's
    eng = make_engine(tiny_model, max_num_batched_tokens=48)
    run(eng, [EngineRequest("a", prompt(30, 130), greedy(2))])
    assert [(r.num_prefill_tokens, r.prefill_attn) for r in eng.step_log if r.num_prefill_tokens] == [
        (48, prefill_attention(0, 48)), (48, prefill_attention(48, 48)), (34, prefill_attention(96, 34))]
    # each step's CPU time on the engine's thread: spent, and no more than its wall time
    assert all(0 < r.cpu_s <= r.wall_s * 1.05 + 1e-3 for r in eng.step_log)


def test_prefix_reuse_gives_same_tokens(tiny_model):
    model, _ = tiny_model
    base = prompt(3, 100)
    longer = base + prompt(4, 21)
    eng = make_engine(tiny_model)
    run(eng, [EngineRequest("a", base, greedy(4))])
    got = run(eng, [EngineRequest("b", longer, greedy(16))])["b"]
    assert eng.requests["b"].num_cached_tokens == 96          # 6 full blocks of 16
    assert got == generate_greedy(model, longer, 16)
    assert eng.stats()["prefix_hit_tokens"] == 96


def test_extend_equals_decoding_one_by_one(tiny_model):
    model, _ = tiny_model
    p = prompt(5, 40)
    ref = generate_greedy(model, p, 30)
    eng = make_engine(tiny_model)
    # resumed with 7 tokens made elsewhere, computed in one pass
    got = run(eng, [EngineRequest("x", p, greedy(30), output_ids=ref[:7])])["x"]
    assert got == ref[7:]
    # held request: two non-final batches then a final one (catch-up handoff shape)
    eng.submit(EngineRequest("y", p, greedy(30), hold=True))
    assert [e.extended_upto for e in drain(eng)] == [0]
    eng.extend("y", ref[:5], final=False)
    assert [e.extended_upto for e in drain(eng)] == [5]
    eng.extend("y", ref[5:12], final=False)
    assert [e.extended_upto for e in drain(eng)] == [12]
    eng.extend("y", ref[12:14], final=True)
    evs = drain(eng)
    assert [e.token_id for e in evs if e.token_id is not None] == ref[14:]
    assert evs[-1].finished and evs[-1].finish_reason == "length"


def drain(engine: Engine, max_steps: int = 500) -> list:
    events = []
    for _ in range(max_steps):
        if not engine.has_work:
            return events
        events += engine.step()
    raise AssertionError("engine kept working past the step bound")


def test_preemption_keeps_output_identical(tiny_model):
    model, _ = tiny_model
    prompts = {f"p{i}": prompt(20 + i, 60) for i in range(4)}
    refs = {k: generate_greedy(model, p, 40) for k, p in prompts.items()}
    eng = make_engine(tiny_model, num_blocks=16, block_size=16, max_num_batched_tokens=128)
    got = run(eng, [EngineRequest(k, p, greedy(40)) for k, p in prompts.items()])
    assert got == refs
    assert sum(r.num_preemptions for r in eng.requests.values()) > 0


def test_seeded_sampling_is_reproducible_and_stops(tiny_model):
    sp = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True)
    a = run(make_engine(tiny_model), [EngineRequest("s", prompt(6, 20), sp)])["s"]
    b = run(make_engine(tiny_model), [EngineRequest("s", prompt(6, 20), sp)])["s"]
    assert a == b and len(a) == 12
    stop = SamplingParams(max_tokens=12, stop_token_ids=(a[3],), ignore_eos=True)
    greedy_out = run(make_engine(tiny_model), [EngineRequest("g", prompt(6, 20), greedy(12))])["g"]
    stop = SamplingParams(max_tokens=12, stop_token_ids=(greedy_out[3],), ignore_eos=True)
    eng = make_engine(tiny_model)
    c = run(eng, [EngineRequest("t", prompt(6, 20), stop)])["t"]
    assert c == greedy_out[: greedy_out.index(greedy_out[3]) + 1]
    assert eng.requests["t"].finish_reason == "stop"


def test_bad_input_is_refused_and_engine_keeps_serving(tiny_model):
    model, cfg = tiny_model
    eng = make_engine(tiny_model, max_model_len=128)
    eng.submit(EngineRequest("ok", prompt(8, 10), greedy(5)))
    with pytest.raises(InvalidRequestError, match="empty"):
        eng.submit(EngineRequest("e", [], greedy(5)))
    with pytest.raises(InvalidRequestError, match="context limit"):
        eng.submit(EngineRequest("long", prompt(9, 200), greedy(5)))
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        eng.submit(EngineRequest("v", [cfg.vocab_size + 5], greedy(5)))
    with pytest.raises(InvalidRequestError, match="duplicate"):
        eng.submit(EngineRequest("ok", prompt(8, 10), greedy(5)))
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=-1)
    evs = drain(eng)
    assert [e.request_id for e in evs if e.token_id is not None] == ["ok"] * 5
    assert eng.requests["ok"].finish_reason == "length"


def _decoding(tiny_model, n: int):
    """An engine decoding request "z" greedily (12 tokens), `n` of them out:
    (engine, prompt, the reference answer, the tokens so far)."""
    model, _ = tiny_model
    p = prompt(9, 40)
    ref = generate_greedy(model, p, 12)
    eng = make_engine(tiny_model)
    eng.submit(EngineRequest("z", p, greedy(12)))
    got = []
    while len(got) < n:
        got += [e.token_id for e in eng.step() if e.token_id is not None]
    return eng, p, ref, got


def test_a_paused_decode_stops_at_once_and_resumes_exactly(tiny_model):
    """extend(id, [], final=False) on a running decode (RLD paused for a
    handoff's final batch): no further step computes its sampled token; with
    nothing else to run the engine is idle; a resume continues the greedy
    answer exactly."""
    eng, p, ref, got = _decoding(tiny_model, 5)
    steps = eng.num_steps
    eng.extend("z", [], final=False)
    assert not eng.has_work and eng.step() == [] and eng.num_steps == steps    # no step ran
    eng.extend("z", [])                                                        # resume
    evs = drain(eng)
    assert got + [e.token_id for e in evs if e.token_id is not None] == ref
    assert evs[-1].finished and evs[-1].finish_reason == "length"


def test_a_pause_given_ahead_holds_after_that_token_and_resumes_exactly(tiny_model):
    """extend(id, [], final=False, hold_at=n) on a running decode (a final
    batch armed for RLD's next token): it makes tokens up to n, then starts no
    step; a second pause changes nothing; a resume continues the greedy
    answer exactly; a hold already passed holds at once; a resume before the
    hold is reached cancels it."""
    eng, p, ref, got = _decoding(tiny_model, 4)
    eng.extend("z", [], final=False, hold_at=6)
    while eng.has_work:
        got += [e.token_id for e in eng.step() if e.token_id is not None]
    assert got == ref[:6] and eng.requests["z"].status.name == "HELD"
    steps = eng.num_steps
    eng.extend("z", [], final=False)                                           # the final batch's pause
    assert not eng.has_work and eng.step() == [] and eng.num_steps == steps
    eng.extend("z", [], final=False, hold_at=3)                                # passed already: held
    assert not eng.has_work
    eng.extend("z", [])                                                        # resume
    evs = drain(eng)
    assert got + [e.token_id for e in evs if e.token_id is not None] == ref

    eng.submit(EngineRequest("w", p, greedy(12)))
    eng.extend("w", [], final=False, hold_at=2)                                # not admitted yet
    evs = drain(eng)
    assert [e.token_id for e in evs if e.token_id is not None] == ref[:2]
    assert eng.requests["w"].status.name == "HELD"
    eng.abort("w")

    eng.submit(EngineRequest("y", p, greedy(12)))
    eng.step()
    with pytest.raises(InvalidRequestError, match="hold_at"):
        eng.extend("y", [1], final=False, hold_at=2)
    eng.extend("y", [], final=False, hold_at=8)
    eng.extend("y", [])                                                        # disarmed before 8
    evs = drain(eng)
    assert [e.token_id for e in evs if e.token_id is not None] == ref[1:]
