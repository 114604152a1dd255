"""The public API never answers 5xx, whatever the input, and every 4xx is
OpenAI-style JSON. Hypothesis draws bodies over the request schema (each
field either well-typed or any JSON at all) and mutates valid bodies byte by
byte; both are sent over real TCP to a real router in front of a real
instance (tiny random Llama, 128-token context so that valid requests stay
short). Plus the inputs that once made a 500, one by one, and a poisoned
batch over HTTP."""

from __future__ import annotations

import copy
import http.client
import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deploy_helpers import deployment_toml
from pdd.deploy.launcher import Deployment

MAX_MODEL_LEN = 128
FUZZ = settings(max_examples=400, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture(scope="module")
def router(tiny_model_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz")
    path = d / "colocated.toml"
    path.write_text(deployment_toml("colocated", tiny_model_dir, engine={"max_model_len": MAX_MODEL_LEN}))
    dep = Deployment.start(path, run_dir=d / "run", timeout_s=180)
    api = Api(dep.spec.router_host, dep.spec.router_port)
    status, models = api.send("GET", "/v1/models")
    yield api, models["data"][0]["id"]
    api.close()
    dep.stop()


class Api:
    """A raw HTTP/1.1 client: sends bytes exactly as given."""

    def __init__(self, host: str, port: int):
        self.host, self.port, self.conn = host, port, None

    def send(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
        for attempt in range(2):
            if self.conn is None:
                self.conn = http.client.HTTPConnection(self.host, self.port, timeout=60)
            try:
                self.conn.request(method, path, body, {"Content-Type": "application/json", **(headers or {})})
                r = self.conn.getresponse()
                raw = r.read()
                break
            except (ConnectionError, http.client.HTTPException):
                self.close()
                if attempt:
                    raise
        if r.getheader("Content-Type", "").startswith("text/event-stream"):
            return r.status, raw
        return r.status, json.loads(raw)

    def close(self):
        if self.conn is not None:
            self.conn.close()
            self.conn = None


def check(status: int, body, sent=None) -> None:
    assert status < 500, (status, body, sent)
    if status >= 400:
        assert isinstance(body, dict) and set(body) == {"error"}, (status, body, sent)
        err = body["error"]
        assert isinstance(err["message"], str) and err["message"], (body, sent)
        assert isinstance(err["type"], str) and "param" in err and "code" in err, (body, sent)
    elif isinstance(body, bytes):                           # a 200 stream: ends well, no error inside
        events = [line[6:] for line in body.decode().split("\n\n") if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", (body[-200:], sent)
        assert not any('"error"' in e[:12] for e in events), (body[-300:], sent)
    else:
        assert body["choices"] and body["usage"]["completion_tokens"] >= 0, (body, sent)


# -- strategies over the request schema --------------------------------------
leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2 ** 70), 2 ** 70), st.floats(allow_nan=False),
                 st.text(max_size=12))
any_json = st.recursive(leaf, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
                        max_leaves=8)
odd_text = st.text(st.characters(categories=["Cs", "Cc", "Lo", "So", "Zs"]), max_size=8)
text = st.one_of(st.text(max_size=40), odd_text, st.sampled_from(["\ud800", "a\udfffb", "{{ x }}", "<|im_end|>"]))


def field(good):
    return st.one_of(good, good, any_json)


max_tokens = st.one_of(st.integers(-2, 6), st.integers(MAX_MODEL_LEN - 4, MAX_MODEL_LEN + 4),
                       st.integers(10 ** 9, 10 ** 30))
common = {
    "max_tokens": field(max_tokens),
}
optional = {
    "temperature": field(st.one_of(st.floats(0, 3), st.sampled_from([1e-300, 1e-5, 100.0, 101.0, -0.0, -1.0]),
                                   st.integers(-2, 2 ** 1100))),
    "top_p": field(st.one_of(st.floats(0, 1.5), st.sampled_from([1e-300, 5e-324, 1.0]))),
    "seed": field(st.integers(-(2 ** 80), 2 ** 80)),
    "stop": field(st.one_of(text, st.lists(text, max_size=5))),
    "stream": field(st.booleans()),
    "stream_options": field(st.fixed_dictionaries({}, optional={"include_usage": field(st.booleans())})),
    "n": field(st.integers(0, 3)),
    "ignore_eos": field(st.booleans()),
    "logprobs": field(st.one_of(st.booleans(), st.integers(0, 5))),
    "echo": field(st.booleans()),
    "best_of": field(st.integers(0, 3)),
    "user": any_json,
}
token_ids = st.lists(st.one_of(st.integers(0, 49151), st.integers(-3, 2 ** 40)), max_size=20)
prompt = st.one_of(text, token_ids, st.lists(text, min_size=1, max_size=2), st.lists(token_ids, max_size=2),
                   st.lists(st.integers(100, 200), min_size=MAX_MODEL_LEN - 2, max_size=MAX_MODEL_LEN + 2))
part = st.fixed_dictionaries({"type": field(st.sampled_from(["text", "image_url"])), "text": field(text)})
message = st.fixed_dictionaries(
    {"role": field(st.sampled_from(["system", "user", "assistant", "tool", "developer", "robot"]))},
    optional={"content": field(st.one_of(text, st.lists(part, max_size=3))), "name": any_json})


def completion_body(model: str):
    return st.fixed_dictionaries({"model": field(st.just(model)), "prompt": field(prompt), **common},
                                 optional=optional)


def chat_body(model: str):
    return st.fixed_dictionaries({"model": field(st.just(model)), "messages": field(st.lists(message, max_size=3)),
                                  **common}, optional={**optional, "max_completion_tokens": field(max_tokens)})


# Well-formed bodies: every one must be answered 200.
good_text = st.text(st.characters(exclude_categories=["Cs"]), min_size=1, max_size=30)
good_max_tokens = st.integers(1, 6)
good = {
    "temperature": st.one_of(st.floats(0, 2), st.sampled_from([0, 1e-300, 1e-5, 100.0])),
    "top_p": st.one_of(st.floats(1e-6, 1), st.sampled_from([1e-300, 5e-324, 1])),
    "seed": st.integers(-(2 ** 63), 2 ** 80),
    "stop": st.one_of(good_text, st.lists(good_text, min_size=1, max_size=4)),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "ignore_eos": st.booleans(),
}


def good_body(model: str, chat: bool):
    if chat:
        msg = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "developer"]),
                                     "content": st.one_of(good_text, st.lists(st.fixed_dictionaries(
                                         {"type": st.just("text"), "text": good_text}), min_size=1, max_size=2))})
        return st.fixed_dictionaries({"model": st.just(model), "messages": st.lists(msg, min_size=1, max_size=2),
                                      "max_tokens": good_max_tokens}, optional=good)
    words = st.text(st.characters(categories=["L", "N", "P"]), min_size=1, max_size=30)   # never tokenizes to nothing
    p = st.one_of(words, st.lists(st.integers(0, 49151), min_size=1, max_size=30))
    return st.fixed_dictionaries({"model": st.just(model), "prompt": p, "max_tokens": good_max_tokens},
                                 optional=good)


