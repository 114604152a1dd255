import pytest

from pdd.policy import Role
from pdd.sim.cost_model import CostModel
from pdd.sim.hardware import get_profile
from pdd.sim.instance import Job, JobKind, Seq, SimInstance
from pdd.sim.model_shape import get_model
from pdd.sim.request import RequestSpec, SimRequest
from pdd.sim.workload import AgenticStream, AgenticWorkload

COST = CostModel(get_model("llama3-8b"), get_profile("gpu_a"))


def inst(budget=1000, macro=16, role=Role.PREFILL):
    return SimInstance("i0", role, "a", COST, max_batch=8, token_budget=budget, block_size=16,
                       kv_blocks=10_000, cache=True, max_macro_steps=macro)


def req(rid, prompt=100, out=20):
    return SimRequest(RequestSpec(rid, 0.0, prompt, out, out, ()))


def test_chunked_prefill_leaves_tail_chunks():
    i = inst(budget=1000)
    for rid in ("a", "b"):
        i.add_job(Job(req(rid, 1500), JobKind.PREFILL, 1500, 0, 94))
    plans, now = [], 0.0
    while (t := i.start_step(now)) is not None:
        plans.append(i.current_chunks)
        i.end_step(t)
        now = t
        if len(plans) > 5:
            break
    assert plans == [(("a", 1000),), (("a", 500), ("b", 500)), (("b", 1000),)]
    assert i.used_blocks == 188      # P keeps KV until the cluster releases it


def decode_times(macro, interrupt_at=None):
    i = inst(macro=macro, role=Role.MAIN)
    reqs = [req("a", out=20), req("b", out=12)]
    for r in reqs:
        r.num_generated = 1
        i.add_seq(Seq(r, 101, 8, relay=False))
    now = 0.0
    while (t := i.start_step(now)) is not None:
        if interrupt_at is not None and now < interrupt_at < t:
            t = i.interrupt(interrupt_at) or t
        for seq, times in i.end_step(t).tokens:      # the cluster's part: the user's tokens
            seq.req.emit(times, seq.relay)
        now = t
    return [r.times for r in reqs], i


def test_macro_steps_equal_single_steps():
    single, _ = decode_times(macro=1)
    macro, i = decode_times(macro=16)
    assert macro == single
    assert i.used_blocks == 0 and not i.decoding


def test_interrupt_truncates_at_the_next_boundary():
    single, _ = decode_times(macro=1)
    cut, _ = decode_times(macro=16, interrupt_at=single[0][3] + 1e-6)
    assert cut == single


def test_agentic_stream_is_deterministic_and_shares_prefixes():
    w = AgenticWorkload(duration_s=200.0, session_rate_per_s=0.5, abnormal_fraction=0.2)
    a, b = AgenticStream(w).initial(), AgenticStream(w).initial()
    assert a == b and len(a) > 50
    s = AgenticStream(w)
    first = next(x for x in s.initial() if x.output_tokens > w.abnormal_output_max)
    nxt = s.next_after(first, first.arrival_s + 10.0, failed=False)
    if nxt is not None:          # the session may have ended after one turn
        assert nxt.block_ids[: len(first.block_ids)] == first.block_ids
        assert nxt.prompt_tokens > first.prompt_tokens + first.output_tokens


def test_system_prompt_blocks_are_shared_across_sessions():
    w = AgenticWorkload(duration_s=100.0, session_rate_per_s=0.5)
    specs = AgenticStream(w).initial()
    shared = w.system_prompt_tokens // w.block_size
    assert len({x.block_ids[:shared] for x in specs}) == 1
    assert len({x.block_ids[shared] for x in specs}) == len(specs)


@pytest.mark.parametrize("stride", [1, 3])
def test_emit_records_every_stride_token_and_the_last(stride):
    r = req("a", out=10)
    r.stride = stride
    r.emit([0.0], relay=True)
    r.emit([float(k) for k in range(1, 10)], relay=False)
    rec = r.record()
    assert rec.token_indices[-1] == 9 and rec.token_times_s[-1] == 9.0
    assert rec.tpot_s == pytest.approx(1.0)
    assert rec.rld_tokens == 1 and rec.handoff_gap_s == pytest.approx(1.0)


