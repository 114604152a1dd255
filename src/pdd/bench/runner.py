"""Run one workload against several deployments, one after another.

For each mode: start its deployment (blocks until healthy), send `warmup`
short unrelated requests, send the workload (same seed, same token ids for
every mode), save what the simulator needs to replay the run (`<mode>/steps.jsonl`: every
instance's engine steps; `<mode>/deploy.toml`: the deployment file), stop the
deployment, write the mode's records.jsonl. Then write summary.json, the plots
and report.md under `out`; `out/workload.json` holds the workload itself.
Each mode's summary also carries `cpu_s`: the CPU seconds every process of
the deployment (instances, router, WAN relay) and the bench client used
while the workload ran.

Deployments come from `pdd.deploy.launcher.Deployment.start(config_path,
overrides, run_dir)`; tests pass a fake factory with the same shape. An
ablation is the base deployment with a policy override, named `<base>+<ablation>`.
"""

from __future__ import annotations

import json
import os
import ssl
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from pdd.bench.client import ClientConfig, run_workload_sync
from pdd.deploy.spec import link_overrides
from pdd.measure.files import save_workload, write_json, write_records
from pdd.measure.metrics import Sla, summarize_mode
from pdd.measure.records import RequestRecord
from pdd.measure.step_speed import read_step_shapes
from pdd.measure.workload import Workload, hit_rate_histogram, warmup_requests

ABLATIONS: dict[str, dict] = {
    "no-drc": {"policy": {"enable_drc": False}},
    "one-shot": {"policy": {"handoff_mode": "one_shot"}},
    "catch-up": {"policy": {"handoff_mode": "catch_up"}},
    "no-filter": {"policy": {"enable_filter": False}},
}


@dataclass(frozen=True)
class ModeSpec:
    name: str
    config_path: str
    overrides: dict | None = None


def plan_modes(configs: list[str], ablations: list[str] | None = None,
               wan_mbps: float | None = None) -> list[ModeSpec]:
    """One mode per config file, then one per ablation.

    An ablation is `NAME` (applied to the config whose stem starts with "pdd",
    else the last one) or `BASE:NAME` (applied to the config with stem BASE).
    `wan_mbps` overrides every mode's line rate.
    """
    links = link_overrides(wan_mbps)
    modes = [ModeSpec(Path(c).stem, str(c), links) for c in configs]
    names = [m.name for m in modes]
    if len(set(names)) != len(names):
        raise ValueError(f"two configs share a file stem: {names}")
    for item in ablations or []:
        base_name, _, abl = item.rpartition(":")
        if abl not in ABLATIONS:
            raise ValueError(f"unknown ablation {abl!r}; choose from {sorted(ABLATIONS)}")
        if base_name:
            base = next((m for m in modes if m.name == base_name), None)
            if base is None:
                raise ValueError(f"ablation base {base_name!r} is not among the configs")
        else:
            if not modes:
                raise ValueError("an ablation needs a base config (-c)")
            base = next((m for m in modes if m.name.startswith("pdd")), modes[-1])
        modes.append(ModeSpec(f"{base.name}+{abl}", base.config_path, {**ABLATIONS[abl], **(links or {})}))
    return modes


