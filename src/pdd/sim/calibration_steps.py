"""Reading what `pdd bench` recorded for the calibration (`pdd.sim.calibration`):
engine steps (`steps.jsonl`, each read with the `deploy.toml` beside it:
threads, role, core), which of a shared core's steps ran alone, and the
KV links' rates from the Prometheus text saved beside (metrics/*.prom)."""

from __future__ import annotations

import bisect
import itertools
import json
import re
from collections import Counter
from pathlib import Path


def role_group(role: str) -> str:
    """The calibration group of an instance role (deploy or policy spelling)."""
    role = str(getattr(role, "value", role))
    return role if role in ("prefill", "colocated") else "decode"


_PROM = re.compile(r"^(?P<name>pdd_kv_sent_bytes_total|pdd_kv_transfer_seconds_sum)"
                   r"\{(?P<labels>[^}]*)\}\s+(?P<value>\S+)$")
_LINK = re.compile(r'link="([^"]+)"')


def step_files(paths: list[Path]) -> list[Path]:
    """steps.jsonl files named directly or found under directories."""
    out: list[Path] = []
    for p in map(Path, paths):
        out += sorted(p.rglob("steps.jsonl")) if p.is_dir() else [p]
    if not out:
        raise ValueError(f"no steps.jsonl under {[str(p) for p in paths]}")
    return out


def _instances(steps_path: Path) -> dict[str, tuple[int, bool, str, int | None, int]]:
    """instance -> (engine threads, alone on its core, role group, core, nice), from the deploy.toml beside it."""
    deploy = steps_path.parent / "deploy.toml"
    if not deploy.is_file():
        return {}
    from pdd.deploy.spec import load_spec

    spec = load_spec(deploy)
    cores = Counter(i.cpu for i in spec.instances if i.cpu is not None)
    return {i.name: (i.engine.num_threads, i.cpu is None or cores[i.cpu] == 1, role_group(i.role), i.cpu, i.nice)
            for i in spec.instances}


def _mark_unshared_steps(recs: list[dict], core_of: dict[str, int | None], nice_of: dict[str, int]) -> None:
    """A step of an instance that shares its core counts as alone when no
    step of its neighbours overlapped it (by the steps' wall-clock starts);
    one that did gains "overlap_s", the seconds its neighbours' steps ran
    during it, and "share", what the kernel gives it of the core while its
    neighbours run too (by their nice values, `link.cfs_weight`: 1/2 for two
    of equal priority)."""
    from pdd.sim.link import cfs_weight

    weight = {n: cfs_weight(nice_of.get(n, 0)) for n in core_of}
    spans: dict[int, list[tuple[float, float, str]]] = {}
    for r in recs:
        core = core_of.get(r["name"])
        if core is not None and r.get("start_s"):
            spans.setdefault(core, []).append((r["start_s"], r["start_s"] + r["wall_s"], r["name"]))
    for core, items in spans.items():
        items.sort()
        undecided: dict[str, list[dict]] = {}     # per instance on this core
        for r in recs:
            if r["alone"] or core_of.get(r["name"]) != core or not r.get("start_s"):
                continue
            undecided.setdefault(r["name"], []).append(r)
        for name, mine in undecided.items():
            others = [(s, e) for s, e, n in items if n != name]     # sorted by start
            rest = sum(weight[n] for n, c in core_of.items() if c == core and n != name)
            share = weight[name] / (weight[name] + rest) if rest else 1.0
            starts = [s for s, _ in others]
            latest_end = list(itertools.accumulate((e for _, e in others), max))
            for r in mine:
                a, b = r["start_s"], r["start_s"] + r["wall_s"]
                j = bisect.bisect_left(starts, b)          # neighbours' steps starting before b
                r["alone"] = j == 0 or latest_end[j - 1] <= a
                overlap = 0.0
                while j > 0 and latest_end[j - 1] > a:     # back to the first that ends after a
                    j -= 1
                    overlap += max(0.0, min(b, others[j][1]) - max(a, others[j][0]))
                r["overlap_s"] = overlap
                r["share"] = share