def nested(depth: int):
    v = []
    for _ in range(depth):
        v = [v]
    return v


bad_text = st.builds(lambda a, s, b: a + s + b, st.text(max_size=4), st.sampled_from(["\ud800", "\udfff", "\udbff"]),
                     st.text(max_size=4))
edge = st.one_of(any_json, st.text(max_size=10), bad_text, st.sampled_from(
    [None, "", -1, 0, 2 ** 64, 10 ** 400, 1e-300, -1e-300, 1e308, [], {}, nested(40), True, False]))


def paths(v, at=()):
    """Every place in a JSON value: the keys and indices that lead to it."""
    yield at
    if isinstance(v, dict):
        for k, x in v.items():
            yield from paths(x, at + (k,))
    elif isinstance(v, list):
        for i, x in enumerate(v):
            yield from paths(x, at + (i,))


def _at(v, path):
    for k in path:
        v = v[k]
    return v


def spoil(body: dict, data) -> dict:
    """Break one to three places of a well-formed body (replace, drop, add)."""
    for _ in range(data.draw(st.integers(1, 3))):
        places = [p for p in paths(body) if p]
        leaves = [p for p in places if not isinstance(_at(body, p), (dict, list))]
        at = data.draw(st.sampled_from(leaves if leaves and data.draw(st.integers(0, 3)) else places))
        parent = body
        for k in at[:-1]:
            parent = parent[k]
        how = data.draw(st.sampled_from(["replace", "replace", "drop", "add"]))
        # copies: sampled_from hands out the same list each time, and it must stay as it was
        if how == "replace":
            parent[at[-1]] = copy.deepcopy(data.draw(edge))
        elif how == "drop":
            del parent[at[-1]]
        elif isinstance(parent, dict):
            parent[data.draw(st.text(max_size=8))] = copy.deepcopy(data.draw(edge))
        else:
            parent.append(copy.deepcopy(data.draw(edge)))
    return body