def test_cached_prefix_blocks_are_shared_not_counted_twice():
    """A follow-up whose 60-block prefix P holds needs only its new blocks:
    while the first request still holds its 64 (P keeps KV until the transfer
    ends), the second starts on a 100-block instance, and the prefix stays
    cached (pinned) throughout instead of being evicted to make room."""
    i = SimInstance("p", Role.PREFILL, "a", COST, max_batch=8, token_budget=4096, block_size=16,
                    kv_blocks=100, cache=True)
    first = SimRequest(RequestSpec("a", 0.0, 1024, 8, 8, tuple(range(64))))
    i.add_job(Job(first, JobKind.PREFILL, 1024, 0, 64))
    t = i.start_step(0.0)
    done = i.end_step(t).jobs_done[0]
    assert (done.num_blocks, len(done.shared)) == (0, 64)      # all its blocks live in the cache
    assert i.free_blocks == 36
    follow = SimRequest(RequestSpec("b", 1.0, 1100, 8, 8, tuple(range(60)) + (900, 901, 902, 903)))
    i.add_job(Job(follow, JobKind.PREFILL, 1100, 0, 69))
    t = i.start_step(t)
    assert t is not None and i.current_chunks == (("b", 140),)   # 960 tokens were cached
    job = i.end_step(t).jobs_done[0]
    assert i.cache.match(follow.spec.block_ids) == 64
    i.unshare(done.shared)                                       # the first one's transfer ended
    i.release(job.num_blocks)
    i.unshare(job.shared)
    assert i.used_blocks == 0 and i.cache.num_pinned == 0 and i.free_blocks == 100


