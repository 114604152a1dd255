"""VllmEngine: vLLM behind our Engine's verbs (submit / step / abort /
forget / stats / step_log), and vLLM's prefix cache read by block content."""

from __future__ import annotations

import random

from pdd.engine.engine import InvalidRequestError
from pdd.engine.request import EngineRequest, RequestStatus, SamplingParams

import pytest


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def drain(engine, rids: set[str]) -> dict[str, list]:
    events = {r: [] for r in rids}
    for _ in range(2000):
        if not engine.has_work:
            break
        for ev in engine.step():
            if ev.request_id in events:
                events[ev.request_id].append(ev)
    return events


def test_streamed_tokens_equal_vllms_own_greedy_run(ref_engine, greedy):
    prompts = {f"a{k}": ids(k, n) for k, n in enumerate((40, 150, 333))}
    for rid, p in prompts.items():
        ref_engine.submit(EngineRequest(rid, p, SamplingParams(max_tokens=12, ignore_eos=True)))
    events = drain(ref_engine, set(prompts))
    for rid, p in prompts.items():
        evs = events[rid]
        assert [e.token_id for e in evs] == greedy(p, 12)
        assert [e.index for e in evs] == list(range(12))      # one event a token, in order
        assert evs[-1].finished and evs[-1].finish_reason == "length"
        assert not any(e.finished for e in evs[:-1])
        assert ref_engine.requests[rid].status == RequestStatus.FINISHED_LENGTH
        ref_engine.forget(rid)
        assert rid not in ref_engine.requests


def test_prefix_cache_is_read_by_content_and_reported_as_cached_tokens(ref_engine, greedy):
    from pdd.vllm.prefix import VllmPrefixIndex

    index = VllmPrefixIndex(ref_engine.llm.engine_core.engine_core, 32)
    p = ids(7, 200)
    assert index.matched_tokens(p) == 0
    ref_engine.submit(EngineRequest("pc1", p, SamplingParams(max_tokens=2, ignore_eos=True)))
    drain(ref_engine, {"pc1"})
    assert index.matched_tokens(p) == 192                       # the 6 full blocks of 32
    assert index.matched_tokens(p[:100]) == 96
    assert index.matched_tokens(p[:64] + ids(8, 100)) == 64    # diverges in block 3
    assert index.matched_tokens(ids(9, 200)) == 0
    ref_engine.submit(EngineRequest("pc2", p + [5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True)))
    drain(ref_engine, {"pc2"})
    assert ref_engine.requests["pc2"].num_cached_tokens == 192


def test_abort_ends_a_request_and_bad_requests_are_refused(ref_engine):
    ref_engine.submit(EngineRequest("ab1", ids(11, 50), SamplingParams(max_tokens=500, ignore_eos=True)))
    ref_engine.step()
    assert ref_engine.abort("ab1") is True
    assert ref_engine.requests["ab1"].status == RequestStatus.FINISHED_ABORTED
    events = drain(ref_engine, {"ab1"})
    assert not any(e.token_id is not None for e in events["ab1"])   # nothing after the abort
    assert not ref_engine.has_work
    with pytest.raises(InvalidRequestError, match="duplicate"):
        ref_engine.submit(EngineRequest("ab1", [1, 2], SamplingParams()))
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        ref_engine.submit(EngineRequest("ab2", [1, 10**9], SamplingParams()))
    with pytest.raises(InvalidRequestError, match="empty"):
        ref_engine.submit(EngineRequest("ab3", [], SamplingParams()))


def test_stats_and_step_log_describe_the_engine(ref_engine):
    s = ref_engine.stats()
    assert s["backend"] == "vllm"
    assert s["kv_total_blocks"] == 512 and 0 < s["kv_free_blocks"] <= 512
    assert s["num_running"] == 0 and s["num_waiting"] == 0
    assert s["prefix_hit_tokens"] >= 192 and 0 < s["prefix_hit_rate"] < 1
    assert ref_engine.step_log and all(r.wall_s > 0 for r in ref_engine.step_log)
    assert any(r.num_prefill_tokens > 0 for r in ref_engine.step_log)
    assert s["decode_step_s"] is not None and s["decode_step_s"] > 0


def test_a_held_request_takes_extend_batches_and_continues_the_greedy_sequence(ref_engine, greedy):
    p = ids(30, 150)
    want = greedy(p, 14)
    ref_engine.submit(EngineRequest("h1", p, SamplingParams(max_tokens=14, ignore_eos=True),
                                    output_ids=[want[0]], hold=True))
    assert ref_engine.requests["h1"].status == RequestStatus.HELD
    ref_engine.extend("h1", want[1:5], final=False)          # a catch-up batch: taken, nothing sampled
    evs = drain(ref_engine, {"h1"})["h1"]
    assert [(e.extended_upto, e.token_id) for e in evs] == [(5, None)]
    ref_engine.extend("h1", want[5:8], final=True)           # the final batch: one pass, then sampling
    evs = drain(ref_engine, {"h1"})["h1"]
    assert [e.index for e in evs] == list(range(8, 14))      # no duplicated or missing index
    assert [e.token_id for e in evs] == want[8:]
    assert evs[-1].finished and evs[-1].finish_reason == "length"
    ref_engine.forget("h1")


