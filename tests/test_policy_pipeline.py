import math

import pytest

from pdd.policy import (
    ClusterView, InstanceView, LinkEstimate, NoRouteError, Pipeline, PolicyConfig, RequestFacts,
    Role, choose_pipeline, copy_yields_line,
)

CFG = PolicyConfig()
KVB = 50_000      # bytes per token
WAN = LinkEstimate(throughput_bytes_s=1.25e9, rtt_s=0.05)   # 10 Gbps


def inst(iid, role, running=0, free=100_000, step=None):
    return InstanceView(iid, role, "dc", running, 0, 64, free, 100_000, step)


def cluster(md_matched=0, wan=WAN, rlds=("r0",), p_matched=0, rld_running=0, mds=("m0",)):
    insts = [inst("p0", Role.PREFILL), inst("p1", Role.PREFILL)]
    insts += [inst(r, Role.RELAY, running=rld_running) for r in rlds]
    insts += [inst(m, Role.MAIN) for m in mds]
    matched = {"p1": p_matched}
    matched.update({m: md_matched for m in mds})
    return ClusterView(tuple(insts), matched, wan, 10.0)


def req(prompt=64_000, max_tokens=1000):
    return RequestFacts("r1", prompt, max_tokens, KVB, 16)


def test_high_hit_goes_direct():
    d = choose_pipeline(req(), cluster(md_matched=63_984), CFG)
    assert d.pipeline is Pipeline.DIRECT and d.start_wan and d.rld_id is None
    assert d.md_id == "m0"
    assert d.missing_bytes == 16 * KVB
    assert d.est_wan_s == pytest.approx(0.05 + 16 * KVB / 1.25e9)


def test_low_hit_goes_relay():
    d = choose_pipeline(req(), cluster(md_matched=0), CFG)
    assert d.pipeline is Pipeline.RELAY and d.rld_id == "r0" and d.start_wan
    assert d.missing_bytes == 64_000 * KVB
    assert d.est_wan_s > CFG.direct_max_wan_s


def test_a_one_token_answer_is_p_s_alone():
    """P's first token is the whole answer: no decoder opens and no KV moves,
    whatever the line (the PD baselines' router does the same), so a cold,
    filter-class request neither relays nor spends RLD's budgets."""
    from pdd.policy import RequestLifecycle
    from pdd.policy.lifecycle_io import OpenDecode, StartPrefill
    down = LinkEstimate(1.25e9, 0.05, up=False)
    for view in (cluster(md_matched=0), cluster(md_matched=63_984), cluster(wan=down, rlds=())):
        d = choose_pipeline(req(max_tokens=1), view, CFG)
        assert d.pipeline is Pipeline.DIRECT and not d.start_wan
        assert d.rld_id is None and d.md_id is None and d.missing_bytes == 0
        cmds = RequestLifecycle(req(max_tokens=1), d, CFG).start(0.0)
        assert not [c for c in cmds if isinstance(c, OpenDecode)]
        assert [c for c in cmds if isinstance(c, StartPrefill)][0].targets == ()
    # two tokens need a decoder again (here RLD: the filter's class)
    two = choose_pipeline(req(max_tokens=2), cluster(md_matched=0), CFG)
    assert two.pipeline is Pipeline.RELAY_ONLY and two.rld_id == "r0"


def test_missing_bytes_count_the_full_blocks_that_travel():
    d = choose_pipeline(req(prompt=100), cluster(md_matched=40), CFG)
    # 6 full prompt blocks (the partial 7th is computed by the receiver),
    # 2 whole blocks held -> 4 blocks travel
    assert d.missing_bytes == 4 * 16 * KVB


def test_slow_wan_turns_high_hit_into_relay():
    slow = LinkEstimate(throughput_bytes_s=1e8, rtt_s=0.05)   # 200 MB -> 2 s
    d = choose_pipeline(req(), cluster(md_matched=60_000, wan=slow), CFG)
    assert d.pipeline is Pipeline.RELAY


