"""Soak (bounded, in the default suite): ~80 s of concurrent streams through
a real PDD deployment (P, RLD, MD over the emulated WAN), a seeded share of
clients disconnecting mid-stream, half the prompts sharing a prefix. Then,
on every instance: nothing running, waiting, pinned or held; every block
free, the prefix cache's idle (evictable) blocks included; and each process's
resident memory grew by no more than a stated bound.

Why: a client that leaves before its request's KV lands on MD used to leave
that KV pinned (counted as used) until the arrival expired (2 x kv_deadline_s),
or for good when it left between the KV landing and the request starting.
"""

from __future__ import annotations

import json
import random
import threading
import time
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from deploy_helpers import deployment_toml
from pdd.deploy.launcher import Deployment
from pdd.engine.request import EngineRequest, SamplingParams
from pdd.server.http_auth import sign
from test_engine import make_engine, prompt
from test_kv_export import prefill

SOAK_S = 80.0              # load phase
NUM_CLIENTS = 6
MAX_REQUESTS = 400         # per soak, a bound beside the time
DISCONNECT_SHARE = 0.4
# How long the instances get to settle (the loop ends once they are at rest;
# the arrival expiry is 120 s). The load offers the 40 Mbit/s line about
# twice what it carries, and copies no longer fail for waiting (they keep
# their request's deadline; a copy that only warms MD's cache after the
# answer is bounded by kv_deadline_s, 60 s): in a measured run 16 copies with
# 35 MB left were still queued when the load stopped and took ~20 s to land.
IDLE_WAIT_S = 60.0
# Growth per process over the soak (a leak of ~12 MB/s would pass 1 GB).
# P's streamed copies once read a whole prompt's KV ahead of a slow line and
# kept the pages after: 119-265 MB in four runs. Reading a bounded window
# ahead (`prefill_job.READ_AHEAD_BYTES`) and trimming the heap once a KV
# transfer ends with nothing else under way (`Instance.trim_if_quiet`): P
# 22-39 MB, MD 41-46 (80-117 before the receiver side trimmed too), RLD 53-84
# in six runs and 211 in one (2026-12-05, bf16 example): 200 was tried and
# failed on that one, so the bound stays where it was.
RSS_BOUND_MB = 250


def instance_stats(dep: Deployment) -> dict[str, dict]:
    key, out = dep.keys.internal_http, {}
    for inst in dep.spec.instances:
        base, ctx = dep.instance_url(inst.name)      # MD is reached over TLS (another datacenter)
        req = urllib.request.Request(f"{base}/internal/stats",
                                     headers=sign(key, "GET", "/internal/stats", inst.name))
        with urllib.request.urlopen(req, timeout=5, context=ctx) as r:
            out[inst.name] = json.loads(r.read())
    return out


