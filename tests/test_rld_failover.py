"""RelayDecode lost mid-relay: MD takes over at the token the user is at.

Real processes, SmolLM2 and the emulated WAN. A relayed request's RLD is
killed (kill -9) or stopped (SIGSTOP past [timeouts] stream_stall_s) while
MD's copy of the KV crosses the WAN; every such request must still finish
with the greedy text of one engine alone, with no token twice or missing,
whether the user had several tokens from RLD or none yet.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from deploy_helpers import deployment_toml
from test_pdd import ids, reference  # noqa: F401 - the memoised greedy reference, a fixture
from pdd.deploy.launcher import Deployment
from pdd.model.tokenizer import Tokenizer
from pdd.policy import RldLossAction, RldLossFacts, on_rld_lost, stalled

pytestmark = pytest.mark.slow
STALL_S = 6.0   # generous enough for MD's first token after a big extend on a loaded box
# 20 Mbit/s: a 400-token prompt's 18 MB take ~7 s to reach MD, long after RLD's
# first tokens and the stall limit; a 256-token one ~5 s.
WAN_MBPS = 20.0


def test_rld_loss_decision_is_pure_and_prefers_the_live_md_copy():
    f = lambda **kw: RldLossFacts(**({"md_live": False, "md_available": True, "p_holds_kv": True,
                                        "md_copy_settled": True} | kw))
    assert on_rld_lost(f(md_live=True, p_holds_kv=False)) is RldLossAction.TAKE_OVER
    assert on_rld_lost(f()) is RldLossAction.RESEND
    assert on_rld_lost(f(p_holds_kv=False)) is RldLossAction.FAIL
    assert on_rld_lost(f(md_available=False)) is RldLossAction.FAIL
    # a cancelled P->MD copy still reporting under the same name: no second one
    assert on_rld_lost(f(md_copy_settled=False)) is RldLossAction.FAIL
    assert not stalled(None, 100.0, 2.0) and not stalled(98.5, 100.0, 2.0) and stalled(97.9, 100.0, 2.0)
    # An instance that still answers the router's polls is queued, not gone.
    assert not stalled(97.9, 100.0, 2.0, answered_s=98.5) and stalled(97.9, 100.0, 2.0, answered_s=97.9)


@pytest.fixture(scope="module")
def dep(tmp_path_factory, smollm2_dir):
    # Budgets lifted and the filter off so that every request here is relayed
    # with a WAN copy for MD (the filter's own tests live in test_pdd.py).
    policy = {"relay_only_max_share": 1.0, "relay_max_token_share": 1.0, "enable_filter": False}
    d = tmp_path_factory.mktemp("rld_failover")
    path = d / "pdd.toml"
    path.write_text(deployment_toml("pdd", smollm2_dir, wan_mbps=WAN_MBPS, policy=policy,
                                    engine={"num_blocks": 768, "max_num_batched_tokens": 512},
                                    timeouts={"stream_stall_s": STALL_S}))
    dep = Deployment.start(path, run_dir=d / "run", timeout_s=240)
    yield dep
    dep.stop()


class Stream:
    """One streaming completion in a thread; counts tokens as they arrive."""

    def __init__(self, dep: Deployment, prompt: list[int], n: int):
        self.dep, self.prompt, self.n = dep, prompt, n
        self.tokens = 0
        self.text, self.rid, self.error = "", None, None
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        client = openai.OpenAI(base_url=self.dep.router_url, api_key="x", max_retries=0, timeout=120)
        try:
            for c in client.completions.create(model=client.models.list().data[0].id, prompt=self.prompt,
                                               max_tokens=self.n, temperature=0, stream=True,
                                               extra_body={"ignore_eos": True}):
                self.rid = c.id
                if c.choices:
                    self.text += c.choices[0].text
                    self.tokens += 1
        except Exception as e:  # noqa: BLE001 - reported by the test
            self.error = e

    def join(self, timeout_s: float) -> dict:
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), "request did not end"
        assert self.error is None, repr(self.error)
        with urllib.request.urlopen(f"{self.dep.router_url}/requests/{self.rid}/trace", timeout=30) as f:
            return json.loads(f.read())


def wait_until(cond, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


def event(trace: dict, name: str) -> dict | None:
    return next((e for e in trace["events"] if e["name"] == name), None)


def router_health(dep: Deployment) -> str:
    """The router's /health status: ok, degraded (an instance down) or unavailable."""
    try:
        with urllib.request.urlopen(f"{dep.router_url.removesuffix('/v1')}/health", timeout=5) as r:
            return json.loads(r.read())["status"]
    except urllib.error.HTTPError as e:
        return json.loads(e.read())["status"]
    except OSError:
        return "unreachable"