def test_relay_needs_a_real_head_start_over_the_local_link():
    # A CPU-like deployment: a 2K-token follow-up lacks 6 blocks on MD (~0.9 s
    # over a slow, overhead-laden WAN), while the whole prompt would reach an
    # RLD that holds none of it in ~0.75 s (the receiver's step wait dominates both).
    wan = LinkEstimate(throughput_bytes_s=20e6, rtt_s=0.05, overhead_s=0.6)
    local = LinkEstimate(throughput_bytes_s=400e6, rtt_s=2e-4, overhead_s=0.5)
    r = RequestFacts("r1", 2048, 256, 46_080, 16)
    base = cluster(md_matched=2048 - 6 * 16, wan=wan)
    view = ClusterView(base.instances, base.matched_tokens, wan, 10.0, local=local)
    d = choose_pipeline(r, view, CFG)
    assert d.est_wan_s > CFG.direct_max_wan_s          # the old rule alone would relay
    assert d.pipeline is Pipeline.DIRECT and d.reason.startswith("relay gains")
    # A cold prompt of the same size still relays: 94 MB take ~5 s over that WAN.
    cold = ClusterView(base.instances, {}, wan, 10.0, local=local)
    assert choose_pipeline(r, cold, CFG).pipeline is Pipeline.RELAY
    # Without a local estimate the rule is off.
    assert choose_pipeline(r, base, CFG).pipeline is Pipeline.RELAY
    # An RLD that holds the prefix too needs only the same 6 blocks, locally: relay.
    warm_rld = ClusterView(base.instances, dict(base.matched_tokens) | {"r0": 2048 - 6 * 16}, wan,
                           10.0, local=local)
    assert choose_pipeline(r, warm_rld, CFG).pipeline is Pipeline.RELAY


def test_a_relay_carries_rlds_expected_wait_over_the_local_link():
    """The decision says when RLD should hold the prompt KV after P's first
    token (what RLD lacks over the measured local link); unknown without a
    local estimate or an RLD."""
    wan = LinkEstimate(throughput_bytes_s=20e6, rtt_s=0.05)
    local = LinkEstimate(throughput_bytes_s=400e6, rtt_s=2e-4)
    r = RequestFacts("r1", 2048, 256, 46_080, 16)
    base = cluster(wan=wan)
    view = ClusterView(base.instances, {}, wan, 10.0, local=local)
    d = choose_pipeline(r, view, CFG)
    assert d.pipeline is Pipeline.RELAY
    assert d.rld_wait_s == pytest.approx(local.transfer_s(r.missing_kv_bytes(0)))
    # RLD holding most of the prefix lacks only the rest
    warm = ClusterView(base.instances, {"r0": 2048 - 6 * 16}, wan, 10.0, local=local)
    assert choose_pipeline(r, warm, CFG).rld_wait_s == pytest.approx(local.transfer_s(6 * 16 * 46_080))
    assert choose_pipeline(r, base, CFG).rld_wait_s == math.inf                  # no local estimate
    assert choose_pipeline(r, ClusterView(cluster(wan=wan, rlds=()).instances, {}, wan, 10.0, local=local),
                           CFG).rld_wait_s == math.inf                           # no RLD: direct


def test_without_drc_md_cache_is_ignored():
    d = choose_pipeline(req(), cluster(md_matched=63_984), PolicyConfig(enable_drc=False))
    assert d.pipeline is Pipeline.RELAY and d.missing_bytes == 64_000 * KVB


def test_no_relay_instance_falls_back_to_direct():
    d = choose_pipeline(req(), cluster(rlds=()), CFG)
    assert d.pipeline is Pipeline.DIRECT and "no relay" in d.reason


def test_saturated_relay_pool_falls_back_to_direct():
    d = choose_pipeline(req(), cluster(rld_running=64), CFG)
    assert d.pipeline is Pipeline.DIRECT and "full" in d.reason


def test_relay_picked_by_load():
    c = cluster(rlds=("r0", "r1"))
    insts = tuple(inst(i.instance_id, i.role, running=5) if i.instance_id == "r0" else i
                  for i in c.instances)
    c2 = ClusterView(insts, c.matched_tokens, c.wan, c.now)
    assert choose_pipeline(req(), c2, CFG).rld_id == "r1"


def test_wan_down_gives_relay_only():
    down = LinkEstimate(1.25e9, 0.05, up=False)
    d = choose_pipeline(req(), cluster(wan=down), CFG)
    assert d.pipeline is Pipeline.RELAY_ONLY and d.reason == "wan down"
    assert not d.start_wan and d.md_id is None and math.isinf(d.est_wan_s)
    d2 = choose_pipeline(req(), cluster(), PolicyConfig(md_reachable=False))
    assert d2.pipeline is Pipeline.RELAY_ONLY and d2.reason == "wan down"