def rss_mb(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def at_rest(s: dict) -> list[str]:
    """What keeps an instance from rest; empty when every block is back.
    num_arrivals is not checked: a transfer that begins on MD just after its
    decode call was abandoned leaves a record (unpinned once the transfer
    fails or ends) until its expiry; its blocks are what count."""
    bad = [f"{k}={s[k]}" for k in ("num_running", "num_waiting", "kv_used_blocks", "kv_pinned_blocks",
                                   "num_pinned_requests", "kv_held_blocks", "num_requests",
                                   "num_jobs") if s.get(k)]
    if s["kv_free_blocks"] != s["kv_total_blocks"]:
        bad.append(f"free {s['kv_free_blocks']} of {s['kv_total_blocks']}")
    if s["kv_evictable_blocks"] != s["kv_cached_blocks"]:
        bad.append(f"cached {s['kv_cached_blocks']} but evictable {s['kv_evictable_blocks']}")
    return bad


# -- the accounting, on one engine (fast) ------------------------------------------

def test_idle_prefix_cache_is_free_not_used_and_pins_are_reported(tiny_model):
    a, b = make_engine(tiny_model), make_engine(tiny_model)
    p = prompt(7, 100)                         # 6 full blocks
    prefill(a, "r", p)
    blob = a.export_kv("r")
    b.import_kv(blob, pin_for="r")
    s = b.stats()
    assert (s["kv_used_blocks"], s["kv_pinned_blocks"], s["num_pinned_requests"]) == (6, 6, 1)
    assert s["kv_evictable_blocks"] == 0
    b.abort("r")                               # the request never came: its pins go
    s = b.stats()
    assert (s["kv_used_blocks"], s["kv_pinned_blocks"], s["kv_cached_blocks"], s["kv_evictable_blocks"]) == (0, 0, 6, 6)
    assert s["kv_free_blocks"] == s["kv_total_blocks"]     # the cache at rest is free to evict
    sa = a.stats()
    assert (sa["kv_held_blocks"], sa["kv_used_blocks"], sa["num_requests"]) == (7, 7, 1)   # P's keep_kv
    a.abort("r")
    a.forget("r")
    sa = a.stats()
    assert (sa["kv_held_blocks"], sa["kv_used_blocks"], sa["num_requests"]) == (0, 0, 0)


def test_forgetting_a_finished_request_drops_pins_taken_after_it_ran(tiny_model):
    """A late copy of KV pinned for a request that already finished (it is
    only for the prefix cache now) is dropped with the request's record."""
    a, b = make_engine(tiny_model), make_engine(tiny_model)
    p = prompt(8, 40)
    prefill(a, "r", p)
    b.submit(EngineRequest("r", p, SamplingParams(max_tokens=2, ignore_eos=True)))
    for _ in range(20):
        if not b.has_work:
            break
        b.step()
    b.import_kv(a.export_kv("r"), pin_for="r")
    assert b.stats()["kv_pinned_blocks"] == 2
    b.forget("r")
    s = b.stats()
    assert (s["kv_used_blocks"], s["kv_pinned_blocks"], s["num_requests"]) == (0, 0, 0)


# -- the soak, over real processes ---------------------------------------------------

@pytest.fixture(scope="module")
def dep(tmp_path_factory, smollm2_dir):
    d = tmp_path_factory.mktemp("soak")
    path = d / "pdd.toml"
    path.write_text(deployment_toml(
        "pdd", smollm2_dir, wan_mbps=40.0,
        policy={"relay_only_max_share": 1.0, "relay_max_token_share": 1.0},
        engine={"num_blocks": 768, "max_num_batched_tokens": 512}))
    dep = Deployment.start(path, run_dir=d / "run", timeout_s=240)
    yield dep
    dep.stop()


@pytest.mark.slow
def test_soak_streams_with_disconnects_return_every_block(dep):
    client = openai.OpenAI(base_url=dep.router_url, api_key="x", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    shared = [random.Random(0).randrange(100, 40000) for _ in range(160)]   # 10 blocks
    deadline = 0.0       # set once warmed up
    issued = Counter()
    lock = threading.Lock()

    def one(seed: int) -> tuple[str, int]:
        r = random.Random(seed)
        prompt = (shared if r.random() < 0.5 else []) + [r.randrange(100, 40000) for _ in range(r.randrange(24, 240))]
        cut = r.randrange(0, 12) if r.random() < DISCONNECT_SHARE else None
        stream = client.completions.create(model=model, prompt=prompt, max_tokens=r.randrange(8, 32),
                                           temperature=0, stream=True, extra_body={"ignore_eos": True})
        n = 0
        for chunk in stream:
            if cut is not None and n >= cut:
                stream.close()        # the client goes away mid-stream
                return "disconnected", n
            n += len(chunk.choices[0].text) > 0 if chunk.choices else 0
        return "finished", n

    def worker(w: int) -> Counter:
        got = Counter()
        for k in range(MAX_REQUESTS):
            if time.monotonic() > deadline:
                break
            with lock:
                if sum(issued.values()) >= MAX_REQUESTS:
                    break
                issued["n"] += 1
            try:
                kind, _ = one(1000 * w + k)
            except openai.APIError as e:
                kind = f"error {type(e).__name__}"
            got[kind] += 1
        return got

    # warm up once, so the baseline memory includes what the first requests allocate
    for s in range(3):
        one(10_000 + s)
    pids = {p.name: p.pid for p in dep.procs}
    before = {name: rss_mb(pid) for name, pid in pids.items()}

    t0 = time.monotonic()
    deadline = t0 + SOAK_S
    with ThreadPoolExecutor(NUM_CLIENTS) as ex:
        results = sum((f.result() for f in [ex.submit(worker, w) for w in range(NUM_CLIENTS)]), Counter())
    load_s = time.monotonic() - t0

    t1, stats = time.monotonic(), instance_stats(dep)
    while time.monotonic() - t1 < IDLE_WAIT_S and any(at_rest(s) for s in stats.values()):
        time.sleep(0.5)
        stats = instance_stats(dep)
    settle_s = time.monotonic() - t1
    after = {name: rss_mb(pid) for name, pid in pids.items()}
    growth = {name: round(after[name] - before[name], 1) for name in pids}
    print(f"\nsoak: {load_s:.0f} s, {dict(results)}, settled in {settle_s:.1f} s; "
          f"RSS MB before {({k: round(v) for k, v in before.items()})}, growth {growth}; "
          f"cached blocks {({k: s['kv_cached_blocks'] for k, s in stats.items()})}, "
          f"arrivals {({k: s['num_arrivals'] for k, s in stats.items() if 'num_arrivals' in s})}")

    assert results["finished"] >= 8 and results["disconnected"] >= 4, results
    assert not [k for k in results if k.startswith("error")], results
    assert {k: at_rest(s) for k, s in stats.items() if at_rest(s)} == {}
    assert stats["md0"]["kv_cached_blocks"] > 0      # the prefix cache kept what landed
    assert all(g <= RSS_BOUND_MB for g in growth.values()), growth
    base, ctx = dep.instance_url("md0")
    with urllib.request.urlopen(f"{base}/metrics", timeout=10, context=ctx) as r:
        text = r.read().decode()
    assert 'pdd_kv_pinned_blocks{instance="md0",role="main"} 0.0' in text
    assert f'pdd_kv_evictable_blocks{{instance="md0",role="main"}} {float(stats["md0"]["kv_cached_blocks"])}' in text
