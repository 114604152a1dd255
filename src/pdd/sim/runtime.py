"""Simulate runtime deployment files on a `pdd bench` workload.

`simulate_deployments` is `pdd bench`'s `run_bench` with the simulator in
place of the processes: the same workload (same requests, same closed or
open loop), the same deployment files, the same `summarize_mode`, the same
summary.json schema (`workload`, `sla`, `modes.<mode>`, `baseline`) plus
`wall_s` and `simulated_s`, the same `<mode>/records.jsonl`, report.md and
figures.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from pdd.deploy.spec import load_spec
from pdd.measure.files import write_json, write_records
from pdd.measure.metrics import Sla, run_duration, summarize_mode
from pdd.measure.workload import Workload, hit_rate_histogram, warmup_requests
from pdd.sim.bench_stream import BenchStream
from pdd.sim.cluster import Cluster
from pdd.sim.deployment import RuntimeOptions, block_size, mode_from_spec, model_shape
from pdd.sim.runner import _stats
from pdd.sim.scenario import Scenario, SimSettings

# No bench run lasts this long; a safety net for a stuck closed loop.
HORIZON_S = 1e6


@dataclass(frozen=True)
class RuntimeMode:
    name: str
    config_path: str
    overrides: dict | None = None
    run: str | None = None       # the bench mode folder it replays (its machine load)


def run_runtime_mode(m: RuntimeMode, workload: Workload, sla: Sla, calibration=None,
                     opts: RuntimeOptions = RuntimeOptions(),
                     event_log=None, warmup: int = 0,
                     arrivals: dict[str, float] | None = None) -> tuple[dict, list, float]:
    """(summary entry, records in workload order, simulated seconds) of one
    deployment; `event_log` (`pdd.sim.events.EventLog`) receives its events;
    `warmup`: the requests its bench sent before the run, routed first;
    `arrivals`: a recorded run's send time per request id (`BenchStream`)."""
    spec = load_spec(m.config_path, m.overrides)
    entry, records, now = run_runtime_spec(spec, m.name, workload, sla, calibration, opts, m.run,
                                           event_log, warmup, arrivals)
    entry.update({"config": m.config_path, "overrides": m.overrides})
    return entry, records, now


def run_runtime_spec(spec, name: str, workload: Workload, sla: Sla, calibration=None,
                     opts: RuntimeOptions = RuntimeOptions(),
                     run: str | None = None, event_log=None, warmup: int = 0,
                     arrivals: dict[str, float] | None = None) -> tuple[dict, list, float]:
    """`run_runtime_mode` for a DeploymentSpec already in memory (`pdd plan`)."""
    mode = mode_from_spec(spec, name, calibration, opts, run=run)
    scenario = Scenario(model_shape(spec), None, sla, (mode,), SimSettings(drain_s=HORIZON_S))
    stream = BenchStream(workload, block_size(spec), arrivals)
    cluster = Cluster(mode, scenario, stream, event_log.for_mode(name) if event_log is not None else None)
    cluster.route_warmup([(r.request_id, len(r.prompt_token_ids), r.max_tokens)
                          for r in warmup_requests(workload, warmup)])
    t0 = time.perf_counter()
    reqs = cluster.run(HORIZON_S)
    wall = time.perf_counter() - t0
    by_id = {r.spec.request_id: r.record() for r in reqs}
    records = [by_id[r.request_id] for r in workload.requests if r.request_id in by_id]
    entry = summarize_mode(records, sla, mode.cost_per_hour(), run_duration(records))
    entry["hit_rate_histogram"] = hit_rate_histogram([r.hit_rate for r in records if not r.failed])
    entry.update({"deployment": spec.name, "startup_s": 0.0, "sim": _stats(cluster, records, wall),
                  "warmup_requests": max(warmup, 0)})
    if arrivals is not None:
        entry["sim"]["arrivals_held"] = stream.held
    return entry, records, cluster.loop.now


def simulate_deployments(modes: list[RuntimeMode], workload: Workload, sla: Sla,
                         out: Path | None = None, calibration=None,
                         opts: RuntimeOptions = RuntimeOptions(), plots: bool = True,
                         event_log=None, warmup: int = 0) -> dict:
    t0 = time.perf_counter()
    summary: dict = {"workload": workload.describe(),
                     "sla": {"ttft_s": sla.ttft_s, "tpot_s": sla.tpot_s}, "modes": {}}
    all_records = {}
    simulated = 0.0
    for m in modes:
        entry, records, sim_s = run_runtime_mode(m, workload, sla, calibration, opts, event_log, warmup)
        summary["modes"][m.name] = entry
        all_records[m.name] = records
        simulated = max(simulated, sim_s)
        if out is not None:
            (out / m.name).mkdir(parents=True, exist_ok=True)
            write_records(out / m.name / "records.jsonl", records)
    summary["wall_s"] = time.perf_counter() - t0
    summary["simulated_s"] = simulated
    if calibration is not None:
        summary["calibration"] = calibration.to_dict()
    if out is not None:
        from pdd.measure import report

        out.mkdir(parents=True, exist_ok=True)
        summary["baseline"] = report.pick_baseline(summary)
        if plots:
            try:
                from pdd.measure import plots
                summary["figures"] = plots.write_all(out, all_records, workload)
            except Exception:  # noqa: BLE001 - figures are a bonus
                summary["figures"] = []
        write_json(out / "summary.json", summary)
        (out / "report.md").write_text(report.render_markdown(summary))
    return summary


def is_runtime_file(path: Path) -> bool:
    """A deployment file has [[instances]]; a simulator scenario has [[mode]]."""
    import tomllib

    doc = tomllib.loads(Path(path).read_text())
    return "instances" in doc and "mode" not in doc
