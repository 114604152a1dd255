"""In-datacenter PD over vLLM: P and D are two vLLM engines; the prompt KV
moves as whole vLLM blocks through the PDD connector over our transport.
Greedy text equals a single vLLM engine's; a second turn sends only the
blocks D's prefix cache lacks; P frees what it held once released."""

from __future__ import annotations

import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from deploy_helpers import deployment_toml, ids
from pdd.deploy.launcher import Deployment
from vllm_helpers import VLLM_ENGINE, complete, stats

@pytest.fixture(scope="module")
def pd(smollm2_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("vllm-pd-local")
    path = d / "pd-local.toml"
    path.write_text(deployment_toml("pd-local", smollm2_dir, engine=VLLM_ENGINE, timeouts={"kv_deadline_s": 60}))
    dep = Deployment.start(path, run_dir=d / "run", timeout_s=300)
    client = openai.OpenAI(base_url=dep.router_url, api_key="unused", max_retries=0, timeout=120)
    yield dep, client, client.models.list().data[0].id
    dep.stop()


def trace(dep, rid: str) -> dict:
    with urllib.request.urlopen(f"{dep.router_url}/requests/{rid}/trace", timeout=10) as r:
        return json.loads(r.read())


def test_greedy_text_equals_a_single_vllm_engine(pd, greedy, tok):
    dep, client, model = pd
    for seed, n in ((1, 40), (2, 300), (3, 64)):       # 64: the prompt ends on a block boundary
        p = ids(seed, n)
        r = complete(client, model, p, 16)
        assert r.choices[0].text == tok.decode(greedy(p, 16)), n
        assert r.usage.completion_tokens == 16 and r.usage.prompt_tokens == n


def test_streaming_and_concurrent_equal_a_single_engine(pd, greedy, tok):
    dep, client, model = pd
    p = ids(4, 200)
    chunks = complete(client, model, p, 12, stream=True)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == tok.decode(greedy(p, 12))
    prompts = [ids(10 + k, 90 + 37 * k) for k in range(4)]
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda q: complete(client, model, q, 10), prompts))
    for q, a in zip(prompts, answers):
        assert a.choices[0].text == tok.decode(greedy(q, 10))


def test_kv_really_crosses_and_a_second_turn_sends_only_missing_blocks(pd, greedy, tok):
    dep, client, model = pd
    first = ids(20, 330)                     # 10 full blocks of 32
    loaded0 = stats(dep, "d0")["kv_loaded_blocks"]
    r1 = complete(client, model, first, 8)
    assert r1.choices[0].text == tok.decode(greedy(first, 8))
    t1 = trace(dep, r1.id)
    x1 = next(e for e in t1["events"] if e["name"] == "kv_transfer")
    assert x1["ok"] and x1["blocks_sent"] == 10 and x1["blocks_skipped"] == 0
    block_bytes = x1["payload_bytes"] // 10
    assert block_bytes == 32 * 46080         # whole vLLM blocks: 30 layers x K,V x 3 heads x 64 x fp32
    # D loaded all 10 into vLLM instead of computing them, and still decoded
    # vLLM's own greedy text: the KV that crossed is the KV it used.
    loaded1 = stats(dep, "d0")["kv_loaded_blocks"]
    assert loaded1 - loaded0 == 10
    second = first + ids(21, 100)            # the next turn: 13 full blocks, 10 of them on D already
    r2 = complete(client, model, second, 8)
    assert r2.choices[0].text == tok.decode(greedy(second, 8))
    x2 = next(e for e in trace(dep, r2.id)["events"] if e["name"] == "kv_transfer")
    assert x2["ok"] and x2["blocks_skipped"] == 10 and x2["blocks_sent"] == 3
    assert x2["payload_bytes"] == 3 * block_bytes
    assert stats(dep, "d0")["kv_loaded_blocks"] - loaded1 == 3     # the other 10 from D's own prefix cache


def test_prefill_frees_what_it_held_once_released(pd):
    dep, client, model = pd
    import time

    for _ in range(50):                       # released after each transfer; freed at P's next step
        s = stats(dep, "p0")
        if s["kv_used_blocks"] == 0 and s["num_requests"] == 0:
            break
        time.sleep(0.2)
    assert s["kv_used_blocks"] == 0, s
    assert s["num_requests"] == 0, s