class Progress:
    """tqdm when installed, else a printed counter."""

    def __init__(self, total: int, desc: str) -> None:
        self.total, self.desc, self.n = total, desc, 0
        try:
            from tqdm import tqdm
            self._bar = tqdm(total=total, desc=desc, unit="req", file=sys.stderr)
        except ImportError:
            self._bar = None

    def update(self, record: RequestRecord) -> None:
        self.n += 1
        if self._bar is not None:
            self._bar.update(1)
        elif self.n == self.total or self.n % max(1, self.total // 10) == 0:
            print(f"{self.desc}: {self.n}/{self.total}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _default_factory() -> Callable:
    from pdd.deploy.launcher import Deployment
    return Deployment.start


def run_mode(spec: ModeSpec, workload: Workload, out: Path, sla: Sla, client: dict,
             factory: Callable, warmup: int = 1) -> tuple[dict, list[RequestRecord]]:
    mode_dir = out / spec.name
    mode_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    dep = factory(spec.config_path, spec.overrides, run_dir=mode_dir / "deploy")
    startup_s = time.monotonic() - t0
    progress = Progress(len(workload.requests), spec.name)
    try:
        cfg = ClientConfig(base_url=dep.router_url, **client)
        if warmup:   # first forward passes are slow (allocations, lazy init): keep them out
            run_workload_sync(replace(cfg, fetch_trace=False), warmup_requests(workload, warmup))
        cpu0, wan0 = cpu_seconds(dep), wan_sent_bytes(dep, fetch_metrics(dep))
        records, duration_s = run_workload_sync(cfg, workload.requests, progress.update)
        cpu = {k: v - cpu0[k] for k, v in cpu_seconds(dep).items() if k in cpu0}
        metrics = fetch_metrics(dep)
        wan1 = wan_sent_bytes(dep, metrics)
        save_run_artefacts(dep, spec, mode_dir, metrics)
    finally:
        progress.close()
        dep.stop()
    write_records(mode_dir / "records.jsonl", records)
    summary = summarize_mode(records, sla, float(dep.cost_per_hour), duration_s)
    summary["hit_rate_histogram"] = hit_rate_histogram([r.hit_rate for r in records if not r.failed])
    # What crossed the line, by the senders' counters: a relayed request's copy
    # to MD often lands after the request has ended, so the requests' own sum
    # (kept as `wan_bytes_in_requests`) missed it: 110 of 203 MB in
    # `results/wan-bound-49`'s PDD. The simulator counts every copy alike.
    summary["wan_bytes_in_requests"] = summary["wan_bytes"]
    if wan0 is not None and wan1 is not None:
        summary["wan_bytes"] = max(wan1 - wan0, 0.0)
    summary.update({"config": spec.config_path, "overrides": spec.overrides,
                    "deployment": getattr(dep, "name", spec.name), "startup_s": startup_s,
                    "cpu_s": cpu, "warmup_requests": max(warmup, 0)})
    # the engines' step costs by shape, for the report's comparison with the baseline's
    shapes = read_step_shapes(mode_dir / "steps.jsonl")
    if shapes is not None:
        summary["step_shapes"] = shapes
    return summary, records


def cpu_seconds(dep) -> dict[str, float]:
    """CPU seconds (user + system, all threads) used so far by each process
    of a real deployment (instances, router, WAN relay) and by this bench
    client. The engines share two cores with all of them; the difference
    over a run says how much of the machine went elsewhere than the engines.
    """
    out = {"bench_client": time.process_time()}
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    for p in getattr(dep, "procs", []) or []:
        try:
            fields = Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        out[p.name] = (int(fields[11]) + int(fields[12])) / tick   # utime, stime
    return out


def fetch_metrics(dep) -> dict[str, bytes]:
    """The Prometheus text of every instance of a real deployment and of its
    router, by name (those that answered); none for a deployment without a
    spec (a fake one)."""
    import urllib.request

    dspec = getattr(dep, "spec", None)
    if dspec is None or not hasattr(dep, "instance_url"):
        return {}
    # An instance's port may speak TLS (MD under [tls] mode "wan"): the
    # deployment says how to reach it (base URL, SSL context or None).
    urls = {}
    for inst in dspec.instances:
        url, ctx = dep.instance_url(inst.name)
        urls[inst.name] = (url + "/metrics", ctx)
    urls["router"] = (f"http://{dspec.router_host}:{dspec.router_port}/metrics", None)
    out = {}
    for name, (url, ctx) in urls.items():
        try:
            with urllib.request.urlopen(url, timeout=10.0, context=ctx) as r:
                out[name] = r.read()
        except OSError:
            pass
    return out


def wan_sent_bytes(dep, metrics: dict[str, bytes]) -> float | None:
    """KV bytes every instance of a real deployment has sent over the WAN so
    far (`pdd_kv_sent_bytes_total{link="wan"}` in `fetch_metrics`' texts);
    None for a deployment without instances (a fake one) or where one of
    them did not answer."""
    dspec = getattr(dep, "spec", None)
    names = [i.name for i in dspec.instances] if dspec is not None else []
    if not names or any(n not in metrics for n in names):
        return None
    return sum(sum_metric(metrics[n].decode(), "pdd_kv_sent_bytes_total", link="wan") for n in names)


def sum_metric(text: str, name: str, **labels: str) -> float:
    """The sum of a Prometheus text exposition's samples of `name` whose labels include `labels`."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        head, _, value = line.rpartition(" ")
        if all(w in head for w in want):
            total += float(value)
    return total


def run_bench(modes: list[ModeSpec], workload: Workload, out: Path, sla: Sla,
              client: dict | None = None, factory: Callable | None = None,
              baseline: str | None = None, plots: bool = True, warmup: int = 1) -> dict:
    """Run every mode, write all outputs under `out`, return summary.json's content."""
    from pdd.measure import report

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    factory = factory or _default_factory()
    summary: dict = {"workload": workload.describe(),
                     "sla": {"ttft_s": sla.ttft_s, "tpot_s": sla.tpot_s},
                     "modes": {}}
    all_records: dict[str, list[RequestRecord]] = {}
    save_workload(workload, out / "workload.json")
    for spec in modes:
        print(f"== {spec.name}: {spec.config_path} {spec.overrides or ''}", file=sys.stderr)
        try:
            summary["modes"][spec.name], all_records[spec.name] = run_mode(
                spec, workload, out, sla, client or {}, factory, warmup)
        except Exception as e:  # noqa: BLE001 - one broken mode must not lose the others
            traceback.print_exc()
            summary["modes"][spec.name] = {"error": f"{type(e).__name__}: {e}",
                                           "config": spec.config_path, "overrides": spec.overrides}
        write_json(out / "summary.json", summary)   # after each mode: partial results survive
    summary["baseline"] = report.pick_baseline(summary, baseline)
    if plots:
        summary["figures"] = _plots(out, all_records, workload)
    write_json(out / "summary.json", summary)
    (out / "report.md").write_text(report.render_markdown(summary))
    return summary


def _plots(out: Path, all_records: dict[str, list[RequestRecord]], workload: Workload) -> list[str]:
    try:
        from pdd.measure import plots
        return plots.write_all(out, all_records, workload)
    except Exception:  # noqa: BLE001 - figures are a bonus; numbers are already written
        traceback.print_exc()
        return []


# -- artefacts for the simulator (pdd sim --calibrate / --validate) -------------
def save_run_artefacts(dep, spec: ModeSpec, mode_dir: Path, metrics: dict[str, bytes] | None = None) -> None:
    """deploy.toml (+ overrides.json) and steps.jsonl of a real deployment.

    Also the Prometheus text of every instance and the router under
    `metrics/` (`metrics`: as `fetch_metrics` got them, else fetched here).
    Fake deployments (no `.spec` / `.secret`) are skipped; a failure here is
    reported and never costs the mode its measured records.
    """
    try:
        src = Path(spec.config_path)
        if src.is_file():
            (mode_dir / "deploy.toml").write_text(src.read_text())
        if spec.overrides:
            write_json(mode_dir / "overrides.json", spec.overrides)
        dspec = getattr(dep, "spec", None)
        secret = getattr(dep, "secret", None) if dspec is not None else None
        if dspec is None or not isinstance(secret, bytes):
            return
        with open(mode_dir / "steps.jsonl", "w") as f:
            for inst in dspec.instances:
                url, ctx = dep.instance_url(inst.name)
                for rec in fetch_steps(url, secret, inst.name, context=ctx):
                    f.write(json.dumps(rec) + "\n")
        # Prometheus counters (KV bytes and transfer seconds per link, ...), for diagnosis.
        (mode_dir / "metrics").mkdir(exist_ok=True)
        for name, text in (fetch_metrics(dep) if metrics is None else metrics).items():
            (mode_dir / "metrics" / f"{name}.prom").write_bytes(text)
    except Exception:  # noqa: BLE001 - calibration data is a bonus
        traceback.print_exc()


def fetch_steps(base_url: str, secret: bytes, target: str, timeout_s: float = 30.0,
                context: ssl.SSLContext | None = None) -> list[dict]:
    """GET /internal/steps, signed for instance `target` with the key derived
    from the deployment `secret`: one dict per engine step, tagged with instance and role.
    context: for an https base URL (Deployment.instance_url), else None."""
    import urllib.request

    from pdd.keys import DeploymentKeys
    from pdd.server.http_auth import sign

    path = "/internal/steps"
    headers = sign(DeploymentKeys.derive(secret).internal_http, "GET", path, target)
    req = urllib.request.Request(base_url + path, headers=headers)
    with urllib.request.urlopen(req, timeout=timeout_s, context=context) as r:
        doc = json.loads(r.read())
    return [{"instance": doc.get("instance"), "role": doc.get("role"), **s} for s in doc.get("steps", [])]
