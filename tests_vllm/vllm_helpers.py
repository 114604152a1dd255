"""What the vLLM suite's deployment tests share: the engine table and a greedy completion."""

from __future__ import annotations

import json
import time
import urllib.request

VLLM_ENGINE = {"backend": "vllm", "block_size": 32, "num_blocks": 512, "max_num_seqs": 16,
               "max_num_batched_tokens": 512}


def complete(client, model, prompt, n, stream=False):
    """A greedy completion with the official client (streamed: the chunks, usage included)."""
    kw = dict(model=model, prompt=prompt, max_tokens=n, temperature=0, extra_body={"ignore_eos": True})
    if not stream:
        return client.completions.create(**kw)
    return list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))


def stats(dep, name: str) -> dict:
    """An instance's /internal/stats (signed as the router signs)."""
    from pdd.server.http_auth import sign

    base, ctx = dep.instance_url(name)        # https with the router's certificate across datacenters
    path = "/internal/stats"
    req = urllib.request.Request(base + path, headers=sign(dep.keys.internal_http, "GET", path, name, b""))
    with urllib.request.urlopen(req, timeout=10, context=ctx) as r:
        return json.loads(r.read())


def wait_for_stat(dep, name: str, key: str, at_least: int, timeout_s: float = 30.0) -> dict:
    """Poll an instance's stats until `key` reaches `at_least` (bounded); the last stats."""
    deadline = time.monotonic() + timeout_s
    while True:
        s = stats(dep, name)
        if s[key] >= at_least or time.monotonic() > deadline:
            return s
        time.sleep(0.2)