def test_wan_down_without_relay_is_no_route():
    with pytest.raises(NoRouteError):
        choose_pipeline(req(), cluster(wan=LinkEstimate(1, 1, up=False), rlds=()), CFG)


def test_abnormal_request_stays_on_relay():
    d = choose_pipeline(req(max_tokens=8), cluster(md_matched=0), CFG)
    assert d.pipeline is Pipeline.RELAY_ONLY and not d.start_wan
    assert d.rld_id == "r0" and d.reason.startswith("abnormal")
    assert d.filterable and d.relay_only_by_choice
    off = choose_pipeline(req(max_tokens=8), cluster(), PolicyConfig(enable_filter=False))
    assert off.pipeline is Pipeline.RELAY and not off.filterable
    # A full relay pool is a reason to go direct, never to queue on RLD.
    full = choose_pipeline(req(max_tokens=8), cluster(rlds=("r0", "r1"), rld_running=64), CFG)
    assert full.pipeline is Pipeline.DIRECT and full.start_wan and full.reason == "relay pool full"


def test_filter_keeps_to_the_abnormal_class():
    # Same transfer, an answer RLD would also finish first, but the input is
    # not 100x the output: an ordinary long-context turn is relayed, not filtered.
    d = choose_pipeline(req(max_tokens=1000), cluster(md_matched=0, wan=LinkEstimate(1e6, 0.05)), CFG)
    assert d.pipeline is Pipeline.RELAY and not d.filterable


def test_a_continuation_is_never_filtered():
    # P holds 60K of the 64K prompt (a later turn of a conversation) and MD
    # lacks it: the KV must cross so MD's cache learns what P knows.
    d = choose_pipeline(req(max_tokens=8), cluster(p_matched=60_000, md_matched=0), CFG)
    assert d.pipeline is Pipeline.RELAY and d.start_wan and not d.filterable
    # A fresh document with only a short shared prefix on P is of the class.
    d2 = choose_pipeline(req(max_tokens=8), cluster(p_matched=4_000, md_matched=0), CFG)
    assert d2.pipeline is Pipeline.RELAY_ONLY


def test_relay_only_budget_bounds_the_filter():
    from pdd.policy import RelayBudgets, note_decision

    cfg = PolicyConfig(relay_only_max_share=0.1, relay_only_window=50, relay_max_token_share=1.0)
    budgets = RelayBudgets(cfg)
    kinds = []
    for _ in range(40):
        d = choose_pipeline(req(max_tokens=8), cluster(md_matched=0), cfg, budgets)
        note_decision(budgets, d, req(max_tokens=8))
        kinds.append(d.pipeline)
    # At most one in ten, from the very start (the window counts as >= 10 long).
    assert kinds.count(Pipeline.RELAY_ONLY) == 4
    assert kinds[0] is Pipeline.RELAY_ONLY and kinds[1] is Pipeline.RELAY
    assert all(k in (Pipeline.RELAY_ONLY, Pipeline.RELAY) for k in kinds)


def test_cancel_wan_only_within_class_and_budget():
    from pdd.policy import RelayBudgets, cancel_wan, keep_wan_copy

    rld = inst("r0", Role.RELAY, step=0.05)
    slow = cluster(md_matched=0, wan=LinkEstimate(1e8, 0.05))    # 3.2 GB -> 32 s
    spent = RelayBudgets(PolicyConfig(relay_only_max_share=0.0))
    turn = choose_pipeline(req(max_tokens=200), slow, CFG, spent)
    assert turn.pipeline is Pipeline.RELAY and turn.filterable
    # 10 tokens left * 50 ms * 1.25 < 32 s - 1 s: cancel, while the budget has room.
    assert cancel_wan(turn, None, 1.0, 1.0, 10, rld, CFG)
    assert not cancel_wan(turn, spent, 1.0, 1.0, 10, rld, CFG)
    # The copy has nearly landed: keep it.
    assert not cancel_wan(turn, None, 31.9, 31.9, 10, rld, CFG)
    # A continuation (not of the class) is never cancelled and keeps its copy
    # landing when RLD ends first.
    cont = choose_pipeline(req(max_tokens=200), cluster(p_matched=60_000, wan=LinkEstimate(1e8, 0.05)), CFG)
    assert not cancel_wan(cont, None, 1.0, 1.0, 10, rld, CFG)
    assert keep_wan_copy(cont) and not keep_wan_copy(turn)


