"""Build deployment files for tests: free ports, a chosen model, any mode."""

from __future__ import annotations

import json
import random
import socket
import urllib.request
from contextlib import ExitStack
from pathlib import Path


def _ephemeral_start() -> int:
    """First port the kernel hands out to outgoing connections and bind(0)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


# Ports this test process has handed out: a deployment's servers bind them some time after the
# choice, so the choice must not collide with the kernel's ephemeral ports (an outgoing connection
# of any test may take one meanwhile: "address already in use" at start-up) nor with an earlier choice.
_handed_out: set[int] = set()


def free_port_run(n: int, start: int = 12000, end: int | None = None) -> int:
    """First port of n consecutive free ports, below the ephemeral range (the WAN relay maps base + k)."""
    end = min(end or _ephemeral_start(), _ephemeral_start())
    rng = random.Random()
    for _ in range(500):
        base = rng.randrange(start, end - n)
        run = range(base, base + n)
        if any(p in _handed_out for p in run):
            continue
        with ExitStack() as stack:
            try:
                for p in run:
                    s = stack.enter_context(socket.socket())
                    s.bind(("127.0.0.1", p))
            except OSError:
                continue
        _handed_out.update(run)
        return base
    raise RuntimeError("no run of free ports found")


def free_ports(n: int) -> list[int]:
    """n distinct free ports, each chosen as a run of one."""
    return [free_port_run(1) for _ in range(n)]


def _toml(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_toml(x)}" for k, x in v.items()) + " }"
    return str(v)


def deployment_toml(mode: str, model_dir: Path, wan_mbps: float = 80.0, latency_ms: float = 20.0,
                    policy: dict | None = None, engine: dict | None = None, timeouts: dict | None = None) -> str:
    """mode: colocated | pd-local | pd-wan | pdd."""
    ports = free_ports(12)
    roles = {
        "colocated": [("c0", "colocated", "A")],
        "pd-local": [("p0", "prefill", "A"), ("d0", "decode", "A")],
        "pd-wan": [("p0", "prefill", "A"), ("d0", "decode", "B")],
        "pdd": [("p0", "prefill", "A"), ("rld0", "relay", "A"), ("md0", "main", "B")],
    }[mode]
    eng = {"block_size": 16, "num_blocks": 512, "max_num_seqs": 16, "max_num_batched_tokens": 256} | (engine or {})
    lines = [f'name = "{mode}"', "", "[model]", f"path = {_toml(str(model_dir))}", "", "[engine]"]
    lines += [f"{k} = {_toml(v)}" for k, v in eng.items()]
    lines += ["", "[router]", f"port = {ports[0]}", 'datacenter = "A"']
    for k, (name, role, dc) in enumerate(roles):
        lines += ["", "[[instances]]", f'name = "{name}"', f'role = "{role}"', f'datacenter = "{dc}"',
                  f"port = {ports[1 + 2 * k]}", f"kv_port = {ports[2 + 2 * k]}"]
    if any(dc == "B" for _, _, dc in roles):
        lines += ["", "[[links]]", 'a = "A"', 'b = "B"', f"bandwidth_mbps = {wan_mbps}",
                  f"latency_ms = {latency_ms}", "jitter_ms = 2", "cost_per_hour = 0.1",
                  f"relay_port_base = {free_port_run(4)}", f"control_port = {ports[10]}"]
    if policy:
        lines += ["", "[policy]"] + [f"{k} = {_toml(v)}" for k, v in policy.items()]
    if timeouts:
        lines += ["", "[timeouts]"] + [f"{k} = {_toml(v)}" for k, v in timeouts.items()]
    return "\n".join(lines) + "\n"


def ids(seed: int, n: int) -> list[int]:
    """n token ids, seeded: the prompts of the deployment tests."""
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def run(dep, prompt: list[int], n: int, stream: bool = True, temperature: float = 0.0) -> tuple[str, dict]:
    """One completion (greedy unless `temperature`) through the router with
    the official `openai` client: (text, the router's trace of it)."""
    import openai

    client = openai.OpenAI(base_url=dep.router_url, api_key="x", max_retries=0, timeout=300)
    kw = dict(model=client.models.list().data[0].id, prompt=prompt, max_tokens=n, temperature=temperature,
              extra_body={"ignore_eos": True})
    if stream:
        chunks = list(client.completions.create(stream=True, **kw))
        text, rid = "".join(c.choices[0].text for c in chunks if c.choices), chunks[0].id
    else:
        r = client.completions.create(**kw)
        text, rid = r.choices[0].text, r.id
    with urllib.request.urlopen(f"{dep.router_url}/requests/{rid}/trace", timeout=30) as f:
        return text, json.loads(f.read())
