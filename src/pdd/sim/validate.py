"""`pdd sim --validate RUN`: replay a `pdd bench` run in the simulator.

For every mode of RUN (results/<bench run>) it simulates that mode's saved
deploy.toml (+ overrides) on the saved workload.json with the run's SLA and
the CPU profile calibrated from the run's own steps.jsonl files, and writes
RUN/validation.json with signed relative errors, (sim - real) / real:

    {"modes": {mode: {"ttft_p50", "ttft_p90", "tpot_mean", "goodput_rps",
                      "real": {...}, "sim": {...}, "decisions": {...}}},
     "targets": {...}, ...}

`decisions` compares, request by request, the pipeline the real router chose
(records.jsonl) with the simulator's: how many agree, and the pairs that
differ ("relay -> direct": real relay, simulated direct).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from pdd.bench.metrics import Sla
from pdd.bench.runner import load_workload
from pdd.deploy.spec import load_spec
from pdd.sim.calibration import CpuCalibration, fit
from pdd.sim.deployment import RuntimeOptions, model_shape
from pdd.sim.runner import _finite
from pdd.sim.runtime import RuntimeMode, run_runtime_mode

METRICS = {
    "ttft_p50": ("ttft_s", "p50"),
    "ttft_p90": ("ttft_s", "p90"),
    "tpot_mean": ("tpot_s", "mean"),
    "goodput_rps": ("goodput_rps", None),
}
TARGETS = {"ttft_p50": 0.10, "ttft_p90": 0.10, "tpot_mean": 0.05}


def _get(entry: dict, key: str, sub: str | None) -> float | None:
    v = entry.get(key)
    if sub is not None:
        v = (v or {}).get(sub)
    return v if isinstance(v, (int, float)) and math.isfinite(v) else None


def rel_error(sim: float | None, real: float | None) -> float | None:
    if sim is None or real is None or real == 0:
        return None
    return (sim - real) / real


def modes_of(run: Path, summary: dict) -> list[RuntimeMode]:
    out = []
    for name, real in summary.get("modes", {}).items():
        if "error" in real:
            continue
        deploy = run / name / "deploy.toml"
        path = deploy if deploy.is_file() else Path(real.get("config", ""))
        if not path.is_file():
            continue
        out.append(RuntimeMode(name, str(path), real.get("overrides"), run=name))
    return out


def validate(run: Path, calibration: CpuCalibration | None = None,
             opts: RuntimeOptions = RuntimeOptions()) -> dict:
    run = Path(run)
    summary = json.loads((run / "summary.json").read_text())
    sla = Sla(**summary["sla"])
    workload = load_workload(run / "workload.json")
    modes = modes_of(run, summary)
    if not modes:
        raise ValueError(f"{run}: no mode with a deploy.toml to replay")
    if calibration is None:
        calibration = fit([run], model_shape(load_spec(modes[0].config_path)))
    out: dict = {"run": str(run), "sla": summary["sla"], "targets": TARGETS,
                 "calibration": calibration.to_dict(),
                 "options": vars(opts), "modes": {}}
    for m in modes:
        real = summary["modes"][m.name]
        sim, records, _ = run_runtime_mode(m, workload, sla, calibration, opts)
        row: dict = {}
        for metric, (key, sub) in METRICS.items():
            row[metric] = rel_error(_get(sim, key, sub), _get(real, key, sub))
        row["real"] = {k: _get(real, *v) for k, v in METRICS.items()}
        row["sim"] = {k: _get(sim, *v) for k, v in METRICS.items()}
        row["sim"]["pipelines"] = sim["sim"]["pipelines"]
        row["decisions"] = compare_decisions(run / m.name / "records.jsonl", records)
        out["modes"][m.name] = row
    (run / "validation.json").write_text(json.dumps(_finite(out), indent=2) + "\n")
    return out


# The router's and the simulator's names for the same outcome.
_SAME = {"relay_only": "relay_filtered"}


def compare_decisions(real_path: Path, sim_records: list) -> dict | None:
    if not real_path.is_file():
        return None
    real = {}
    for line in real_path.read_text().splitlines():
        if line.strip():
            d = json.loads(line)
            real[d["request_id"]] = d.get("pipeline")
    agree, differ, n = 0, {}, 0
    for r in sim_records:
        if r.request_id not in real or real[r.request_id] is None:
            continue         # baselines: the router records no pipeline
        n += 1
        want = _SAME.get(real[r.request_id], real[r.request_id])
        if want == r.pipeline:
            agree += 1
        else:
            key = f"{want} -> {r.pipeline}"
            differ[key] = differ.get(key, 0) + 1
    return {"compared": n, "agree": agree, "differ": differ} if n else None


def print_table(v: dict) -> None:
    print(f"{'mode':<12}" + "".join(f"{m:>22}" for m in METRICS))
    print(f"{'':<12}" + "".join(f"{'real -> sim (err)':>22}" for _ in METRICS))
    for name, row in v["modes"].items():
        cells = []
        for metric in METRICS:
            r, s, e = row["real"][metric], row["sim"][metric], row[metric]
            unit = 1e3 if metric == "tpot_mean" else 1.0
            txt = "n/a" if e is None else f"{r * unit:.3g}->{s * unit:.3g} ({e:+.0%})"
            cells.append(f"{txt:>22}")
        print(f"{name:<12}" + "".join(cells))
    print("TTFT in s, TPOT in ms, goodput in req/s; targets: |err| <= 10% TTFT, 5% TPOT")
    for name, row in v["modes"].items():
        d = row.get("decisions")
        if d:
            print(f"{name}: pipeline decisions agree on {d['agree']}/{d['compared']} requests"
                  + (f" (real -> sim: {d['differ']})" if d["differ"] else ""))
