"""Every deployment mode over real processes, real TCP and the official
openai client: greedy output equals the single-engine output, streaming and
not, alone and concurrent; bad input gets an OpenAI-style 4xx; internal
ports refuse unauthenticated calls. Runs on the tiny random Llama."""

from __future__ import annotations

import json
import random
import ssl
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from deploy_helpers import deployment_toml
from pdd.deploy.launcher import Deployment
from pdd.model.reference import generate_greedy
from pdd.model.tokenizer import Tokenizer
from pdd.transport.tls import http_tls

MODES = ["colocated", "pd-local", "pd-wan", "pdd"]


@pytest.fixture(scope="module", params=MODES)
def served(request, tiny_model_dir, tmp_path_factory):
    mode = request.param
    d = tmp_path_factory.mktemp(mode)
    path = d / f"{mode}.toml"
    path.write_text(deployment_toml(mode, tiny_model_dir, wan_mbps=8.0))
    dep = Deployment.start(path, run_dir=d / "run", timeout_s=180)
    client = openai.OpenAI(base_url=dep.router_url, api_key="unused", max_retries=0, timeout=120)
    yield dep, client, client.models.list().data[0].id
    dep.stop()


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return Tokenizer(tiny_model_dir)


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def expected(tiny_model, tok, prompt: list[int], n: int) -> str:
    return tok.decode(generate_greedy(tiny_model[0], prompt, n))


def complete(client, model, prompt, n, stream=False):
    kw = dict(model=model, prompt=prompt, max_tokens=n, temperature=0, extra_body={"ignore_eos": True})
    if not stream:
        return client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    return chunks


def test_greedy_output_equals_single_engine(served, tiny_model, tok):
    dep, client, model = served
    for seed, n in ((1, 40), (2, 300)):
        p = ids(seed, n)
        r = complete(client, model, p, 24)
        assert r.choices[0].text == expected(tiny_model, tok, p, 24)
        assert r.usage.completion_tokens == 24 and r.usage.prompt_tokens == n
        assert r.choices[0].finish_reason == "length"


def test_a_one_token_answer_is_p_s_alone(served, tiny_model, tok):
    """P's first token is the whole answer: it is the engine's, and in the
    disaggregated modes no decoder is opened and no KV moves."""
    dep, client, model = served
    p = ids(11, 120)
    r = complete(client, model, p, 1)
    assert r.choices[0].text == expected(tiny_model, tok, p, 1)
    assert r.usage.completion_tokens == 1 and r.choices[0].finish_reason == "length"
    tr = _trace(dep, r.id)
    assert not any(e["name"] == "kv_transfer" for e in tr["events"]), tr["events"]
    if dep.spec.mode != "colocated":
        assert tr["token_sources"] == ["p"] and set(tr["instances"]) == {"p"}, tr


def test_streaming_output_equals_single_engine(served, tiny_model, tok):
    dep, client, model = served
    p = ids(3, 200)
    chunks = complete(client, model, p, 20, stream=True)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected(tiny_model, tok, p, 20)
    assert sum(1 for c in chunks if c.choices and c.choices[0].finish_reason is None) == 20   # one chunk a token
    assert chunks[-1].usage.completion_tokens == 20


def test_concurrent_requests_equal_each_alone(served, tiny_model, tok):
    dep, client, model = served
    prompts = [ids(10 + k, 30 + 70 * k) for k in range(6)]
    with ThreadPoolExecutor(6) as pool:
        got = list(pool.map(lambda k: complete(client, model, prompts[k], 16, stream=k % 2 == 1), range(6)))
    for k, r in enumerate(got):
        text = "".join(c.choices[0].text for c in r if c.choices) if k % 2 else r.choices[0].text
        assert text == expected(tiny_model, tok, prompts[k], 16), f"request {k}"


def test_prefix_cache_reports_cached_tokens_and_keeps_output(served, tiny_model, tok):
    dep, client, model = served
    base = ids(40, 160)
    complete(client, model, base, 4)
    p = base + ids(41, 40)
    r = complete(client, model, p, 12)
    assert r.usage.prompt_tokens_details.cached_tokens >= 160 - 16
    assert r.choices[0].text == expected(tiny_model, tok, p, 12)


def test_chat_and_text_prompts(served):
    dep, client, model = served
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello!"}],
                                       max_tokens=8, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.usage.completion_tokens >= 1
    s = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello!"}],
                                       max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in s if c.choices) == r.choices[0].message.content
    t = client.completions.create(model=model, prompt="The weather today", max_tokens=5, temperature=0.7, seed=3)
    t2 = client.completions.create(model=model, prompt="The weather today", max_tokens=5, temperature=0.7, seed=3)
    assert t.choices[0].text == t2.choices[0].text      # seeded sampling is reproducible in every mode


