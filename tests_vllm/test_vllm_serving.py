"""`pdd up` of a vLLM deployment, real processes, the official openai client:
the text equals a single vLLM engine's, streaming and not, alone and
concurrent; the internal API (match, stats, steps, metrics) answers as our
engine's instance does."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from deploy_helpers import deployment_toml, ids
from pdd.deploy.launcher import Deployment
from vllm_helpers import VLLM_ENGINE, complete

@pytest.fixture(scope="module")
def colocated(smollm2_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("vllm-colocated")
    path = d / "colocated.toml"
    path.write_text(deployment_toml("colocated", smollm2_dir, engine=VLLM_ENGINE))
    dep = Deployment.start(path, run_dir=d / "run", timeout_s=300)
    client = openai.OpenAI(base_url=dep.router_url, api_key="unused", max_retries=0, timeout=120)
    yield dep, client, client.models.list().data[0].id
    dep.stop()


def test_greedy_text_equals_a_single_vllm_engine(colocated, greedy, tok):
    dep, client, model = colocated
    for seed, n in ((1, 40), (2, 300)):
        p = ids(seed, n)
        r = complete(client, model, p, 16)
        assert r.choices[0].text == tok.decode(greedy(p, 16))
        assert r.usage.completion_tokens == 16 and r.usage.prompt_tokens == n
        assert r.choices[0].finish_reason == "length"


def test_streaming_equals_a_single_vllm_engine_one_chunk_a_token(colocated, greedy, tok):
    dep, client, model = colocated
    p = ids(3, 200)
    chunks = complete(client, model, p, 12, stream=True)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == tok.decode(greedy(p, 12))
    assert sum(1 for c in chunks if c.choices and c.choices[0].finish_reason is None) == 12
    assert chunks[-1].usage.completion_tokens == 12


def test_concurrent_chat_requests_each_equal_a_single_engine(colocated, greedy, tok):
    dep, client, model = colocated
    questions = [f"Name {k + 2} colours of the rainbow." for k in range(4)]

    def ask(q):
        return client.chat.completions.create(model=model, messages=[{"role": "user", "content": q}],
                                              max_tokens=12, temperature=0)

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask, questions))
    for q, a in zip(questions, answers):
        prompt = tok.apply_chat_template([{"role": "user", "content": q}])
        want = greedy(prompt, 12)
        assert a.usage.prompt_tokens == len(prompt)
        # the router cuts at EOS; ignore_eos is off here as a user would have it
        assert a.choices[0].message.content == tok.decode(want[:a.usage.completion_tokens])


def test_internal_api_answers_match_stats_steps_and_metrics(colocated):
    import json
    import urllib.request

    dep, client, model = colocated
    p = ids(4, 130)
    complete(client, model, p, 2)
    from pdd.server.http_auth import sign

    c0 = dep.spec.instances[0]
    key = dep.keys.internal_http

    def call(method, path, body=None):
        data = json.dumps(body).encode() if body is not None else b""
        headers = sign(key, method, path, c0.name, data) | ({"Content-Type": "application/json"} if data else {})
        req = urllib.request.Request(f"http://{c0.host}:{c0.port}{path}", data=data or None, headers=headers,
                                     method=method)
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.read()

    assert json.loads(call("POST", "/internal/match", {"prompt_ids": p}))["matched_tokens"] == 128
    assert json.loads(call("POST", "/internal/match", {"prompt_ids": ids(5, 130)}))["matched_tokens"] == 0
    stats = json.loads(call("GET", "/internal/stats"))
    assert stats["backend"] == "vllm" and stats["role"] == "colocated" and stats["kv_total_blocks"] == 512
    steps = json.loads(call("GET", "/internal/steps"))["steps"]
    assert steps and any(s["num_prefill_tokens"] > 0 for s in steps)
    with urllib.request.urlopen(f"http://{c0.host}:{c0.port}/metrics", timeout=10) as r:
        text = r.read().decode()
    assert 'pdd_generated_tokens_total{instance="c0",role="colocated"}' in text
