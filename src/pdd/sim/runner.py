"""Run every mode of a scenario and summarise them side by side.

Output: summary.json `{"modes": {mode: summarize_mode(...) + {"sim": ...}},
"wall_s", "simulated_s"}`, the same summariser `pdd bench` uses, so a
measured and a simulated run read alike; optionally one JSON line per request.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from pathlib import Path

from pdd.measure import files
from pdd.measure.metrics import summarize_mode
from pdd.sim.cluster import Cluster
from pdd.sim.scenario import ModeSpec, Scenario
from pdd.sim.workload import (
    AgenticStream, AgenticWorkload, FixedHitStream, FixedHitWorkload, TraceStream,
)


def make_stream(scenario: Scenario):
    w = scenario.workload
    if isinstance(w, FixedHitWorkload):
        return FixedHitStream(w)
    return AgenticStream(w) if isinstance(w, AgenticWorkload) else TraceStream(w)


def run_mode(scenario: Scenario, mode: ModeSpec, event_log=None) -> tuple[dict, list, float]:
    """Simulate one mode; returns (summary entry, records, simulated seconds).
    `event_log` (`pdd.sim.events.EventLog`) receives every event of the run."""
    st = scenario.settings
    duration = scenario.workload.duration_s
    if math.isinf(duration):
        specs = make_stream(scenario).initial()
        duration = max((s.arrival_s for s in specs), default=0.0)
    cluster = Cluster(mode, scenario, make_stream(scenario),
                      event_log.for_mode(mode.name) if event_log is not None else None)
    t0 = time.perf_counter()
    reqs = cluster.run(duration + st.drain_s)
    wall = time.perf_counter() - t0
    records = [r.record() for r in reqs if r.spec.arrival_s >= st.warmup_s]
    entry = summarize_mode(records, scenario.sla, mode.cost_per_hour(),
                           max(duration - st.warmup_s, 1e-9))
    entry["sim"] = _stats(cluster, records, wall)
    return entry, records, cluster.loop.now


def _stats(cluster: Cluster, records: list, wall_s: float) -> dict:
    now = max(cluster.loop.now, 1e-9)
    pools: dict[str, dict] = {}
    for inst in cluster.instances.values():
        key = f"{inst.role.value}/{inst.cost.hw.name}x{inst.cost.chips}"
        p = pools.setdefault(key, {"instances": 0, "busy_s": 0.0, "steps": 0,
                                   "kv_blocks": inst.kv_blocks, "block_size": inst.block_size})
        p["instances"] += 1
        p["busy_s"] += inst.busy_s
        p["steps"] += inst.num_steps
    for p in pools.values():
        p["utilization"] = p.pop("busy_s") / (now * p["instances"])
    return {
        "wall_s": wall_s,
        "simulated_s": cluster.loop.now,
        "num_events": cluster.loop.num_events,
        "chips": cluster.mode.num_chips(),
        "pipelines": dict(Counter(r.pipeline for r in records)),
        "handoff_modes": dict(Counter(r.handoff_mode for r in records if r.handoff_mode)),
        "link_bytes": {n: l.bytes_delivered for n, l in cluster.links.items()},
        "pools": pools,
    }


def simulate(scenario: Scenario, out_dir: Path | None = None, write_records: bool = False,
             event_log=None) -> dict:
    t0 = time.perf_counter()
    summary: dict = {"modes": {}}
    simulated = 0.0
    for mode in scenario.modes:
        entry, recs, sim_s = run_mode(scenario, mode, event_log)
        summary["modes"][mode.name] = entry
        simulated = max(simulated, sim_s)
        if out_dir is not None and write_records:
            out_dir.mkdir(parents=True, exist_ok=True)
            files.write_records(out_dir / f"records-{mode.name}.jsonl", recs)
    summary["wall_s"] = time.perf_counter() - t0
    summary["simulated_s"] = simulated
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        files.write_json(out_dir / "summary.json", summary)
    return summary