def _post(url: str, body: bytes, headers=None, context=None) -> tuple[int, dict]:
    req = urllib.request.Request(url, body, {"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30, context=context) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_bad_requests_get_openai_errors_and_lose_nothing(served, tiny_model, tok):
    dep, client, model = served
    url = dep.router_url + "/completions"
    ok = {"model": model, "prompt": [5, 6, 7], "max_tokens": 2}
    cases = [
        (b"{not json", 400),
        (json.dumps(ok | {"model": "gpt-9"}).encode(), 404),
        (json.dumps(ok | {"max_tokens": -3}).encode(), 400),
        (json.dumps(ok | {"max_tokens": "many"}).encode(), 400),
        (json.dumps(ok | {"prompt": 123}).encode(), 400),
        (json.dumps(ok | {"prompt": []}).encode(), 400),
        (json.dumps(ok | {"prompt": [10**9]}).encode(), 400),
        (json.dumps(ok | {"prompt": list(range(100, 5000))}).encode(), 400),   # over the 4096 context
        (json.dumps(ok | {"n": 3}).encode(), 400),
        (json.dumps(ok | {"temperature": "hot"}).encode(), 400),
        (json.dumps(ok | {"stop": 5}).encode(), 400),
    ]
    for body, status in cases:
        code, err = _post(url, body)
        assert code == status, (body[:80], code, err)
        assert set(err["error"]) >= {"message", "type"} and err["error"]["message"]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt="x", max_tokens=-1)
    p = ids(5, 50)
    assert complete(client, model, p, 6).choices[0].text == expected(tiny_model, tok, p, 6)


def test_internal_ports_refuse_unauthenticated_calls(served):
    dep, client, model = served
    for inst in dep.spec.instances:
        base, ctx = f"http://{inst.host}:{inst.port}", None
        if http_tls(dep.spec, inst):    # across the WAN: TLS, verified against the deployment CA
            base, ctx = f"https://{inst.host}:{inst.port}", ssl.create_default_context(cafile=dep.tls_dir / "ca.crt")
            ctx.check_hostname = False  # reached by address; its certificate names the instance
        code, err = _post(base + "/internal/abort", json.dumps({"request_id": "x"}).encode(), context=ctx)
        assert code == 401
        code, _ = _post(base + "/internal/match", b"{}", {"X-PDD-Auth": "1:2:3"}, context=ctx)
        assert code == 401
        with urllib.request.urlopen(base + "/metrics", timeout=10, context=ctx) as r:
            text = r.read().decode()
        assert "pdd_kv_free_blocks" in text and "pdd_generated_tokens_total" in text


def test_router_metrics_and_trace(served):
    dep, client, model = served
    r = complete(client, model, ids(7, 64), 5)
    with urllib.request.urlopen(f"{dep.router_url}/requests/{r.id}/trace", timeout=10) as f:
        tr = json.loads(f.read())
    assert len(tr["token_times_s"]) == 5 and tr["ttft_s"] > 0 and tr["finish_reason"] == "length"
    assert tr["prompt_tokens"] == 64
    if dep.spec.mode != "colocated":
        assert any(e["name"] == "kv_transfer" and e["ok"] for e in tr["events"])
    with urllib.request.urlopen(dep.router_url.removesuffix("/v1") + "/metrics", timeout=10) as f:
        text = f.read().decode()
    assert "pdd_router_ttft_seconds_bucket" in text and "pdd_router_requests_total" in text


def _trace(dep, rid: str) -> dict:
    with urllib.request.urlopen(f"{dep.router_url}/requests/{rid}/trace", timeout=10) as f:
        return json.loads(f.read())


def test_token_ids_come_back_and_a_quoting_turn_finds_the_answer_cached(served, tiny_model, tok):
    """`return_token_ids` (vLLM's extension) lists each token's id, streamed
    and not; an agent's next turn that quotes the answer finds its KV on the
    decoder that produced it: P computed only the prompt, the decoder's
    prefix cache kept the answer's full blocks (the last token is never
    computed), so fewer blocks cross to it than P computed."""
    dep, client, model = served
    p = ids(50, 200)
    want = generate_greedy(tiny_model[0], p, 40)
    kw = dict(model=model, prompt=p, max_tokens=40, temperature=0,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    r = client.completions.create(**kw)
    assert r.choices[0].model_extra["token_ids"] == want
    chunks = list(client.completions.create(stream=True, **kw))
    streamed = [i for c in chunks if c.choices for i in (c.choices[0].model_extra.get("token_ids") or [])]
    assert streamed == want
    assert all(len(c.choices[0].model_extra.get("token_ids") or []) <= 1 for c in chunks if c.choices)
    first = _trace(dep, r.id)
    nxt = p + want + ids(51, 10)
    r2 = complete(client, model, nxt, 8)
    assert r2.choices[0].text == expected(tiny_model, tok, nxt, 8)
    held = (200 + 40 - 1) // 16                 # 14 blocks: prompt and answer
    assert held > 200 // 16                     # more than P's 12
    tr = _trace(dep, r2.id)
    if dep.spec.mode == "colocated":
        assert r2.usage.prompt_tokens_details.cached_tokens == held * 16
        return
    assert r2.usage.prompt_tokens_details.cached_tokens == 200 // 16 * 16      # P's cache: the prompt
    decoder = {"pd-local": "d0", "pd-wan": "d0", "pdd": "md0"}[dep.spec.mode]
    if dep.spec.mode == "pdd" and "md" not in set(first.get("token_sources") or ["md"]):
        pytest.skip(f"the first turn ended on RLD ({first['pipeline']}): MD never saw its answer")
    sent = [e for e in tr["events"] if e["name"] == "kv_transfer" and e["target"] == decoder and e["ok"]]
    assert sent and sent[0]["blocks_skipped"] == held, sent