def test_prefill_routing_uses_p_cache():
    d = choose_pipeline(req(), cluster(p_matched=60_000), CFG)
    assert d.p_id == "p1"


def test_in_dc_pd_uses_decode_role():
    insts = (inst("p0", Role.PREFILL), inst("d0", Role.DECODE))
    d = choose_pipeline(req(), ClusterView(insts, {}, LinkEstimate(25e9, 1e-4), 0.0), CFG)
    assert d.pipeline is Pipeline.DIRECT and d.md_id == "d0"


def test_no_prefill_is_no_route():
    with pytest.raises(NoRouteError):
        choose_pipeline(req(), ClusterView((inst("m0", Role.MAIN),), {}, WAN, 0.0), CFG)


def test_plan_warm_counts_every_shared_prefix_and_warms_only_filtered_requests():
    from pdd.policy import PipelineDecision, PrefixReuseCounter, plan_warm

    counter, key = PrefixReuseCounter(), (lambda n: ("prefix", n))
    filtered = PipelineDecision(Pipeline.RELAY_ONLY, "p0", "r0", "m0", False, 0, 5.0, "abnormal")
    direct = PipelineDecision(Pipeline.DIRECT, "p0", None, "m0", True, 0, 0.1, "wan")
    matched = {"p0": 520, "m0": 0}
    assert plan_warm(direct, matched, key, counter, 16, CFG) == (0, 0)      # counted, not warmed
    assert plan_warm(filtered, matched, key, counter, 16, CFG) == (0, 1)    # one earlier reuse
    assert plan_warm(filtered, matched, key, counter, 16, CFG) == (512, 2)  # hot: 32 whole blocks
    assert plan_warm(filtered, matched | {"m0": 512}, key, counter, 16, CFG) == (0, 3)  # MD has it
    assert plan_warm(filtered, {"p0": 10}, key, counter, 16, CFG) == (0, 0)  # no whole block shared


def test_relay_token_budget_sends_low_hit_requests_direct_past_rlds_share():
    from pdd.policy import RelayBudgets, note_decision

    cfg = PolicyConfig(relay_max_token_share=0.2, relay_only_window=20)
    budgets = RelayBudgets(cfg)
    slow = cluster(md_matched=0, wan=LinkEstimate(1e9, 0.05))        # 3.2 GB -> 3.2 s: 64 eager tokens
    warm = cluster(md_matched=63_984)
    seq = []
    for k in range(30):
        c = slow if k % 3 == 0 else warm                              # a third low-hit, 1000-token answers
        d = choose_pipeline(req(), c, cfg, budgets)
        note_decision(budgets, d, req())
        seq.append(d)
    relays = [d for d in seq if d.pipeline is Pipeline.RELAY]
    assert relays and all(d.rld_tokens == 65 for d in relays)       # ceil(3.25 s / 50 ms)
    # 10 low-hit requests of 65 eager tokens in 30,000 output tokens is 2%: all relayed.
    assert len(relays) == 10
    # Short answers that end on RLD: the first is the start-up loan of one
    # request, the second goes direct.
    tight_cfg = PolicyConfig(relay_max_token_share=0.05, relay_only_window=40, relay_startup_loan=1.0)
    tight, short = RelayBudgets(tight_cfg), req(max_tokens=64)
    first = choose_pipeline(short, slow, tight_cfg, tight)
    note_decision(tight, first, short)
    second = choose_pipeline(short, slow, tight_cfg, tight)
    assert first.pipeline is Pipeline.RELAY and first.rld_tokens == 64
    assert second.pipeline is Pipeline.DIRECT and second.reason.startswith("relay budget")


def test_the_prefill_hides_a_streamed_transfer_but_not_its_last_chunk():
    from dataclasses import replace

    from pdd.policy.pipeline import wait_after_prefill
    p = replace(inst("p0", Role.PREFILL), prefill_tokens_s=1000.0, chunk_tokens=512)
    # 4,096 new tokens compute for 4.1 s: a 6 s transfer is left 1.9 s after it
    assert wait_after_prefill(6.0, 4096, p) == pytest.approx(6.0 - 4.096)
    # ... but never less than its last chunk's share of the bytes
    assert wait_after_prefill(3.0, 4096, p) == pytest.approx(3.0 * 512 / 4096)
    # one chunk (a warm turn): nothing streams ahead of the end
    assert wait_after_prefill(0.4, 300, p) == 0.4
    # P's rate unknown: the whole estimate
    assert wait_after_prefill(6.0, 4096, inst("p0", Role.PREFILL)) == 6.0


