"""`pdd up` restarts a dead instance with bounded exponential backoff, and
the router routes to it again once it answers: kill -9 of P (then of D),
new requests succeed within 30 s."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request

from deploy_helpers import deployment_toml
from pdd.deploy.launcher import Deployment, _alive
from pdd.deploy.supervisor import RestartPolicy, Watch, WatchState


def test_backoff_doubles_is_bounded_resets_when_stable_and_gives_up():
    pol = RestartPolicy(base_s=1.0, max_delay_s=5.0, stable_s=10.0, max_failures=4)
    assert [pol.delay_s(k) for k in range(1, 6)] == [1.0, 2.0, 4.0, 5.0, 5.0]
    w = Watch("p0", pol, up_since_s=0.0)
    assert not w.on_poll(True, 1.0)
    assert not w.on_poll(False, 2.0) and w.state == WatchState.WAITING     # died: wait 1 s
    assert not w.on_poll(False, 2.5)
    assert w.on_poll(False, 3.0) and w.state == WatchState.UP               # respawn
    assert not w.on_poll(False, 3.5) and w.restart_at_s == 5.5              # died again at once: 2 s
    assert w.on_poll(False, 5.5)
    assert not w.on_poll(True, 20.0) and w.failures == 0                    # stable for 10 s: forgiven
    assert not w.on_poll(False, 21.0) and w.restart_at_s == 22.0
    t = 22.0
    for _ in range(4):                                                      # a crash loop
        while not w.on_poll(False, t):
            t += 0.5
        t += 0.1
    assert not w.on_poll(False, t) and w.state == WatchState.GAVE_UP and w.restarts == 6
    assert not w.on_poll(False, t + 1000)


def _complete(url: str) -> int:
    body = json.dumps({"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 3}).encode()
    req = urllib.request.Request(url + "/completions", body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


def test_killed_prefill_instance_is_restarted_and_serves_within_30s(tiny_model_dir, tmp_path):
    path = tmp_path / "pd-local.toml"
    path.write_text(deployment_toml("pd-local", tiny_model_dir))
    dep = Deployment.start(path, run_dir=tmp_path / "run", timeout_s=180,
                           supervise=RestartPolicy(base_s=0.5, max_delay_s=4.0))
    try:
        assert _complete(dep.router_url) == 200
        p0 = next(p for p in dep.procs if p.name == "p0")
        old = p0.pid
        os.killpg(old, signal.SIGKILL)
        killed = time.monotonic()
        status = 0
        while time.monotonic() - killed < 30:
            status = _complete(dep.router_url)
            if status == 200:
                break
            time.sleep(0.5)
        took = time.monotonic() - killed
        assert status == 200, f"no answer {took:.1f} s after kill -9 of p0"
        assert p0.pid != old and _alive(p0.pid)
        recorded = json.loads((dep.run_dir / "pids.json").read_text())["procs"]
        assert {p["name"]: p["pid"] for p in recorded}["p0"] == p0.pid   # `pdd down` stops the new one
        assert all(_complete(dep.router_url) == 200 for _ in range(3))
        assert "restarted by pdd up" in p0.log.read_text()
        print(f"p0 back and serving {took:.1f} s after kill -9")
        # the decoder too: P's KV sender must reach the new process
        d0 = next(p for p in dep.procs if p.name == "d0")
        os.killpg(d0.pid, signal.SIGKILL)
        killed = time.monotonic()
        while time.monotonic() - killed < 30 and _complete(dep.router_url) != 200:
            time.sleep(0.5)
        took = time.monotonic() - killed
        assert took < 30 and all(_complete(dep.router_url) == 200 for _ in range(3))
        print(f"d0 back and serving {took:.1f} s after kill -9")
    finally:
        new = next((p.pid for p in dep.procs if p.name == "p0"), None)
        dep.stop()
    assert new is not None and not _alive(new)
