"""PDD on the real SmolLM2 over real sockets and the emulated WAN: eager
tokens from RLD, the extend-decode handoff in both modes, DRC, the direct
pipeline for high-hit requests, the abnormal-traffic filter, and a WAN cut."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from deploy_helpers import deployment_toml, ids, run
from pdd.deploy.launcher import Deployment
from pdd.engine.config import EngineConfig
from pdd.engine.engine import Engine
from pdd.engine.request import EngineRequest, SamplingParams
from pdd.model.tokenizer import Tokenizer

pytestmark = pytest.mark.slow
KV_BYTES_PER_TOKEN = 46080          # SmolLM2-135M, fp32
WAN_MBPS = 40.0                     # 5 MB/s: a 400-token uncached prompt takes ~3.7 s


@pytest.fixture(scope="module")
def reference(smollm2):
    """Greedy tokens of one engine alone, memoised."""
    model, cfg = smollm2
    cache: dict = {}

    def ref(prompt: list[int], n: int) -> list[int]:
        key = (tuple(prompt), n)
        if key not in cache:
            eng = Engine(model, cfg, EngineConfig(num_blocks=256, max_num_batched_tokens=1024))
            eng.submit(EngineRequest("r", prompt, SamplingParams(max_tokens=n, ignore_eos=True)))
            out = []
            while eng.has_work:
                out += [e.token_id for e in eng.step() if e.token_id is not None]
            cache[key] = out
        return cache[key]

    return ref


# These tests drive each mechanism with a handful of requests; the relay
# budgets bound shares over hundreds (tests/test_policy_*.py, the simulator's
# overload test), so here they are lifted.
NO_BUDGETS = {"relay_only_max_share": 1.0, "relay_max_token_share": 1.0}


def start(tmp_path_factory, smollm2_dir, name: str, policy: dict, wan_mbps: float = WAN_MBPS) -> Deployment:
    policy = NO_BUDGETS | policy
    d = tmp_path_factory.mktemp(name)
    path = d / "pdd.toml"
    path.write_text(deployment_toml("pdd", smollm2_dir, wan_mbps=wan_mbps, policy=policy,
                                    engine={"num_blocks": 768, "max_num_batched_tokens": 512}))
    return Deployment.start(path, run_dir=d / "run", timeout_s=240)


def timeline(trace: dict) -> str:
    """What a failed assertion should show: who made which token, and when."""
    src = trace.get("token_sources") or []
    t0 = trace.get("arrival_s", 0.0)
    evs = [(e["name"], round(e["ts"] - t0, 2)) for e in trace.get("events", [])]
    last = round(trace["token_times_s"][-1] - t0, 2) if trace.get("token_times_s") else None
    return (f"pipeline={trace.get('pipeline')} mode={trace.get('handoff_mode')} "
            f"rld_tokens={trace.get('rld_tokens')} batches={trace.get('handoff_batches')} "
            f"last_token={last} sources={''.join(s[0] for s in src)} events={evs}")


def event(trace: dict, name: str) -> dict | None:
    return next((e for e in trace["events"] if e["name"] == name), None)


def relay_first(trace: dict) -> str:
    """Who sends a relay's first token: P when RLD's local copy was due
    within the deployment's first_token_max_stall_s (0.25 s), else RLD."""
    due = (event(trace, "pipeline") or {}).get("rld_wait_s")
    return "p" if due is not None and due <= 0.25 else "rld"


@pytest.fixture(scope="module")
def auto(tmp_path_factory, smollm2_dir):
    dep = start(tmp_path_factory, smollm2_dir, "auto", {"catchup_threshold_tokens": 16,
                                                         "first_token_max_stall_s": 0.25})
    yield dep
    dep.stop()