def test_a_cold_prompt_computes_by_ps_step_and_token_costs_not_its_mean_rate():
    """P's recent steps are warm turns' 52-token steps (0.15 s: mostly fixed
    cost) and one cold prompt's 512-token chunk (0.43 s). Their mean rate
    (~480 tok/s) would have a 1,471-token cold prompt compute for ~3 s and
    hide all but ~0.4 s of a 3.4 s transfer behind it (a direct request, its
    first token from P, then a 3.4 s stall: `results/heldout-agentic-15`,
    a0000, whose prefill took 1.27 s); the fitted costs say ~1.25 s."""
    from dataclasses import replace

    from pdd.policy.pipeline import wait_after_prefill
    from pdd.policy.views import fit_prefill_cost
    steps = [(52, 0.15)] * 15 + [(512, 0.43)]
    a, b, c = fit_prefill_cost(steps)
    assert c == 0.0                              # steps without their attention: none fitted
    assert b == pytest.approx(0.28 / 460) and a == pytest.approx(0.15 - 52 * 0.28 / 460)
    rate = sum(n for n, _ in steps) / sum(w for _, w in steps)
    p = replace(inst("p0", Role.PREFILL), prefill_tokens_s=rate, chunk_tokens=512, kv_layer_slices=6)
    assert wait_after_prefill(3.41, 1471, p) == pytest.approx(3.41 - 1471 / rate)
    fitted = replace(p, prefill_step_s=a, prefill_token_s=b)
    assert fitted.prefill_compute_s(1471) == pytest.approx(3 * a + 1471 * b) == pytest.approx(1.25, abs=0.01)
    assert wait_after_prefill(3.41, 1471, fitted) == pytest.approx(3.41 - (3 * a + 1471 * b))
    assert wait_after_prefill(3.41, 1471, p) < CFG.direct_max_wan_s < wait_after_prefill(3.41, 1471, fitted)


def test_a_cold_prompt_at_the_start_of_its_context_is_priced_by_its_attention_too():
    """`results/wan-bound-62x`, a0003: P's last 16 prefill steps were warm
    turns' 31-82 tokens over 2,300-2,900-token contexts (mostly attention).
    Fitted on tokens alone they priced a cold prompt's 1,740 new tokens
    (past 256 cached) at 5.3 s, so a 6.3 s copy looked hidden but for
    0.96 s: the request went direct and its user waited 6.6 s (the prefill
    took 2.6 s). Steps here follow that P's measured costs (0.084 s a step,
    0.2 ms a token, 1.0 us a token per token of context; +-5% noise): fitted
    with each step's attention over the last `PREFILL_FIT_STEPS` (cold
    chunks among them), the same prompt is priced near its true cost."""
    import random
    from dataclasses import replace

    from pdd.policy.pipeline import wait_after_prefill
    from pdd.policy.views import PREFILL_FIT_STEPS, fit_prefill_cost, prefill_attention

    def cost(n, start):
        return 0.084 + 2e-4 * n + 1.0e-6 * prefill_attention(start, n)
    rng = random.Random(7)
    steps = []           # (new tokens, context before them): cold prompts' chunks, then warm turns
    for _ in range(4):
        steps += [(512, 256), (512, 768), (512, 1280), (204, 1792)]
    steps += [(rng.randint(30, 85), rng.randint(2300, 2900)) for _ in range(PREFILL_FIT_STEPS - len(steps))]
    measured = [(n, cost(n, c) * rng.uniform(0.95, 1.05), prefill_attention(c, n)) for n, c in steps]
    true_s = sum(cost(n, c) for n, c in [(512, 256), (512, 768), (512, 1280), (204, 1792)])
    tokens_only = fit_prefill_cost([(n, w) for n, w, _ in measured[-16:]])
    with_attn = fit_prefill_cost(measured)
    assert with_attn[2] > 0 and all(x >= 0 for x in with_attn)
    p = replace(inst("p0", Role.PREFILL), chunk_tokens=512, kv_layer_slices=30, prefill_largest_step=512)
    old = replace(p, prefill_step_s=tokens_only[0], prefill_token_s=tokens_only[1])
    new = replace(p, prefill_step_s=with_attn[0], prefill_token_s=with_attn[1], prefill_attn_s=with_attn[2])
    assert old.prefill_compute_s(1740, 256) > 1.7 * true_s
    assert new.prefill_compute_s(1740, 256) == pytest.approx(true_s, rel=0.1)
    # the same tokens at the end of a long context cost more
    assert new.prefill_compute_s(1740, 4000) > 1.5 * new.prefill_compute_s(1740, 256)
    # a 6.3 s copy is no longer judged hidden behind the prefill
    assert wait_after_prefill(6.28, 1740, old, 256) < 2.0 < 3.0 < wait_after_prefill(6.28, 1740, new, 256)