def test_schema_fuzz_never_5xx(router):
    api, model = router
    counts = {}

    @FUZZ
    @given(chat=st.booleans(), kind=st.sampled_from(["good", "spoiled", "spoiled", "random"]), data=st.data())
    def one(chat, kind, data):
        if kind == "random":
            body = data.draw(chat_body(model) if chat else completion_body(model))
        else:
            body = data.draw(good_body(model, chat))
            if kind == "spoiled":
                body = spoil(body, data)
        raw = json.dumps(body).encode()         # lone surrogates travel as \ud800 escapes, as a client sends them
        status, resp = api.send("POST", "/v1/chat/completions" if chat else "/v1/completions", raw)
        check(status, resp, raw[:300])
        if kind == "good":
            assert status == 200, (raw[:300], resp)
        counts[status] = counts.get(status, 0) + 1

    one()
    assert counts.get(200, 0) >= 30 and sum(v for k, v in counts.items() if 400 <= k < 500) >= 60, counts


# -- byte-level mutations of valid bodies --------------------------------------
def valid_bodies(model: str) -> list[tuple[str, bytes]]:
    c = {"model": model, "prompt": "Hello there", "max_tokens": 3, "temperature": 0.5, "seed": 1,
         "stop": ["\n"], "stream": False}
    s = {"model": model, "messages": [{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
         "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
    return [("/v1/completions", json.dumps(c).encode()), ("/v1/chat/completions", json.dumps(s).encode()),
            ("/v1/completions", json.dumps(c | {"prompt": [5, 6, 7, 8]}).encode())]


def mutate(raw: bytes, data) -> bytes:
    b = bytearray(raw)
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "set", "insert", "delete", "dup", "nest", "truncate", "token"]))
        i = data.draw(st.integers(0, max(len(b) - 1, 0)))
        if op == "flip" and b:
            b[i] ^= 1 << data.draw(st.integers(0, 7))
        elif op == "set" and b:
            b[i] = data.draw(st.integers(0, 255))
        elif op == "insert":
            b[i:i] = data.draw(st.binary(min_size=1, max_size=6))
        elif op == "delete":
            del b[i:i + data.draw(st.integers(1, 8))]
        elif op == "dup":
            b[i:i] = b[i:i + data.draw(st.integers(1, 40))]
        elif op == "nest":
            n = data.draw(st.sampled_from([33, 1000, 100_000]))
            b[i:i] = b"[" * n + b"]" * n
        elif op == "truncate":
            del b[i:]
        else:
            b[i:i] = data.draw(st.sampled_from([b"NaN", b"-Infinity", b'"\\ud800"', b"1e999", b"null", b"\\u0000",
                                                b"99999999999999999999999", b'"', b"\xff\xfe", b"\xed\xa0\x80"]))
    return bytes(b)


def test_byte_mutation_fuzz_never_5xx(router):
    api, model = router
    bodies = valid_bodies(model)
    counts = {}

    @FUZZ
    @given(k=st.integers(0, len(bodies) - 1), data=st.data())
    def one(k, data):
        path, raw = bodies[k]
        sent = mutate(raw, data)
        status, resp = api.send("POST", path, sent)
        check(status, resp, sent[:300])
        counts[status] = counts.get(status, 0) + 1

    one()
    assert sum(v for k, v in counts.items() if 400 <= k < 500) >= 50, counts


