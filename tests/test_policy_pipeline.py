import math

import pytest

from pdd.policy import (
    ClusterView, InstanceView, LinkEstimate, NoRouteError, Pipeline, PolicyConfig, RequestFacts,
    Role, choose_pipeline,
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


def test_missing_bytes_round_to_whole_blocks():
    d = choose_pipeline(req(prompt=100), cluster(md_matched=40), CFG)
    # 7 prompt blocks, 2 whole blocks held -> 5 blocks travel
    assert d.missing_bytes == 5 * 16 * KVB


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
    off = choose_pipeline(req(max_tokens=8), cluster(), PolicyConfig(enable_filter=False))
    assert off.pipeline is Pipeline.RELAY
    # A full relay pool does not send it over the WAN: it queues on the least-loaded RLD.
    full = choose_pipeline(req(max_tokens=8), cluster(rlds=("r0", "r1"), rld_running=64), CFG)
    assert full.pipeline is Pipeline.RELAY_ONLY and full.rld_id in ("r0", "r1") and not full.start_wan


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