def rld_proc(dep: Deployment):
    return next(p for p in dep.procs if p.name == "rld0")


def test_stalled_rld_hands_over_to_md_after_the_stall_limit(dep, reference, smollm2_dir):
    """SIGSTOP RLD after its first tokens: once it has been silent for
    stream_stall_s, MD (its KV still on the WAN) continues from there."""
    tok = Tokenizer(smollm2_dir)
    p, n = ids(1, 400), 40
    rld = rld_proc(dep)
    s = Stream(dep, p, n)
    try:
        wait_until(lambda: s.tokens >= 2 or not s.thread.is_alive(), 120)
        os.killpg(rld.pid, signal.SIGSTOP)
        tr = s.join(120)
    finally:
        os.killpg(rld.pid, signal.SIGCONT)
    assert s.text == tok.decode(reference(p, n))
    lost = event(tr, "rld_lost")
    assert lost is not None and "stream_stall_s" in lost["reason"], tr["events"]
    assert lost["ts"] - tr["arrival_s"] >= 0 and lost["tokens"] >= 2
    assert event(tr, "md_takeover")["at"] == lost["tokens"]
    src = tr["token_sources"]
    assert len(src) == n and src[-1] == "md" and src[:lost["tokens"]] == ["rld"] * lost["tokens"], src
    # RLD was given up on only once it had been silent for the limit, and not much later
    silent_s = lost["ts"] - tr["token_times_s"][lost["tokens"] - 1]
    assert STALL_S * 0.9 <= silent_s <= STALL_S + 3.0, silent_s


def test_killed_rld_hands_every_relayed_request_to_md(dep, reference, smollm2_dir):
    """kill -9 of RLD with four relayed requests in flight, one with several
    tokens streamed and others still waiting for their first: all finish on
    MD with the reference text."""
    tok = Tokenizer(smollm2_dir)
    n = 40
    prompts = [ids(10 + k, 256) for k in range(4)]
    # A stopped-and-resumed RLD (the stall test) is routable again once the
    # router's poll has seen it answer: /health says "ok" (nothing down) then.
    wait_until(lambda: router_health(dep) == "ok", 30)
    # the first alone, so that it is first through P and streams before the kill
    streams = [Stream(dep, prompts[0], n)]
    wait_until(lambda: streams[0].tokens >= 4 or not streams[0].thread.is_alive(), 120)
    # the others are routed (relay) and still in P's prefill when RLD dies
    streams += [Stream(dep, q, n) for q in prompts[1:]]
    time.sleep(0.5)
    rld = rld_proc(dep)
    os.killpg(rld.pid, signal.SIGKILL)
    with ThreadPoolExecutor(4) as pool:
        traces = list(pool.map(lambda s: s.join(180), streams))
    for q, s, tr in zip(prompts, streams, traces):
        assert s.text == tok.decode(reference(q, n)), (tr["token_sources"], tr["events"])
        assert tr["pipeline"] == "relay", tr["pipeline_reason"]
        assert len(tr["token_sources"]) == n and tr["token_sources"][-1] == "md"
    lost = [event(tr, "rld_lost") for tr in traces]
    at = sorted(e["tokens"] for e in lost if e is not None)
    assert at and at[-1] >= 4 and at[0] == 0, [tr["events"] for tr in traces]