# -- the inputs that once made a 500 -------------------------------------------
def test_known_bad_inputs_get_openai_4xx(router):
    api, model = router
    deep = b'{"model": "%s", "prompt": ' % model.encode() + b"[" * 1000 + b"]" * 1000 + b"}"
    cases = [
        ("/v1/completions", deep, 400, "nests deeper"),
        ("/v1/completions", b"[" * 100_000, 400, "nests deeper"),
        ("/v1/completions", json.dumps({"model": model, "prompt": "\ud800"}).encode(), 400, "not valid Unicode"),
        ("/v1/chat/completions", json.dumps({"model": model, "messages": [
            {"role": "user", "content": [{"type": "text", "text": 5}]}]}).encode(), 400, "text must be a string"),
        ("/v1/chat/completions", json.dumps({"model": model, "messages": [
            {"role": "user", "content": [{"type": "text", "text": ["a"]}]}]}).encode(), 400, "text must be"),
        ("/v1/chat/completions", json.dumps({"model": model, "messages": [
            {"role": ["user"], "content": "x"}]}).encode(), 400, "role"),
        ("/v1/completions", b'{"model": "%s", "prompt": "x", "temperature": NaN}' % model.encode(), 400, "NaN"),
        ("/v1/completions", json.dumps({"model": model, "prompt": "x", "temperature": 10 ** 400}).encode(), 400,
         "temperature"),
        ("/v1/completions", json.dumps({"model": model, "prompt": "x", "top_p": 1e-300, "temperature": 1e-300,
                                        "max_tokens": 1}).encode(), 200, None),
        ("/v1/completions", b"\xff\xfe{}", 400, "UTF-8"),
    ]
    for path, raw, want, text in cases:
        status, resp = api.send("POST", path, raw)
        check(status, resp, raw[:120])
        assert status == want, (raw[:120], status, resp)
        if text:
            assert text in resp["error"]["message"], resp
    # max_tokens past the context: 400 with vLLM's numbers, not a silent clamp
    status, resp = api.send("POST", "/v1/completions",
                            json.dumps({"model": model, "prompt": [5, 6, 7], "max_tokens": 10 ** 9}).encode())
    assert status == 400 and resp["error"]["code"] == "context_length_exceeded"
    assert resp["error"]["message"] == (
        f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, you requested "
        f"{3 + 10 ** 9} tokens (3 in the messages, {10 ** 9} in the completion). "
        f"Please reduce the length of the messages or completion.")
    status, resp = api.send("POST", "/v1/completions", json.dumps(
        {"model": model, "prompt": [5] * 100, "max_tokens": MAX_MODEL_LEN - 100}).encode())
    assert status == 200 and resp["usage"]["completion_tokens"] <= MAX_MODEL_LEN - 100   # exactly fits
    # aiohttp's own errors are JSON too
    for method, path, want in (("GET", "/v1/completions", 405), ("POST", "/v1/nothing", 404), ("GET", "/x", 404)):
        status, resp = api.send(method, path, b"{}" if method == "POST" else None)
        assert status == want and resp["error"]["message"], (method, path, status, resp)


def test_poisoned_requests_over_http_leave_neighbours_unchanged(router):
    api, model = router

    def ask(extra: dict):
        a = Api(api.host, api.port)
        try:
            return a.send("POST", "/v1/completions", json.dumps(
                {"model": model, "prompt": [100 + k for k in range(20)], "max_tokens": 12, "ignore_eos": True}
                | extra).encode())
        finally:
            a.close()

    alone = ask({"temperature": 0, "prompt": [300, 301, 302]})[1]["choices"][0]["text"]
    poison = [{"temperature": 1e-300}, {"top_p": 1e-300, "temperature": 1.0}, {"top_p": 5e-324, "temperature": 100}]
    jobs = [{"temperature": 0, "prompt": [300, 301, 302]}] * 4 + poison * 2
    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(ask, jobs))
    assert all(s == 200 for s, _ in got), got
    assert [r["choices"][0]["text"] for _, r in got[:4]] == [alone] * 4
    assert all(r["usage"]["completion_tokens"] == 12 for _, r in got)
