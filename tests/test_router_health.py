"""The router's /health is 503 while a role has no live instance (and says
which), 200 otherwise, even when degraded; a request that no live instance
can serve is a clear 503, not a failed dispatch; the trace store is an LRU
bounded by count (`[router] max_traces`)."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request

import pytest

from deploy_helpers import deployment_toml
from pdd.deploy.spec import parse_spec
from pdd.policy import PolicyConfig
from pdd.server.cluster import Cluster
from pdd.server.router import health_report, unserviceable_roles
from pdd.server.trace import RequestTrace, TraceStore


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_trace_store_is_lru_by_count():
    store = TraceStore(3)
    for k in range(3):
        store.add(RequestTrace(f"r{k}", "pdd", 1))
    assert store.get("r0") is not None              # r0 read: r1 is now the least recently used
    store.add(RequestTrace("r3", "pdd", 1))
    assert store.get("r1") is None and len(store) == 3
    assert all(store.get(f"r{k}") for k in (0, 2, 3))
    for k in range(4, 1000):
        store.add(RequestTrace(f"r{k}", "pdd", 1))
    assert len(store) == 3
    with pytest.raises(ValueError):
        TraceStore(0)


def test_health_report_names_roles_without_a_live_instance():
    doc = {"instances": [
        {"name": "p0", "role": "prefill", "port": 9001, "kv_port": 9002},
        {"name": "p1", "role": "prefill", "port": 9003, "kv_port": 9004},
        {"name": "d0", "role": "decode", "port": 9005, "kv_port": 9006}]}
    cluster = Cluster(parse_spec(doc), None, PolicyConfig())
    m = cluster.members
    assert health_report(cluster, "pd-local") == (
        {"status": "ok", "mode": "pd-local", "down": [], "roles_without_live_instance": []}, 200)
    m["p0"].healthy = False                         # degraded, but every role still has a live instance
    body, status = health_report(cluster, "pd-local")
    assert status == 200 and body["status"] == "degraded" and body["down"] == ["p0"]
    m["d0"].healthy = False
    body, status = health_report(cluster, "pd-local")
    assert status == 503 and body["status"] == "unavailable"
    assert body["roles_without_live_instance"] == ["decode"] and body["down"] == ["d0", "p0"]
    m["p1"].healthy = False
    assert health_report(cluster, "pd-local")[0]["roles_without_live_instance"] == ["decode", "prefill"]
    assert unserviceable_roles(cluster, "pd-local") == ["decode", "prefill"]


def test_pdd_serves_while_either_decoder_lives():
    doc = {"instances": [
        {"name": "p0", "role": "prefill", "port": 9001, "kv_port": 9002},
        {"name": "rld0", "role": "relay", "port": 9003, "kv_port": 9004},
        {"name": "md0", "role": "main", "datacenter": "B", "port": 9005, "kv_port": 9006}],
        "links": [{"a": "A", "b": "B"}]}
    cluster = Cluster(parse_spec(doc), None, PolicyConfig())
    m = cluster.members
    m["md0"].healthy = False
    assert unserviceable_roles(cluster, "pdd") == []                  # RLD carries it alone
    body, status = health_report(cluster, "pdd")
    assert status == 503 and body["roles_without_live_instance"] == ["main"]   # but the operator is told
    m["rld0"].healthy = False
    assert unserviceable_roles(cluster, "pdd") == ["main", "relay"]
    m["md0"].healthy = m["rld0"].healthy = True
    m["p0"].healthy = False
    assert unserviceable_roles(cluster, "pdd") == ["prefill"]


def test_health_503_after_kill_and_bounded_traces_over_a_real_deployment(tiny_model_dir, tmp_path):
    from pdd.deploy.launcher import Deployment

    path = tmp_path / "pd-local.toml"
    path.write_text(deployment_toml("pd-local", tiny_model_dir))
    dep = Deployment.start(path, overrides={"router": {"max_traces": 3}}, run_dir=tmp_path / "run", timeout_s=180)
    try:
        base = dep.router_url.removesuffix("/v1")
        assert _get(base + "/health") == (200, {"status": "ok", "mode": "pd-local", "down": [],
                                                "roles_without_live_instance": []})
        ids = []
        for k in range(5):
            code, r = _post(dep.router_url + "/completions",
                            {"model": "tiny", "prompt": [5 + k, 6, 7], "max_tokens": 2})
            assert code == 200, r
            ids.append(r["id"])
            if k == 2:
                assert _get(f"{dep.router_url}/requests/{ids[0]}/trace")[0] == 200   # read: most recent now
        codes = [_get(f"{dep.router_url}/requests/{i}/trace")[0] for i in ids]
        assert codes == [200, 404, 404, 200, 200], codes
        d0 = next(p for p in dep.procs if p.name == "d0")
        os.killpg(d0.pid, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while True:
            code, body = _get(base + "/health")
            if code == 503 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert code == 503, body
        assert body["roles_without_live_instance"] == ["decode"] and body["down"] == ["d0"]
        assert body["status"] == "unavailable"
        code, err = _post(dep.router_url + "/completions", {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2})
        assert code == 503 and err["error"]["code"] == "service_unavailable" and "decode" in err["error"]["message"]
    finally:
        dep.stop()
