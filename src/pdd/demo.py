"""`pdd demo` (what `make demo` runs): a local PDD deployment on the embedded
SmolLM2, a conversation through the official openai client showing where each
token came from, then the quick side-by-side benchmark of all four modes."""

from __future__ import annotations

import argparse
import json
import time
import urllib.request
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

DOCUMENT = (
    "Incident report, storage cluster east-2. At 02:14 the replication lag on shard 7 rose from "
    "40 ms to 9 s after a rolling kernel update restarted three nodes at once. Writes kept flowing "
    "to the primary, but two read replicas served stale pages for eleven minutes. The on-call "
    "engineer paused the rollout at 02:21, drained the slow replica, and the lag recovered by "
    "02:25. Root cause: the update playbook did not wait for replica catch-up between batches. "
) * 6


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-c", "--config", default=str(EXAMPLES / "pdd.toml"))
    p.add_argument("--no-bench", action="store_true", help="skip the side-by-side benchmark")
    p.add_argument("--out", default="results/demo")


def _trace(router_url: str, rid: str) -> dict:
    with urllib.request.urlopen(f"{router_url}/requests/{rid}/trace", timeout=30) as f:
        return json.loads(f.read())


def _turn(client, model: str, router_url: str, messages: list[dict], max_tokens: int) -> str:
    t0 = time.time()
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                            temperature=0, stream=True)
    text, rid = "", None
    for c in stream:
        rid = rid or c.id
        if c.choices and c.choices[0].delta.content:
            text += c.choices[0].delta.content
    tr = _trace(router_url, rid)
    src = tr["token_sources"]
    n_rld, n_md = src.count("rld"), src.count("md")
    print(f"  assistant: {text.strip()[:300]}")
    print(f"  pipeline={tr['pipeline']} ({tr['pipeline_reason']}); prompt={tr['prompt_tokens']} tokens, "
          f"cached={tr['cached_tokens']}; TTFT={tr['ttft_s']:.2f}s; e2e={time.time() - t0:.2f}s")
    print(f"  tokens: {n_rld} from RelayDecode then {n_md} from MainDecode"
          + (f"; handoff {tr['handoff_mode']} in {tr['handoff_batches']} batch(es), stream gap "
             f"{tr['handoff_gap_s'] * 1e3:.0f} ms" if tr["handoff_gap_s"] is not None else "")
          + f"; WAN KV {tr['wan_bytes'] / 1e6:.1f} MB, local KV {tr['local_bytes'] / 1e6:.1f} MB")
    return text


def run(args: argparse.Namespace) -> int:
    import openai

    from pdd.deploy.launcher import Deployment

    print(f"== starting {args.config}")
    dep = Deployment.start(args.config)
    try:
        print(f"router: {dep.router_url}  (mode {dep.spec.mode}, {len(dep.spec.instances)} instances)")
        client = openai.OpenAI(base_url=dep.router_url, api_key="unused", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        messages = [{"role": "system", "content": "You are a concise site-reliability assistant."},
                    {"role": "user", "content": DOCUMENT + "\nSummarise the incident in two sentences."}]
        print("\n== turn 1: a long new document (low prefix hit: P -> RLD streams while the KV crosses the WAN)")
        answer = _turn(client, model, dep.router_url, messages, 96)
        messages += [{"role": "assistant", "content": answer},
                     {"role": "user", "content": "What one change would prevent it?"}]
        print("\n== turn 2: the follow-up (high prefix hit on P and, thanks to DRC, on MD: P -> MD directly)")
        _turn(client, model, dep.router_url, messages, 48)
    finally:
        dep.stop()
    if args.no_bench:
        return 0
    print("\n== side-by-side benchmark (quick agentic workload, all four modes, one after another)")
    from pdd.cli import main as pdd_main

    configs = [x for m in ("colocated", "pd-local", "pd-wan", "pdd") for x in ("-c", str(EXAMPLES / f"{m}.toml"))]
    return pdd_main(["bench", "--workload", "agentic", "--quick", "--out", args.out] + configs)