def test_the_prefill_fit_keeps_every_cost_non_negative():
    """Noise must not fit a negative term (a longer prompt priced cheaper);
    steps of one size fit nothing; bigger steps that were not slower neither."""
    from pdd.policy.views import fit_prefill_cost, prefill_attention
    pts = [(50, 0.20, prefill_attention(2000, 50)), (60, 0.19, prefill_attention(2100, 60)),
           (512, 0.60, prefill_attention(0, 512)), (512, 0.95, prefill_attention(1024, 512))]
    fit = fit_prefill_cost(pts)
    assert fit is not None and all(x >= 0 for x in fit)
    assert fit_prefill_cost([(50, 0.2, 1.0), (50, 0.3, 2.0)]) is None
    assert fit_prefill_cost([(50, 0.3), (500, 0.2)]) is None
    assert fit_prefill_cost([(100, 0.1), (200, 0.2)]) == pytest.approx((0.0, 1e-3, 0.0))


def test_a_fit_on_a_warm_ups_few_tokens_is_not_stretched_to_a_cold_prompt():
    """`heldout-agentic-26s1`: P had run only the bench's first steps (32 and
    59 tokens, mostly fixed cost) when a cold 1,179-token prompt came; the
    fit had it compute for 3.7 s (it took 0.8), a 4.1 s copy looked hidden
    (0.35 s left), the request went direct and its user waited 4.0 s. Steps
    that small say nothing of 512-token chunks: the whole estimate counts."""
    from dataclasses import replace

    from pdd.policy.pipeline import wait_after_prefill
    from pdd.policy.views import PREFILL_FIT_REACH, fit_prefill_cost
    steps = [(32, 0.117), (59, 0.190)]
    a, b, _ = fit_prefill_cost(steps)
    p = replace(inst("p0", Role.PREFILL), chunk_tokens=512, kv_layer_slices=6, prefill_step_s=a,
                prefill_token_s=b, prefill_tokens_s=91 / 0.307)
    assert p.prefill_compute_s(1179) > 3.0                      # the stretched fit (not known how far)
    early = replace(p, prefill_largest_step=59)
    assert early.prefill_compute_s(1179) is None
    assert wait_after_prefill(4.07, 1179, early) == 4.07 > CFG.direct_max_wan_s
    # a warm turn's 60 new tokens are within the steps' reach: the fit stands
    assert early.prefill_compute_s(60) == pytest.approx(a + 60 * b)
    # once a step of a quarter chunk or more was measured, the fit stands for the cold prompt too
    later = replace(p, prefill_largest_step=512 // PREFILL_FIT_REACH)
    assert later.prefill_compute_s(1179) == pytest.approx(3 * a + 1179 * b)


def test_the_prefill_cost_fit_needs_two_step_sizes_and_a_positive_slope():
    from pdd.policy.views import fit_prefill_cost
    assert fit_prefill_cost([]) is None
    assert fit_prefill_cost([(512, 0.4)] * 5) is None                  # one size: the mean rate decides
    assert fit_prefill_cost([(100, 0.5), (500, 0.2)]) is None          # bigger steps faster: noise
    # a negative intercept is refitted through the origin (least squares)
    assert fit_prefill_cost([(100, 0.05), (200, 0.2)]) == pytest.approx((0.0, 45 / 50_000, 0.0))


def test_a_queued_line_delays_a_background_copy_behind_every_byte_ahead():
    q = LinkEstimate(throughput_bytes_s=1e6, rtt_s=0.0, queued_bytes=2e6, queued_background_bytes=5e6)
    assert q.transfer_s(1e6) == pytest.approx(3.0)                    # behind the foreground bytes
    assert q.transfer_s(1e6, background=True) == pytest.approx(8.0)   # and the other copies


def test_which_copies_yield_the_line():
    warm_turn = choose_pipeline(req(), cluster(md_matched=63_984), CFG)
    cold_turn = choose_pipeline(req(), cluster(md_matched=0), CFG)
    refused = choose_pipeline(req(), cluster(md_matched=0, rlds=()), CFG)   # no RLD: direct, slow
    assert refused.pipeline is Pipeline.DIRECT and refused.wait_s > CFG.direct_max_wan_s
    assert not copy_yields_line(warm_turn)       # a user waits on a few blocks: first
    assert copy_yields_line(cold_turn)           # RLD serves the user meanwhile
    assert copy_yields_line(refused)             # seconds anyway: shortest-first with the copies
    assert copy_yields_line(warm_turn, warm=True)


def test_layer_by_layer_streaming_hides_even_a_one_chunk_prompt():
    from dataclasses import replace

    from pdd.policy.pipeline import wait_after_prefill
    p = replace(inst("p0", Role.PREFILL), prefill_tokens_s=200.0, chunk_tokens=512, kv_layer_slices=30)
    # a warm turn's 48 new tokens compute for 0.24 s; a 0.3 s transfer is left 0.06 s after
    assert wait_after_prefill(0.3, 48, p) == pytest.approx(0.06)
    # ... never less than the last layer's slice of the last chunk
    assert wait_after_prefill(0.15, 48, p) == pytest.approx(0.15 / 30)
    assert wait_after_prefill(6.0, 4096, p) == pytest.approx(max(6.0 - 4096 / 200, 6.0 * 512 / 4096 / 30))


def test_a_background_copy_waits_only_for_the_copies_shorter_than_itself():
    # Copies go one at a time, fewest bytes left first: behind three cold
    # copies' 270 MB a 3 MB copy waits for at most 3 MB of each (none is
    # shorter; it goes first once it asks), not for all of them.
    q = LinkEstimate(throughput_bytes_s=12.5e6, rtt_s=0.0, queued_background_bytes=270e6,
                     queued_background_flows=3)
    assert q.transfer_s(3e6, background=True) == pytest.approx(12e6 / 12.5e6)
    # a copy longer than them all waits for them all
    assert q.transfer_s(200e6, background=True) == pytest.approx(470e6 / 12.5e6)
    # the count unknown: every byte ahead, as before
    assert LinkEstimate(throughput_bytes_s=12.5e6, rtt_s=0.0, queued_background_bytes=270e6).transfer_s(
        3e6, background=True) == pytest.approx(273e6 / 12.5e6)
    # a foreground transfer never waits for copies
    assert q.transfer_s(3e6) == pytest.approx(3e6 / 12.5e6)


def test_a_foreground_transfer_shares_the_line_with_those_in_flight():
    # A cold prompt's 100 MB copy streams in flight; a warm turn's 2 MB
    # crosses beside it at about half the line, not behind all of it.
    q = LinkEstimate(throughput_bytes_s=12.5e6, rtt_s=0.0, queued_bytes=100e6, queued_flows=1)
    assert q.transfer_s(2e6) == pytest.approx(4e6 / 12.5e6)
    # ... never slower than behind every queued byte (others end first)
    small = LinkEstimate(throughput_bytes_s=12.5e6, rtt_s=0.0, queued_bytes=0.5e6, queued_flows=3)
    assert small.transfer_s(2e6) == pytest.approx(2.5e6 / 12.5e6)
    # a background copy still waits behind them all
    assert q.transfer_s(2e6, background=True) == pytest.approx(102e6 / 12.5e6)
    # flows unknown: every queued byte ahead, as before
    assert LinkEstimate(throughput_bytes_s=12.5e6, rtt_s=0.0, queued_bytes=100e6).transfer_s(2e6) \
        == pytest.approx(102e6 / 12.5e6)
def test_a_few_blocks_go_first_on_a_line_crowded_by_a_cold_copy():
    # wan-bound's 100 Mbit/s line with a cold prompt's 100 MB copy in flight
    # (found in a run: a warm turn's 1.5 MB copy was routed as "slow", so it
    # yielded, and waited 4 s behind an 83 MB direct copy that did not).
    line = LinkEstimate(throughput_bytes_s=12.5e6, rtt_s=0.04, queued_bytes=100e6, queued_flows=1)
    r = RequestFacts("r1", 2_400, 40, 46_080, 16)
    few = ClusterView(cluster().instances, {"m0": 2_400 - 32}, line, 10.0)   # 2 blocks lacking
    warm = choose_pipeline(r, few, CFG)
    assert not warm.big_copy and not copy_yields_line(warm)
    # A whole prompt's copy is big however idle the line: it yields, so a
    # direct user of it waits as a copy's does (behind the bytes ahead).
    idle = LinkEstimate(throughput_bytes_s=12.5e6, rtt_s=0.04)
    cold = choose_pipeline(r, ClusterView(cluster(rlds=()).instances, {}, idle, 10.0), CFG)
    assert cold.pipeline is Pipeline.DIRECT and cold.big_copy and copy_yields_line(cold)
    crowded = choose_pipeline(r, ClusterView(cluster(rlds=()).instances, {}, line, 10.0), CFG)
    assert crowded.wait_s == pytest.approx(line.transfer_s(crowded.missing_bytes, background=True))
    # the boundary is the copy's own time on an idle line
    assert idle.bytes_s(cold.missing_bytes) > CFG.direct_max_wan_s >= idle.bytes_s(warm.missing_bytes)
    # ... its bytes alone: a receiver's fixed cost makes no copy big
    slow_rx = LinkEstimate(throughput_bytes_s=12.5e6, rtt_s=0.04, overhead_s=0.6)
    assert not choose_pipeline(r, ClusterView(cluster().instances, {"m0": 2_400 - 32}, slow_rx, 10.0),
                               CFG).big_copy
    # A PD baseline's decoder has no gate: nothing yields there, and its
    # user waits as for a plain flow.
    pd = choose_pipeline(r, pd_cluster(wan=idle), CFG)
    assert not pd.big_copy and not copy_yields_line(pd)
    assert pd.wait_s == pytest.approx(idle.transfer_s(pd.missing_bytes))


# -- the PD baselines: P and D by the same call (router `choose_pd`, simulator) --
def pd_cluster(p_load=(0, 0), d_load=(0, 0), matched=None, wan=WAN):
    """p0, p1 (PREFILL) and d0, d1 (DECODE); loads are running requests."""
    insts = [inst(f"p{i}", Role.PREFILL, running=n) for i, n in enumerate(p_load)]
    insts += [inst(f"d{i}", Role.DECODE, running=n) for i, n in enumerate(d_load)]
    return ClusterView(tuple(insts), matched or {}, wan, 10.0)


def test_pd_baseline_picks_p_by_cache_affinity_against_load():
    # p1 holds 4K tokens of the prompt and runs 4 requests (1K tokens of
    # penalty): the saved prefill wins over the idle p0.
    d = choose_pipeline(req(prompt=8_000), pd_cluster(p_load=(0, 4), matched={"p1": 4_096}), CFG)
    assert (d.pipeline, d.p_id, d.rld_id) == (Pipeline.DIRECT, "p1", None)
    # ... but not a 512-token prefix against the same load.
    d = choose_pipeline(req(prompt=8_000), pd_cluster(p_load=(0, 4), matched={"p1": 512}), CFG)
    assert d.p_id == "p0"


def test_pd_baseline_counts_d_cache_only_under_drc():
    view = pd_cluster(d_load=(2, 0), matched={"d0": 4_096})
    assert choose_pipeline(req(prompt=8_000), view, CFG).md_id == "d0"        # pd-local, pd-wan-drc
    no_drc = PolicyConfig(enable_drc=False)
    d = choose_pipeline(req(prompt=8_000), view, no_drc)                        # pd-wan: full KV always
    assert d.md_id == "d1" and d.missing_bytes == 8_000 * KVB


def test_pd_baseline_ties_go_to_the_smallest_id():
    d = choose_pipeline(req(), pd_cluster(p_load=(1, 1), d_load=(3, 3)), CFG)
    assert (d.p_id, d.md_id) == ("p0", "d0")


def test_pd_baseline_goes_direct_however_slow_the_line():
    slow = LinkEstimate(throughput_bytes_s=1e6, rtt_s=0.2)      # 8 Mbit/s
    d = choose_pipeline(req(), pd_cluster(wan=slow), CFG)
    assert d.pipeline is Pipeline.DIRECT and d.start_wan and d.reason == "no relay-decode instance"