def read_records(paths: list[Path]) -> list[dict]:
    """Every step record under `paths`, each with "run" (its folder),
    "instance" ("run/name"), "alone", "group" (its instance's role group)
    and "threads"."""
    out: list[dict] = []
    for f in step_files(paths):
        info = _instances(f)
        tag = f.parent.name
        recs = []
        for line in f.read_text().splitlines():
            if not line.strip():
                continue
            rec = json.loads(line)
            name = rec.get("instance")
            threads, solo, group = info.get(name, (1, True, role_group(rec.get("role", "decode"))))[:3]
            rec.update(run=tag, name=name, instance=f"{tag}/{name}", alone=solo, group=group,
                       threads=threads)
            recs.append(rec)
        _mark_unshared_steps(recs, {n: v[3] for n, v in info.items() if not v[1]},
                             {n: v[4] for n, v in info.items()})
        out += recs
    return out


def load_records(recs: list[dict]) -> dict[int, list[dict]]:
    """Step records (`read_records`) grouped by thread count, those of
    shared-core instances that overlapped a neighbour only as a last resort."""
    alone: dict[int, list[dict]] = {}
    shared: dict[int, list[dict]] = {}
    for rec in recs:
        (alone if rec["alone"] else shared).setdefault(rec["threads"], []).append(rec)
    return {t: alone.get(t) or shared[t] for t in sorted(set(alone) | set(shared))}


def transfer_rates(paths: list[Path]) -> dict[str, dict[str, float]]:
    """{run: {link: bytes/s}} from the prefill instances' Prometheus text."""
    totals: dict[str, dict[str, list[float]]] = {}
    for f in step_files(paths):
        for prom in sorted((f.parent / "metrics").glob("*.prom")):
            for line in prom.read_text().splitlines():
                m = _PROM.match(line)
                if m is None or 'role="prefill"' not in m["labels"]:
                    continue
                link = _LINK.search(m["labels"])
                if link is None:
                    continue
                k = 0 if m["name"] == "pdd_kv_sent_bytes_total" else 1
                for run in (f.parent.name, "all"):
                    totals.setdefault(run, {}).setdefault(link[1], [0.0, 0.0])[k] += float(m["value"])
    return {run: {link: b / s for link, (b, s) in links.items() if b > 0 and s > 0}
            for run, links in totals.items()}


# A handshake slower than this waited for something the simulator models
# itself (the receiver holds HAVE while another transfer brings the same
# blocks, `kv_arrivals._wait_for_siblings`): left out of the line's excess.
HANDSHAKE_SIBLING_S = 1.0


def handshake_queues(paths: list[Path]) -> dict[str, dict[str, float]]:
    """{run: {"wan": bytes}}: how far the WAN's handshakes (BEGIN -> HAVE, as
    P's sender timed them in records.jsonl) ran past the line's nominal round
    trip (2 x latency + jitter, the simulator's), on average, expressed as
    bytes at the line's rate; "all" pools the runs, weighted by transfers.

    Measured on the AMD EPYC (wan-bound-55..57 at 24 Mbit/s): the handshakes
    took 73 ms on average against a nominal 45 ms, 47-51 ms at 96 Mbit/s:
    about the same bytes (~85 KB) of other transfers ahead of the small
    BEGIN and HAVE frames in the relay's buffers, which the simulator's
    line holds only while a flow keeps it full (`Link.queue_s`)."""
    from pdd.deploy.spec import load_spec
    from pdd.measure.files import read_records as read_requests
    from pdd.sim.deployment import line_rtt_ms

    sums: dict[str, list[float]] = {}
    for f in step_files(paths):
        deploy, recs = f.parent / "deploy.toml", f.parent / "records.jsonl"
        if not deploy.is_file() or not recs.is_file():
            continue
        extra = f.parent / "overrides.json"          # a run's --wan-mbps, say
        links = load_spec(deploy, json.loads(extra.read_text()) if extra.is_file() else None).links
        if len(links) != 1:
            continue
        line = links[0]
        rate = line.bandwidth_mbps * 1e6 / 8
        nominal = line_rtt_ms(line) / 1e3
        for req in read_requests(recs):
            for ev in req.events:
                h = ev.get("handshake_s")
                if ev.get("name") != "kv_transfer" or ev.get("link") != "wan" or not h or h >= HANDSHAKE_SIBLING_S:
                    continue
                for run in (f.parent.name, "all"):
                    acc = sums.setdefault(run, [0.0, 0.0])
                    acc[0] += (h - nominal) * rate
                    acc[1] += 1
    return {run: {"wan": max(b / n, 0.0)} for run, (b, n) in sums.items() if n}