def test_pause_and_resume_lose_no_token(ref_engine, greedy):
    p = ids(31, 120)
    want = greedy(p, 12)
    ref_engine.submit(EngineRequest("pr1", p, SamplingParams(max_tokens=12, ignore_eos=True)))
    got = []
    while len(got) < 4:
        got += [e.token_id for e in ref_engine.step() if e.request_id == "pr1" and e.token_id is not None]
    ref_engine.extend("pr1", [], final=False)                 # RLD paused for the final batch
    assert not ref_engine.has_work
    ref_engine.extend("pr1", [])                              # MD failed: RLD carries on
    evs = drain(ref_engine, {"pr1"})["pr1"]
    assert [e.index for e in evs] == list(range(len(got), 12))
    assert got + [e.token_id for e in evs] == want
    with pytest.raises(InvalidRequestError, match="finished"):
        ref_engine.extend("pr1", [1])
    ref_engine.forget("pr1")


def test_catch_up_batches_are_computed_as_they_come_so_the_final_extend_is_small(ref_engine, greedy):
    p = ids(32, 150)
    want = greedy(p, 100)
    ref_engine.llm.reset_prefix_cache()          # greedy() cached this very sequence: start cold
    ref_engine.submit(EngineRequest("cu1", p, SamplingParams(max_tokens=100, ignore_eos=True),
                                    output_ids=[want[0]], hold=True))
    ref_engine.extend("cu1", want[1:41], final=False)          # 191 tokens known
    assert [(e.extended_upto, e.token_id) for e in drain(ref_engine, {"cu1"})["cu1"]] == [(41, None)]
    ref_engine.extend("cu1", want[41:81], final=False)         # 231 known: 7 full blocks computed
    assert [(e.extended_upto, e.token_id) for e in drain(ref_engine, {"cu1"})["cu1"]] == [(81, None)]
    ref_engine.extend("cu1", want[81:84], final=True)          # the final batch: 234 tokens
    evs = drain(ref_engine, {"cu1"})["cu1"]
    rec = ref_engine.requests["cu1"]
    assert rec.num_prompt_tokens == 234 and rec.num_cached_tokens == 224
    # what the final pass computed: the last batch (3) and the partial block before it (7), not 234
    assert rec.num_prompt_tokens - rec.num_cached_tokens == 10
    assert [e.index for e in evs] == list(range(84, 100))
    assert [e.token_id for e in evs] == want[84:]
    ref_engine.forget("cu1")


def test_have_pins_keep_cached_blocks_until_their_request_ran(ref_engine):
    from pdd.vllm.prefix import VllmPrefixIndex

    index = VllmPrefixIndex(ref_engine.llm.engine_core.engine_core, 32)
    p = ids(33, 200)
    ref_engine.submit(EngineRequest("pin0", p, SamplingParams(max_tokens=2, ignore_eos=True)))
    drain(ref_engine, {"pin0"})
    ref_engine.forget("pin0")
    free0 = ref_engine.stats()["kv_free_blocks"]
    assert ref_engine.pins.pin_cached("pin1", p) == 6          # HAVE: the 6 full blocks
    s = ref_engine.stats()
    assert s["kv_pinned_blocks"] == 6 and s["kv_free_blocks"] == free0 - 6    # out of vLLM's free queue
    # Nothing may evict them meanwhile: vLLM refuses to reset a cache with blocks in use.
    assert ref_engine.llm.reset_prefix_cache() is False
    assert index.matched_tokens(p) == 192
    ref_engine.submit(EngineRequest("pin1", p + [5, 6], SamplingParams(max_tokens=2, ignore_eos=True)))
    drain(ref_engine, {"pin1"})
    assert ref_engine.requests["pin1"].num_cached_tokens == 192
    s = ref_engine.stats()
    assert s["kv_pinned_blocks"] == 0 and s["kv_free_blocks"] == free0      # let go once it ran
    ref_engine.forget("pin1")
    assert ref_engine.llm.reset_prefix_cache() is True
    assert index.matched_tokens(p) == 0


def test_a_fresh_thread_steps_with_the_engines_openmp_thread_count(ref_engine, greedy, monkeypatch):
    """EngineLoop steps vLLM on a thread of its own. OpenMP keeps its thread
    count per thread, and a thread made after OpenMP loaded starts at the
    machine's core count; vLLM's CPU attention plans its work by that count
    and checks it again in the kernel (it failed 'thread_num (2 vs. 1)'
    when the plan was made before torch lowered the count). Every plan on a
    fresh thread must be made at the engine's count."""
    import ctypes
    import threading

    import vllm._custom_ops as ops

    try:
        omp_threads = ctypes.CDLL(None).omp_get_max_threads
    except AttributeError:
        pytest.skip("OpenMP's omp_get_max_threads is not reachable in this process")
    real = ops.cpu_attn_get_scheduler_metadata
    planned: list[int] = []

    def spy(*a, **kw):
        planned.append(omp_threads())
        return real(*a, **kw)

    monkeypatch.setattr(ops, "cpu_attn_get_scheduler_metadata", spy)
    prompt, out, start = ids(21, 600), {}, {}

    def run():
        start["omp"] = omp_threads()
        ref_engine.submit(EngineRequest("th1", prompt, SamplingParams(max_tokens=4, ignore_eos=True)))
        out.update(drain(ref_engine, {"th1"}))

    t = threading.Thread(target=run)
    t.start()
    t.join(timeout=120)
    ref_engine.forget("th1")
    if start["omp"] == ref_engine.cfg.num_threads:
        pytest.skip("a fresh thread already starts at the engine's count here (one core, or OMP_NUM_THREADS "
                    "set before OpenMP loaded): nothing to show")
    assert planned and set(planned) == {ref_engine.cfg.num_threads}
    assert [e.token_id for e in out["th1"]] == greedy(prompt, 4)