def dispatched(dep: Deployment) -> dict[str, float]:
    """The router's count of its requests on each instance (/metrics)."""
    url = dep.router_url.removesuffix("/v1") + "/metrics"
    with urllib.request.urlopen(url, timeout=10) as f:
        text = f.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("pdd_router_dispatched_requests{"):
            out[line.split('instance="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
    return out


def test_low_hit_request_streams_from_rld_then_finishes_on_md(auto, reference, smollm2_dir):
    tok = Tokenizer(smollm2_dir)
    p = ids(1, 400)
    # The router's load counts, sampled while the request runs.
    samples, stop = [], threading.Event()

    def sample():
        for _ in range(2000):           # bounded: 2000 x 20 ms
            if stop.is_set():
                return
            samples.append((time.time(), dispatched(auto)))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    # The 18 MB of KV take ~3.7 s over the 40 Mbit/s line; RLD alone would need
    # ~9 s for 160 tokens here, so MD takes over with room to spare.
    try:
        text, tr = run(auto, p, 160)
    finally:
        stop.set()
        sampler.join(timeout=30)
    assert text == tok.decode(reference(p, 160))
    assert tr["pipeline"] == "relay", tr["pipeline_reason"]
    src = tr["token_sources"]
    # P's first token (RLD's copy due within the stall bound: ~0.1 s here),
    # then RLD's own decoding, then MD's
    assert src[0] == relay_first(tr) == "p" and src[-1] == "md" and tr["rld_tokens"] >= 1, timeline(tr)
    assert src[1:] == sorted(src[1:], key=lambda s: s != "rld"), "RLD tokens first, then MD's, no interleaving"
    md_ready = event(tr, "kv_ready")["ts"]
    assert tr["token_times_s"][0] < md_ready - 1.0, "first tokens streamed well before MD had the KV"
    assert tr["handoff_mode"] in ("one_shot", "catch_up") and tr["handoff_gap_s"] is not None
    # RLD's tokens went to MD while the KV crossed (`extend_ahead`): MD took
    # them at the landing and decoded on from there, with no batch after its
    # kv_ready; its tokens past them equal one engine's alone (the text above).
    log = event(tr, "lifecycle")["log"]
    assert event(tr, "md_ready").get("ahead", 0) > 1 and "extend_ahead" in log, timeline(tr)
    assert "extend" not in log and "extend_final" not in log and tr["handoff_batches"] == 1, log
    assert tr["wan_bytes"] == 400 // 16 * 16 * KV_BYTES_PER_TOKEN      # every full block crossed once
    # P began both transfers while it computed the prompt (streaming), so each
    # waited for blocks; the copy to MD yielded the line to nothing else here.
    sent = {e["target"]: e for e in tr["events"] if e["name"] == "kv_transfer"}
    assert sent.keys() == {"rld0", "md0"} and all(e["waited_s"] > 0 for e in sent.values()), sent
    assert sent["md0"]["background"] and not sent["rld0"]["background"]
    # 400 tokens are one chunk, yet P sent its KV layer by layer while computing
    # it (~0.5-2 s here): the line was busy during the prefill, so MD had the KV
    # sooner after the prefill's end than the whole transfer's line time.
    line_s = tr["wan_bytes"] / (WAN_MBPS * 1e6 / 8)
    assert md_ready - event(tr, "prefill_end")["ts"] < line_s - 0.2, timeline(tr)
    # The request counted against P until P had prefilled it (as in the PD
    # flows and the simulator), against RLD and MD while they served it.
    prefilled, first, last = event(tr, "prefill_end")["ts"], tr["token_times_s"][0], tr["token_times_s"][-1]
    assert any(c.get("p0") == 1 for t, c in samples if t < first - 0.05), samples[:5]
    during = [c for t, c in samples if prefilled + 0.2 < t < last - 0.2]
    assert during and all(c.get("p0") == 0 and c.get("md0") == 1 for c in during), during[:5]
    for _ in range(50):                 # the flow's last step may follow the stream's end
        if dispatched(auto) == {"p0": 0, "rld0": 0, "md0": 0}:
            break
        time.sleep(0.1)
    assert dispatched(auto) == {"p0": 0, "rld0": 0, "md0": 0}


def test_second_turn_goes_direct_and_sends_only_new_blocks(auto, reference, smollm2_dir):
    tok = Tokenizer(smollm2_dir)
    first = ids(2, 320)
    _, tr1 = run(auto, first, 100)         # clearly too long an output to be filtered: MD gets the KV
    # relayed, or direct when P computes slower than the line carries (a busy
    # machine: the copy streams behind the prefill); either way MD gets the KV
    assert tr1["pipeline"] in ("relay", "direct"), tr1["pipeline_reason"]
    second = first + ids(3, 24)
    text, tr = run(auto, second, 12, stream=False)
    assert text == tok.decode(reference(second, 12))
    assert tr["pipeline"] == "direct", tr["pipeline_reason"]
    # The router counted MD's cache (its index of MD's blocks, no WAN round trip).
    assert event(tr, "pipeline")["missing_bytes"] == (344 // 16 - 320 // 16) * 16 * KV_BYTES_PER_TOKEN
    new_blocks = (344 // 16) - (320 // 16)
    assert tr["wan_bytes"] == new_blocks * 16 * KV_BYTES_PER_TOKEN       # DRC: only what MD lacks
    # MD's tokens; the first one from P when MD's KV was due within first_token_max_stall_s
    src = tr["token_sources"]
    assert tr["cached_tokens"] == 320 and set(src[1:]) == {"md"}
    assert src[0] == ("p" if event(tr, "pipeline")["wait_s"] <= 0.25 else "md"), timeline(tr)


def test_long_prompt_short_output_is_filtered_to_rld(auto, reference, smollm2_dir):
    tok = Tokenizer(smollm2_dir)
    p = ids(4, 700)
    text, tr = run(auto, p, 4)
    assert text == tok.decode(reference(p, 4))
    assert tr["pipeline"] == "relay_filtered" and tr["pipeline_reason"].startswith("abnormal")
    assert tr["wan_bytes"] == 0 < tr["local_bytes"]
    assert tr["token_sources"][0] == relay_first(tr) and set(tr["token_sources"][1:]) == {"rld"}


def test_wan_cut_mid_transfer_finishes_on_rld(auto, reference, smollm2_dir):
    import asyncio

    tok = Tokenizer(smollm2_dir)
    ctl = auto.wan_control()
    p = ids(5, 480)
    timer = threading.Timer(4.0, lambda: asyncio.run(ctl.cut("reset")))   # prefill ~2.5 s, then transfer
    timer.start()
    try:
        text, tr = run(auto, p, 120)       # long enough that the filter never keeps it off the WAN
    finally:
        timer.join()
        asyncio.run(ctl.restore())
    assert text == tok.decode(reference(p, 120))
    assert tr["token_sources"][0] == relay_first(tr) and tr["pipeline"] == "relay"
    assert set(tr["token_sources"][1:]) == {"rld"}
    assert event(tr, "md_dropped") is not None


def test_filtered_calls_sharing_a_hot_prefix_warm_md(auto, reference, smollm2_dir):
    """Classify-style calls: 256 shared instruction tokens + a fresh document,
    2 output tokens. All stay off the WAN, but once P has seen the prefix
    reused twice, the filtered call still pushes those 16 blocks to MD, so the
    next request with that prefix sends only its own new blocks."""
    tok = Tokenizer(smollm2_dir)
    shared = ids(20, 256)
    traces = []
    for k in range(4):
        p = shared + ids(30 + k, 300)
        text, tr = run(auto, p, 2)
        assert text == tok.decode(reference(p, 2))
        traces.append(tr)
    assert [t["pipeline"] for t in traces] == ["relay_filtered"] * 4, [t["pipeline_reason"] for t in traces]
    assert [event(t, "warm_md") is not None for t in traces] == [False, False, False, True]
    rid, deadline = traces[3]["request_id"], time.monotonic() + 60
    while time.monotonic() < deadline:          # the push outlives the 2-token answer
        with urllib.request.urlopen(f"{auto.router_url}/requests/{rid}/trace", timeout=30) as f:
            tr = json.loads(f.read())
        moved = next((e for e in tr["events"] if e["name"] == "kv_transfer" and e["link"] == "wan"), None)
        if moved is not None:
            break
        time.sleep(0.5)
    assert moved is not None and moved["ok"], tr["events"]
    assert tr["wan_bytes"] == 16 * 16 * KV_BYTES_PER_TOKEN
    follow = shared + ids(40, 40)
    text, tr = run(auto, follow, 100)
    assert text == tok.decode(reference(follow, 100))
    # MD already had the prefix: only the 2 new full blocks crossed (the partial
    # last block is recomputed by the receiver).
    assert tr["wan_bytes"] == 2 * 16 * KV_BYTES_PER_TOKEN


@pytest.mark.parametrize("mode", ["catch_up", "one_shot", "overlap", "paced"])
def test_forced_handoff_modes_concurrent(mode, tmp_path_factory, smollm2_dir, reference):
    tok = Tokenizer(smollm2_dir)
    policy = {"handoff_mode": mode, "catchup_threshold_tokens": 8, "catchup_final_max_tokens": 2,
              "enable_filter": False, "direct_max_wan_s": 0.0, "relay_min_gain_s": 0.0}
    # Both prompts' KV (30 MB) must land on MD well before RLD could finish
    # 70 tokens on its own, on any machine: a 200 Mbit/s line moves it in ~1.2 s.
    dep = start(tmp_path_factory, smollm2_dir, mode, policy, wan_mbps=200.0)
    try:
        prompts = [ids(10, 360), ids(11, 300)]
        with ThreadPoolExecutor(2) as pool:
            got = list(pool.map(lambda p: run(dep, p, 70), prompts))
        # Sampled, with no seed: the router seeds it, so that RLD and MD draw
        # alike and MD's tokens can be checked against RLD's.
        # (Two at once again: one alone would go direct, its copy keeping up with P.)
        sampled = []
        if mode in ("overlap", "paced"):
            with ThreadPoolExecutor(2) as pool:
                sampled = [tr for _, tr in pool.map(lambda p: run(dep, p, 70, temperature=0.9),
                                                    [ids(12, 360), ids(13, 300)])]
    finally:
        dep.stop()
    for tr in sampled:
        log = event(tr, "lifecycle")["log"]
        assert tr["handoff_mode"] == mode and "note:overlap_diverged" not in log, timeline(tr)
        assert tr["token_sources"][-1] == "md", timeline(tr)
    for p, (text, tr) in zip(prompts, got):
        assert text == tok.decode(reference(p, 70))
        assert tr["pipeline"] == "relay" and tr["handoff_mode"] == mode
        assert tr["token_sources"][-1] == "md", timeline(tr)
        if mode == "one_shot":
            assert tr["handoff_batches"] == 1
        elif mode in ("overlap", "paced"):
            # One final batch, RLD not paused: RLD's tokens, then MD's, each index once.
            src = tr["token_sources"]
            assert tr["handoff_batches"] == 1, timeline(tr)
            # Two requests share this machine's cores: MD need not be faster
            # than RLD here, so RLD may pause only as the overlap's lag bound does.
            log = event(tr, "lifecycle")["log"]
            assert "pause_at:rld" not in log and ("pause:rld" not in log or "note:overlap_pause" in log), log
            k = src.index("md")
            assert set(src[:k]) <= {"p", "rld"} and set(src[k:]) == {"md"}, timeline(tr)
            assert "note:paced" in log, log          # the default ratio paces an overlap too
        elif event(tr, "md_ready")["eager_tokens"] > 2:
            # more than catchup_final_max_tokens when MD got ready: a catch-up
            # batch first (RLD, not paused by the final batch, may emit more after it)
            assert tr["handoff_batches"] >= 2, timeline(tr)