def test_row_factors_scale_steps_by_their_rows():
    """A calibrated engine's kernels by rows per step: a step of n tokens
    takes row_factors[row_bucket(n) - 1] x the model, decode-only or with a
    chunk; rows past the table keep the model's time."""
    from pdd.sim.cost_model import row_bucket

    def step_s(factors, batch, chunk=0):
        i = SimInstance("i0", Role.MAIN, "a", COST, max_batch=8, token_budget=1000, block_size=16,
                        kv_blocks=10_000, cache=False, max_macro_steps=1, row_factors=factors)
        for k in range(batch):
            r = req(f"s{k}", out=20)
            r.num_generated = 1
            i.add_seq(Seq(r, 101, 8, relay=False))
        if chunk:
            i.add_job(Job(req("p", chunk), JobKind.PREFILL, chunk, 0, chunk // 16 + 1))
        return i.start_step(0.0)
    assert [row_bucket(n) for n in (1, 16, 17, 32, 33, 64, 65, 512, 513)] == [1, 16, 17, 17, 18, 18, 19, 21, 22]
    table = (1.0, 0.5) + (1.0,) * 15 + (1.25,)         # 2 rows: 0.5; 33-64 rows: 1.25
    for b in (1, 2, 3):
        assert step_s(table, b) == pytest.approx(step_s((), b) * (0.5 if b == 2 else 1.0))
    assert step_s(table, 2, chunk=40) == pytest.approx(step_s((), 2, chunk=40) * 1.25)
    assert step_s(table, 2, chunk=200) == pytest.approx(step_s((), 2, chunk=200))


def test_a_fresh_sequence_recomputes_its_partial_block_in_its_first_step():
    """Only whole blocks cross: a decoder's first step for a transferred
    request computes the prompt's partial last block and P's first token (a
    small chunk), later steps one token; the step's rows count the chunk."""
    def steps(first):
        i = SimInstance("i0", Role.MAIN, "a", COST, max_batch=8, token_budget=1000, block_size=16,
                        kv_blocks=10_000, cache=False, max_macro_steps=1, row_factors=(0.5, 0.5))
        seqs = []
        for k, f in enumerate((1, first)):
            r = req(f"s{k}", prompt=1000, out=4)
            r.num_generated = 1
            seqs.append(Seq(r, 1001, 70, relay=False))
            seqs[-1].first = f
            i.add_seq(seqs[-1])
        out, now = [], 0.0
        while (t := i.start_step(now)) is not None:
            out.append(t - now)
            i.end_step(t)
            now = t
        return out, seqs
    plain, _ = steps(1)
    fresh, seqs = steps(9)
    assert fresh[1:] == pytest.approx(plain[1:]) and all(s.first == 1 for s in seqs)
    # 8 more tokens in the first step (10 rows: no factor) against 2 rows at 0.5
    assert fresh[0] > 2 * plain[0]


def test_p_reports_its_prefill_rate_as_the_engine_does_tokens_over_time():
    """A 1,500-token prompt in chunks of 1,000 and 500: the rate P reports is
    1,500 tokens over the two steps' time (the engine's
    stats' `prefill_tokens_s`), not the mean of the two steps' rates."""
    i = inst(budget=1000)
    i.add_job(Job(req("a", 1500), JobKind.PREFILL, 1500, 0, 94))
    now, walls = 0.0, []
    while (t := i.start_step(now)) is not None:
        i.end_step(t)
        walls.append(t - now)
        now = t
    assert len(walls) == 2
    assert i.prefill.tokens_s == pytest.approx(1500 / sum(walls))
    assert i.prefill.tokens_s != pytest.approx((1000 / walls[0] + 500 / walls[1]) / 2, rel=1e-3)
    # ... and its step and token costs as the router fits them from the engine's steps
    from pdd.policy.views import fit_prefill_cost, prefill_attention
    attn = [prefill_attention(0, 1000), prefill_attention(1000, 500)]
    assert i.prefill.cost == pytest.approx(fit_prefill_cost([(1000, walls[0], attn[0]), (500, walls[1], attn[1])]))
    v = i.view()
    assert (v.prefill_step_s, v.prefill_token_s, v.prefill_attn_s) == pytest.approx(i.prefill.cost)
    assert i.prefill_time_s(1500) == pytest.approx(2 * v.prefill_step_s + 1500 * v.prefill_token_s
                                                   + v.prefill_attn_s * prefill_attention(0, 1500))


def test_a_decoder_step_that_decodes_nothing_takes_the_lone_chunk_factor():
    """A fresh sequence's first step alone (its partial block as a chunk, no
    decode beside it) or an extend alone runs `lone_chunk_factor` x its row
    class's time on a decoder; beside a sequence already decoding, or on P,
    it does not (the calibration measures those at the fit)."""
    def first_step(role, factor, with_decode=False, extend=False):
        i = SimInstance("i0", role, "a", COST, max_batch=8, token_budget=1000, block_size=16,
                        kv_blocks=10_000, cache=False, max_macro_steps=1, lone_chunk_factor=factor)
        if extend:
            i.add_job(Job(req("x", 40), JobKind.PREFILL, 40, 0, 3))
        else:
            r = req("fresh", prompt=1000, out=4)
            r.num_generated = 1
            s = Seq(r, 1001, 70, relay=False)
            s.first = 9
            i.add_seq(s)
        if with_decode:
            r = req("old", prompt=1000, out=8)
            r.num_generated = 1
            i.add_seq(Seq(r, 1001, 70, relay=False))
        return i.start_step(0.0)
    for role in (Role.MAIN, Role.RELAY, Role.DECODE):
        assert first_step(role, 1.5) == pytest.approx(1.5 * first_step(role, 1.0))
        assert first_step(role, 1.5, extend=True) == pytest.approx(1.5 * first_step(role, 1.0, extend=True))
        assert first_step(role, 1.5, with_decode=True) == pytest.approx(first_step(role, 1.0, with_decode=True))
    assert first_step(Role.PREFILL, 1.5, extend=True) == pytest.approx(first_step(Role.PREFILL, 1.0, extend=True))
